"""Everything the app and the worker do with the database, one short transaction each.

Functions take the ``Database`` first and return detached model objects
(loaded columns stay readable after the session closes). Long texts are never
rewritten from Python while generating: output is appended in SQL
(``text = text || :delta``). Token ids live in ``runs.token_ids`` as JSON text,
appended the same way; read them with ``get_run_token_ids``.

Ownership: projects, comparisons and runs have an ``owner`` (a writer; ``LOCAL_OWNER`` on a single-user
studio). Every function that takes ``owner`` acts only on that writer's rows: another writer's id raises the same
NotFoundError as an id that does not exist, so nothing about other writers leaks. ``owner=None`` means unscoped:
the worker and the tools, never the UI.

Delete semantics: deleting a project deletes its chapters and their revisions;
its runs and comparisons are kept (their project/chapter ids become NULL) and
active ones are cancelled. Deleting a chapter does the same for its runs.

Chapter runs (``start_chapter_run``): the UI queues them; when a worker claims
one, the chapter is prepared in the same transaction: for "regenerate" the old
text is saved as a revision and cleared, for the other modes the text is kept
and the run's output is appended to it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import and_, case, delete, func, insert, or_, select, true, update
from sqlalchemy.orm import Session, defer

from .db import Database
from .errors import NotFoundError, StorageError, ValidationError
from .models import (
    ACTIVE_STATUSES, FINAL_STATUSES, LOCAL_OWNER, MAX_OWNER, PROJECT_KINDS, RUN_METHODS, RUN_MODES,
    Chapter, ChapterRevision, Comparison, Project, Run, StepMetric, WorkerState, utcnow,
)

log = logging.getLogger(__name__)

MAX_TITLE = 200
MAX_PREMISE = 20_000
MAX_INSTRUCTIONS = 20_000
MAX_PROMPT = 1_000_000
MAX_GOAL_WORDS = 10_000_000
MAX_LORE_TOKENS = 4096
CHAPTER_MODES = ("generate", "continue", "regenerate", "resume")
STEP_FIELDS = {  # name -> default (... = required)
    "step": ..., "new_tokens": ..., "step_ms": ..., "tokens_so_far": ...,
    "accepted": 0, "from_ngram": 0, "tree_size": 0, "tokens_per_s": None, "repetition": None,
}

M = TypeVar("M")


# -- helpers ----------------------------------------------------------------------

def _get(s: Session, model: type[M], id: Any, lock: bool = False) -> M:
    # lock: FOR UPDATE on PostgreSQL; on SQLite write transactions are already exclusive.
    obj = s.get(model, id, with_for_update=lock or None)
    if obj is None:
        raise NotFoundError(f"{model.__name__} {id} does not exist.")
    return obj


def _owner_of(s: Session, obj: Any) -> str | None:
    if isinstance(obj, ChapterRevision):
        obj = _get(s, Chapter, obj.chapter_id)
    if isinstance(obj, Chapter):
        return s.scalar(select(Project.owner).where(Project.id == obj.project_id))
    return obj.owner


def _owned(s: Session, model: type[M], id: Any, owner: str | None, lock: bool = False) -> M:
    """``_get``, and for a given ``owner`` the row must be theirs (else the very same NotFoundError)."""
    obj = _get(s, model, id, lock)
    if owner is not None and _owner_of(s, obj) != owner:
        raise NotFoundError(f"{model.__name__} {id} does not exist.")
    return obj


def _check_owner(owner: Any) -> str:
    return _text(owner, "owner", MAX_OWNER, required=True)


def _text(value: Any, what: str, max_len: int, required: bool = False) -> str:
    if not isinstance(value, str):
        raise ValidationError(f"The {what} must be text.")
    if required and not value.strip():
        raise ValidationError(f"The {what} cannot be empty.")
    if len(value) > max_len:
        raise ValidationError(f"The {what} is too long ({len(value):,} characters; the limit is {max_len:,}).")
    return value


def _choice(value: Any, what: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValidationError(f"Unknown {what} {value!r}; expected one of: {', '.join(allowed)}.")
    return value


def _settings(value: Mapping[str, Any] | None) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValidationError("Settings must be a dictionary.")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValidationError(f"Settings cannot be stored as JSON: {e}.") from None
    return dict(value)


def _words(text: str) -> int:
    return len(text.split())


def _fix_chapter_status(s: Session, chapter_id: int | None, run_status: str) -> None:
    """After a run ends: its chapter is done, or a draft/empty depending on its text."""
    if chapter_id is None:
        return
    status = "done" if run_status == "done" else case((Chapter.text == "", "empty"), else_="draft")
    s.execute(update(Chapter).where(Chapter.id == chapter_id).values(status=status))


def _cancel_active(s: Session, *where: Any) -> None:
    """Cancel queued runs at once and flag running ones (used before deletes)."""
    now = utcnow()
    s.execute(update(Run).where(*where, Run.status == "queued")
              .values(status="cancelled", cancel_requested=True, finished_at=now))
    s.execute(update(Run).where(*where, Run.status == "running").values(cancel_requested=True))


# -- projects ---------------------------------------------------------------------

def create_project(db: Database, title: str, kind: str = "novel", premise: str = "",
                   settings: Mapping[str, Any] | None = None, *, owner: str = LOCAL_OWNER) -> Project:
    """Create ``owner``'s project. Raises ValidationError for an empty/long title, unknown kind or long premise."""
    project = Project(owner=_check_owner(owner), title=_text(title, "title", MAX_TITLE, required=True).strip(),
                      kind=_choice(kind, "project kind", PROJECT_KINDS),
                      premise=_text(premise, "premise", MAX_PREMISE), settings=_settings(settings))
    with db.write() as s:
        s.add(project)
    return project


def list_projects(db: Database, owner: str | None = None) -> list[Project]:
    """The projects (of ``owner``, or all), most recently updated first."""
    query = select(Project).order_by(Project.updated_at.desc(), Project.id.desc())
    if owner is not None:
        query = query.where(Project.owner == owner)
    with db.read() as s:
        return list(s.scalars(query))


def get_project(db: Database, project_id: int, owner: str | None = None) -> Project:
    """One project; NotFoundError if missing (or another writer's)."""
    with db.read() as s:
        return _owned(s, Project, project_id, owner)


def rename_project(db: Database, project_id: int, title: str, owner: str | None = None) -> Project:
    """Change a project's title."""
    title = _text(title, "title", MAX_TITLE, required=True).strip()
    with db.write() as s:
        project = _owned(s, Project, project_id, owner, lock=True)
        project.title = title
    return project


def update_project(db: Database, project_id: int, *, premise: str | None = None, kind: str | None = None,
                   settings: Mapping[str, Any] | None = None, goal_words: int | None = None,
                   lore_tokens: int | None = None, auto_summary: bool | None = None,
                   owner: str | None = None) -> Project:
    """Change a project's premise, kind, default generation settings, word goal (a goal of 0 removes it), the
    lorebook's token share and/or whether chapters are summarized after their runs (None = keep)."""
    if lore_tokens is not None and (isinstance(lore_tokens, bool) or not isinstance(lore_tokens, int)
                                    or not 0 <= lore_tokens <= MAX_LORE_TOKENS):
        raise ValidationError(f"The lorebook's share must be a whole number of tokens from 0 to "
                              f"{MAX_LORE_TOKENS:,}, got {lore_tokens!r}.")
    if auto_summary is not None and not isinstance(auto_summary, bool):
        raise ValidationError(f"Automatic summaries must be on or off, got {auto_summary!r}.")
    if goal_words is not None and (isinstance(goal_words, bool) or not isinstance(goal_words, int)
                                   or not 0 <= goal_words <= MAX_GOAL_WORDS):
        raise ValidationError(f"The word goal must be a whole number from 0 (no goal) to {MAX_GOAL_WORDS:,}, "
                              f"got {goal_words!r}.")
    with db.write() as s:
        project = _owned(s, Project, project_id, owner, lock=True)
        if premise is not None:
            project.premise = _text(premise, "premise", MAX_PREMISE)
        if kind is not None:
            project.kind = _choice(kind, "project kind", PROJECT_KINDS)
        if settings is not None:
            project.settings = _settings(settings)
        if goal_words is not None:
            project.goal_words = goal_words or None
        if lore_tokens is not None:
            project.lore_tokens = lore_tokens
        if auto_summary is not None:
            project.auto_summary = auto_summary
    return project


def delete_project(db: Database, project_id: int, owner: str | None = None) -> None:
    """Delete a project with its chapters; its runs are kept (project_id NULL), active ones cancelled."""
    with db.write() as s:
        _owned(s, Project, project_id, owner, lock=True)
        _cancel_active(s, Run.project_id == project_id)
        s.execute(delete(Project).where(Project.id == project_id))  # FKs cascade / set NULL


def transfer_projects(db: Database, from_owner: str, to_owner: str) -> int:
    """Give everything ``from_owner`` made (projects, comparisons, runs) to ``to_owner``; returns the projects moved.

    A writer who signs in keeps what they wrote under their browser key.
    """
    from_owner, to_owner = _check_owner(from_owner), _check_owner(to_owner)
    if from_owner == to_owner:
        return 0
    with db.write() as s:
        moved = s.execute(update(Project).where(Project.owner == from_owner).values(owner=to_owner)).rowcount
        for model in (Comparison, Run):
            s.execute(update(model).where(model.owner == from_owner).values(owner=to_owner))
    return moved


# -- chapters ---------------------------------------------------------------------

def add_chapter(db: Database, project_id: int, title: str = "", instructions: str = "",
                owner: str | None = None) -> Chapter:
    """Append a chapter at the end of a project (an empty title becomes "Chapter N")."""
    _text(title, "chapter title", MAX_TITLE)
    _text(instructions, "instructions", MAX_INSTRUCTIONS)
    with db.write() as s:
        _owned(s, Project, project_id, owner, lock=True)
        n = s.scalar(select(func.count()).where(Chapter.project_id == project_id)) or 0
        chapter = Chapter(project_id=project_id, position=n, title=title.strip() or f"Chapter {n + 1}",
                          instructions=instructions)
        s.add(chapter)
    return chapter


def list_chapters(db: Database, project_id: int, with_text: bool = False, owner: str | None = None) -> list[Chapter]:
    """A project's chapters in order (none if it is another writer's). Without ``with_text`` the text is not loaded."""
    query = select(Chapter).where(Chapter.project_id == project_id).order_by(Chapter.position, Chapter.id)
    if owner is not None:
        query = query.join(Project, Project.id == Chapter.project_id).where(Project.owner == owner)
    if not with_text:
        query = query.options(defer(Chapter.text))
    with db.read() as s:
        return list(s.scalars(query))


def get_chapter(db: Database, chapter_id: int, owner: str | None = None) -> Chapter:
    """One chapter with its text; NotFoundError if missing (or another writer's)."""
    with db.read() as s:
        return _owned(s, Chapter, chapter_id, owner)


def update_chapter(db: Database, chapter_id: int, *, title: str | None = None,
                   instructions: str | None = None, owner: str | None = None) -> Chapter:
    """Change a chapter's title and/or instructions (None = keep)."""
    with db.write() as s:
        chapter = _owned(s, Chapter, chapter_id, owner, lock=True)
        if title is not None:
            chapter.title = _text(title, "chapter title", MAX_TITLE, required=True).strip()
        if instructions is not None:
            chapter.instructions = _text(instructions, "instructions", MAX_INSTRUCTIONS)
    return chapter


def set_chapter_text(db: Database, chapter_id: int, text: str, reason: str = "manual edit",
                     owner: str | None = None) -> Chapter:
    """Replace a chapter's text by hand; the old text is saved as a revision first if it differed.

    Refused while a run is writing into the chapter.
    """
    if not isinstance(text, str):
        raise ValidationError("The chapter text must be text.")
    with db.write() as s:
        chapter = _owned(s, Chapter, chapter_id, owner, lock=True)
        if s.scalar(select(Run.id).where(Run.chapter_id == chapter_id, Run.status == "running").limit(1)):
            raise ValidationError("This chapter is being generated; cancel the run before editing it.")
        if chapter.text != text:
            if chapter.text:
                s.add(ChapterRevision(chapter_id=chapter_id, text=chapter.text, reason=reason))
            chapter.text, chapter.word_count = text, _words(text)
            if not text:
                chapter.status = "empty"
            elif chapter.status == "empty":
                chapter.status = "draft"
    return chapter


def list_revisions(db: Database, chapter_id: int, owner: str | None = None) -> list[ChapterRevision]:
    """A chapter's saved earlier texts, newest first."""
    with db.read() as s:
        _owned(s, Chapter, chapter_id, owner)
        return list(s.scalars(select(ChapterRevision).where(ChapterRevision.chapter_id == chapter_id)
                              .order_by(ChapterRevision.id.desc())))


def get_revision(db: Database, revision_id: int, owner: str | None = None) -> ChapterRevision:
    """One saved earlier text; NotFoundError if missing (or another writer's)."""
    with db.read() as s:
        return _owned(s, ChapterRevision, revision_id, owner)


def restore_revision(db: Database, revision_id: int, owner: str | None = None) -> Chapter:
    """Make a saved earlier text the chapter's text again; the current text is saved as a revision first.

    Nothing is deleted: restoring is itself undone by restoring the revision it saved. Refused while a run is
    writing into the chapter.
    """
    with db.read() as s:
        revision = _owned(s, ChapterRevision, revision_id, owner)
    return set_chapter_text(db, revision.chapter_id, revision.text, reason=f"before restoring #{revision.id}",
                            owner=owner)


def _renumber(s: Session, order: list[int]) -> None:
    for position, id in enumerate(order):
        s.execute(update(Chapter).where(Chapter.id == id, Chapter.position != position).values(position=position))


def _chapter_order(s: Session, project_id: int) -> list[int]:
    return list(s.scalars(select(Chapter.id).where(Chapter.project_id == project_id)
                          .order_by(Chapter.position, Chapter.id)))


def move_chapter(db: Database, chapter_id: int, new_position: int, owner: str | None = None) -> Chapter:
    """Move a chapter to ``new_position`` (0-based, clamped); positions are renumbered 0..n-1."""
    with db.write() as s:
        chapter = _owned(s, Chapter, chapter_id, owner, lock=True)
        order = _chapter_order(s, chapter.project_id)
        order.remove(chapter_id)
        order.insert(max(0, min(int(new_position), len(order))), chapter_id)
        _renumber(s, order)
        s.refresh(chapter)
    return chapter


def delete_chapter(db: Database, chapter_id: int, owner: str | None = None) -> None:
    """Delete a chapter and its revisions; its runs are kept (chapter_id NULL), active ones cancelled."""
    with db.write() as s:
        project_id = _owned(s, Chapter, chapter_id, owner, lock=True).project_id
        _cancel_active(s, or_(Run.chapter_id == chapter_id, Run.summary_of == chapter_id))
        s.execute(delete(Chapter).where(Chapter.id == chapter_id))
        _renumber(s, _chapter_order(s, project_id))


# -- runs: queueing -----------------------------------------------------------------

def _check_queue(s: Session, owner: str, adding: int, max_queued: int | None) -> None:
    """Refuse ``adding`` more queued runs of ``owner`` beyond ``max_queued`` (None: no limit)."""
    if max_queued is None:
        return
    waiting = s.scalar(select(func.count()).where(Run.owner == owner, Run.status == "queued")) or 0
    if waiting + adding > max_queued:
        raise ValidationError(f"You already have {waiting} run(s) waiting in the queue; this studio takes at most "
                              f"{max_queued} per writer. Wait for one to start, or stop one.")


def enqueue_run(db: Database, *, mode: str, method: str, model: str, settings: Mapping[str, Any] | None = None,
                prompt: str | None = None, heads: str | None = None, project_id: int | None = None,
                chapter_id: int | None = None, comparison_id: int | None = None, summary_of: int | None = None,
                owner: str = LOCAL_OWNER, max_queued: int | None = None) -> Run:
    """Queue ``owner``'s run (status "queued"). For chapter runs prefer ``start_chapter_run``, for summaries
    ``storage.story.queue_summary``. Refused when the writer would have more than ``max_queued`` runs waiting."""
    run = Run(mode=_choice(mode, "mode", RUN_MODES), method=_choice(method, "method", RUN_METHODS),
              model=_text(model, "model name", 500, required=True), heads=heads, settings=_settings(settings),
              prompt=prompt, project_id=project_id, chapter_id=chapter_id, comparison_id=comparison_id,
              summary_of=summary_of, owner=_check_owner(owner))
    with db.write() as s:
        for table, id in ((Project, project_id), (Chapter, chapter_id), (Comparison, comparison_id),
                          (Chapter, summary_of)):
            if id is not None:
                _owned(s, table, id, owner)
        _check_queue(s, owner, 1, max_queued)
        s.add(run)
    return run


def start_chapter_run(db: Database, chapter_id: int, mode: str, *, method: str, model: str,
                      settings: Mapping[str, Any] | None = None, heads: str | None = None,
                      prompt: str | None = None, owner: str | None = None, max_queued: int | None = None) -> Run:
    """Queue a generate / continue / regenerate / resume run that writes into a chapter.

    Nothing changes in the chapter until a worker claims the run; ``claim_next_run``
    then, in the same transaction, marks the chapter "generating" and, for
    "regenerate", saves its text as a revision and clears it. For the other modes
    the text is kept and the output appended. Refused if the chapter already has
    a queued or running run, or when its writer already has ``max_queued`` runs waiting.
    """
    _choice(mode, "chapter mode", CHAPTER_MODES)
    with db.write() as s:
        chapter = _owned(s, Chapter, chapter_id, owner, lock=True)
        if s.scalar(select(Run.id).where(Run.chapter_id == chapter_id, Run.status.in_(ACTIVE_STATUSES)).limit(1)):
            raise ValidationError("This chapter already has a run queued or in progress.")
        writer = _owner_of(s, chapter)
        _check_queue(s, writer, 1, max_queued)
        run = Run(owner=writer, mode=mode, method=_choice(method, "method", RUN_METHODS),
                  model=_text(model, "model name", 500, required=True), heads=heads,
                  settings=_settings(settings), prompt=prompt, project_id=chapter.project_id, chapter_id=chapter_id)
        s.add(run)
    return run


def claim_next_run(db: Database, worker_id: str) -> Run | None:
    """Atomically take the oldest queued run for ``worker_id`` (status -> "running"); None if none may start.

    One UPDATE picks and flips the row, so two workers can never get the same run:
    on SQLite it runs under BEGIN IMMEDIATE (one writer at a time), on PostgreSQL
    the inner SELECT uses FOR UPDATE SKIP LOCKED. A writer runs one run at a time:
    runs of a writer who already has one running wait, so with several workers one
    writer's queue cannot take them all. The local writer of a single-user studio
    is exempt (their runs may use every worker).
    """
    now = utcnow()
    busy = select(Run.owner).where(Run.status == "running", Run.owner != LOCAL_OWNER)
    oldest = (select(Run.id).where(Run.status == "queued", Run.owner.not_in(busy))
              .order_by(Run.queued_at, Run.id).limit(1)
              .with_for_update(skip_locked=True).scalar_subquery())
    with db.write() as s:
        run = s.scalars(update(Run).where(Run.id == oldest, Run.status == "queued")
                        .values(status="running", worker_id=worker_id, started_at=now, heartbeat_at=now)
                        .returning(Run)).one_or_none()
        if run is not None and run.summary_of is not None:
            # A summary run writes the chapter's summary afresh (its output is appended as it comes).
            s.execute(update(Chapter).where(Chapter.id == run.summary_of).values(summary="", summary_source="model"))
        if run is not None and run.chapter_id is not None:
            chapter = _get(s, Chapter, run.chapter_id)
            if run.mode == "regenerate" and chapter.text:
                s.add(ChapterRevision(chapter_id=chapter.id, text=chapter.text, reason="regenerate"))
                chapter.text, chapter.word_count = "", 0
            chapter.status = "generating"
    return run


# -- runs: progress -------------------------------------------------------------------

def _step_rows(run_id: int, steps: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for step in steps:
        if unknown := set(step) - set(STEP_FIELDS):
            raise ValidationError(f"Unknown step metric field(s): {', '.join(sorted(unknown))}.")
        row = {"run_id": run_id}
        for name, default in STEP_FIELDS.items():
            if name not in step and default is ...:
                raise ValidationError(f"Step metric {name!r} is missing.")
            row[name] = step.get(name, default)
        rows.append(row)
    return rows


def append_output(db: Database, run_id: int, text_delta: str = "", token_ids_delta: Sequence[int] = (),
                  steps: Iterable[Mapping[str, Any]] = (), *, prefill_s: float | None = None,
                  tokens_per_s: float | None = None, mean_accepted: float | None = None) -> None:
    """Record a batch of output of a running run, in one transaction.

    Appends ``text_delta`` to the run's text and, if the run writes into a chapter,
    to the chapter's text (updating its word count); appends the token ids; bumps
    n_tokens and the heartbeat; inserts the step metric rows (dicts with the
    ``STEP_FIELDS`` keys). Progress values left as None keep their stored value.
    An empty call is a plain heartbeat. Call it in batches (say every 0.5 s),
    not per token: each call rewrites the run's row.

    Raises StorageError if the run is no longer running (cancelled, interrupted),
    so a stale worker cannot write into a chapter someone else now owns.
    """
    ids = [int(t) for t in token_ids_delta]
    rows = _step_rows(run_id, steps)
    values: dict[str, Any] = {"heartbeat_at": utcnow()}
    if text_delta:
        values["text"] = Run.text + text_delta
    if ids:
        body = ",".join(map(str, ids))
        # "[1,2]" -> "[1,2,3,4]" without reading the list back into Python.
        values["token_ids"] = case((Run.token_ids == "[]", f"[{body}]"),
                                   else_=func.rtrim(Run.token_ids, "]", type_=Run.token_ids.type) + f",{body}]")
        values["n_tokens"] = Run.n_tokens + len(ids)
    for name, value in (("prefill_s", prefill_s), ("tokens_per_s", tokens_per_s), ("mean_accepted", mean_accepted)):
        if value is not None:
            values[name] = value
    with db.write() as s:
        row = s.execute(update(Run).where(Run.id == run_id, Run.status == "running")
                        .values(**values).returning(Run.chapter_id, Run.summary_of)).one_or_none()
        if row is None:
            status = _get(s, Run, run_id).status
            raise StorageError(f"Run {run_id} is {status}, not running; its output was not saved.")
        if row.summary_of is not None and text_delta:
            s.execute(update(Chapter).where(Chapter.id == row.summary_of)
                      .values(summary=Chapter.summary + text_delta))
        chapter_id = row.chapter_id
        if chapter_id is not None and text_delta:
            # Exact word count without reading the chapter back: a word continues
            # across the boundary when the old text ends in a non-space character.
            last = s.scalar(select(func.substr(Chapter.text, func.length(Chapter.text))).where(Chapter.id == chapter_id))
            added = _words((last or "") + text_delta) - _words(last or "")
            s.execute(update(Chapter).where(Chapter.id == chapter_id)
                      .values(text=Chapter.text + text_delta, word_count=Chapter.word_count + added))
        if rows:
            s.execute(insert(StepMetric), rows)


def set_run_prompt(db: Database, run_id: int, prompt: str, info: Mapping[str, Any] | None = None) -> None:
    """Record the prompt a worker built for its running run (resumes and later chunks reuse it exactly) and, for a
    chapter prompt, ``info``: what went into it (shown under the chapter)."""
    prompt = _text(prompt, "Prompt", MAX_PROMPT)
    values: dict[str, Any] = {"prompt": prompt}
    if info is not None:
        values["prompt_info"] = _settings(info)
    with db.write() as s:
        s.execute(update(Run).where(Run.id == run_id, Run.status == "running").values(**values))


def finish_run(db: Database, run_id: int, status: str, error: str | None = None, *,
               prefill_s: float | None = None, decode_s: float | None = None) -> Run:
    """End a running run as done / failed / cancelled / interrupted, and fix its chapter's status.

    Computes tokens_per_s (n_tokens / decode_s) and mean_accepted (mean new tokens
    per step) when possible, and settles the run's comparison. A run that is not
    running any more (e.g. already interrupted) is returned unchanged.
    """
    _choice(status, "final status", FINAL_STATUSES)
    with db.write() as s:
        run = _get(s, Run, run_id, lock=True)
        if run.status != "running":
            return run
        run.status, run.error, run.finished_at = status, error, utcnow()
        if prefill_s is not None:
            run.prefill_s = prefill_s
        if decode_s is not None:
            run.decode_s = decode_s
            if decode_s > 0:
                run.tokens_per_s = run.n_tokens / decode_s
        mean = s.scalar(select(func.avg(StepMetric.new_tokens)).where(StepMetric.run_id == run_id))
        if mean is not None:
            run.mean_accepted = float(mean)
        _fix_chapter_status(s, run.chapter_id, status)
    if run.comparison_id is not None:
        try:
            settle_comparison(db, run.comparison_id)
        except StorageError as e:  # the run itself is finished and saved; only the verdict is missing
            log.warning("could not settle comparison %s: %s", run.comparison_id, e)
    return run


def request_cancel(db: Database, run_id: int, owner: str | None = None) -> str:
    """Cancel a run: a queued one becomes "cancelled" at once, a running one is flagged for its worker.

    Returns the run's status afterwards (finished runs are left alone).
    """
    with db.write() as s:
        run = _owned(s, Run, run_id, owner, lock=True)
        if run.status in ACTIVE_STATUSES:
            run.cancel_requested = True
        if run.status == "queued":
            run.status, run.finished_at = "cancelled", utcnow()
        return run.status


def is_cancel_requested(db: Database, run_id: int) -> bool:
    """Whether the UI asked to stop this run (one indexed read; poll it between steps)."""
    with db.read() as s:
        flag = s.scalar(select(Run.cancel_requested).where(Run.id == run_id))
    if flag is None:
        raise NotFoundError(f"Run {run_id} does not exist.")
    return flag


def mark_interrupted(db: Database, worker_id: str | None = None, *, stale_after_s: float | None = None) -> list[int]:
    """Mark abandoned running runs "interrupted" (their text is kept); returns their ids.

    Call at worker start. Targets running runs of ``worker_id`` and/or whose
    heartbeat is older than ``stale_after_s``; with neither given, all running runs.
    Their chapters become "draft" (or "empty") so they can be resumed.
    """
    conds = []
    if worker_id is not None:
        conds.append(Run.worker_id == worker_id)
    if stale_after_s is not None:
        cutoff = utcnow() - timedelta(seconds=stale_after_s)
        conds.append(or_(Run.heartbeat_at.is_(None), Run.heartbeat_at < cutoff))
    with db.write() as s:
        rows = s.execute(update(Run).where(Run.status == "running", or_(*conds) if conds else true())
                         .values(status="interrupted", finished_at=utcnow(),
                                 error="Interrupted: the worker stopped before the run finished.")
                         .returning(Run.id, Run.chapter_id)).all()
        for _, chapter_id in rows:
            _fix_chapter_status(s, chapter_id, "interrupted")
    return sorted(id for id, _ in rows)


# -- runs: reading ------------------------------------------------------------------------

def get_run(db: Database, run_id: int, owner: str | None = None) -> Run:
    """One run with its text (token ids: ``get_run_token_ids``); NotFoundError if missing (or another writer's)."""
    with db.read() as s:
        return _owned(s, Run, run_id, owner)


def get_run_token_ids(db: Database, run_id: int) -> list[int]:
    """The run's generated token ids. Raises StorageError if the stored list is damaged."""
    with db.read() as s:
        return _token_ids(s, run_id)


def _token_ids(s: Session, run_id: int) -> list[int]:
    raw = s.scalar(select(Run.token_ids).where(Run.id == run_id))
    if raw is None:
        raise NotFoundError(f"Run {run_id} does not exist.")
    try:
        ids = json.loads(raw)
    except ValueError:
        ids = None
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise StorageError(f"The stored token ids of run {run_id} are damaged ({raw[:40]!r}...); "
                           "its text is unaffected.")
    return ids


def queue_position(db: Database, run_id: int) -> int | None:
    """1 if the run is next in the queue, 2 after that, ...; None if it is not queued."""
    with db.read() as s:
        run = _get(s, Run, run_id)
        if run.status != "queued":
            return None
        ahead = or_(Run.queued_at < run.queued_at, and_(Run.queued_at == run.queued_at, Run.id <= run.id))
        return s.scalar(select(func.count()).where(Run.status == "queued", ahead))


def list_runs(db: Database, project_id: int | None = None, limit: int = 50, owner: str | None = None) -> list[Run]:
    """Newest runs first (all, or one project's; of ``owner`` or anyone's), without their texts."""
    # Listings leave out the (long) text; reading run.text afterwards raises.
    query = select(Run).options(defer(Run.text)).order_by(Run.id.desc()).limit(limit)
    if project_id is not None:
        query = query.where(Run.project_id == project_id)
    if owner is not None:
        query = query.where(Run.owner == owner)
    with db.read() as s:
        return list(s.scalars(query))


def active_runs(db: Database) -> list[Run]:
    """Running runs, then queued ones in queue order, without their texts."""
    query = (select(Run).options(defer(Run.text)).where(Run.status.in_(ACTIVE_STATUSES))
             .order_by(Run.status.desc(), Run.queued_at, Run.id))  # "running" sorts before "queued"
    with db.read() as s:
        return list(s.scalars(query))


def latest_run_for_chapter(db: Database, chapter_id: int, owner: str | None = None) -> Run | None:
    """The chapter's most recent run (with its text), or None."""
    with db.read() as s:
        if owner is not None:
            _owned(s, Chapter, chapter_id, owner)
        return s.scalars(select(Run).where(Run.chapter_id == chapter_id).order_by(Run.id.desc()).limit(1)).first()


def get_steps(db: Database, run_id: int, after_step: int | None = None) -> list[StepMetric]:
    """A run's step metrics in order; with ``after_step`` only the newer ones (for live charts)."""
    query = select(StepMetric).where(StepMetric.run_id == run_id).order_by(StepMetric.step)
    if after_step is not None:
        query = query.where(StepMetric.step > after_step)
    with db.read() as s:
        return list(s.scalars(query))


# -- comparisons ---------------------------------------------------------------------

def create_comparison(db: Database, prompt: str, *, model: str, settings: Mapping[str, Any] | None = None,
                      heads: str | None = None, project_id: int | None = None, owner: str = LOCAL_OWNER,
                      max_queued: int | None = None) -> Comparison:
    """Create ``owner``'s comparison and queue its two runs: plain AR first, then TokenSwift (with ``heads``).

    Refused when the writer would have more than ``max_queued`` runs waiting.
    """
    _text(prompt, "prompt", MAX_PROMPT, required=True)
    _text(model, "model name", 500, required=True)
    owner = _check_owner(owner)
    settings = _settings(settings)
    with db.write() as s:
        if project_id is not None:
            _owned(s, Project, project_id, owner)
        _check_queue(s, owner, 2, max_queued)
        comparison = Comparison(owner=owner, project_id=project_id, prompt=prompt, settings=settings)
        s.add(comparison)
        s.flush()
        runs = [Run(owner=owner, mode="compare", method=method, model=model, heads=h, settings=settings,
                    prompt=prompt, project_id=project_id, comparison_id=comparison.id)
                for method, h in (("ar", None), ("tokenswift", heads))]
        s.add_all(runs)
        s.flush()  # ar is inserted first: lower id, so it is claimed first
        comparison.ar_run_id, comparison.tokenswift_run_id = runs[0].id, runs[1].id
    return comparison


def get_comparison(db: Database, comparison_id: int, owner: str | None = None) -> Comparison:
    """One comparison; NotFoundError if missing (or another writer's)."""
    with db.read() as s:
        return _owned(s, Comparison, comparison_id, owner)


def list_comparisons(db: Database, project_id: int | None = None, limit: int = 50,
                     owner: str | None = None) -> list[Comparison]:
    """Newest comparisons first (of ``owner``, or anyone's)."""
    query = select(Comparison).order_by(Comparison.id.desc()).limit(limit)
    if project_id is not None:
        query = query.where(Comparison.project_id == project_id)
    if owner is not None:
        query = query.where(Comparison.owner == owner)
    with db.read() as s:
        return list(s.scalars(query))


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length); None if equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def settle_comparison(db: Database, comparison_id: int) -> Comparison:
    """Once both runs are done, store whether their tokens match and where they first diverge.

    Until then (or if a run failed) the comparison is returned unchanged.
    """
    with db.write() as s:
        comparison = _get(s, Comparison, comparison_id, lock=True)
        ar, ts = comparison.ar_run_id, comparison.tokenswift_run_id
        done = s.scalar(select(func.count()).where(Run.id.in_([ar, ts]), Run.status == "done"))
        if ar is not None and ts is not None and done == 2:
            divergence = first_divergence(_token_ids(s, ar), _token_ids(s, ts))
            comparison.tokens_match, comparison.first_divergence = divergence is None, divergence
    return comparison


def set_comparison_divergence(db: Database, comparison_id: int, divergence: Mapping[str, Any]) -> Comparison:
    """Store the worker's account of where a settled comparison's runs part (its ``position`` must be the
    comparison's first divergence); a comparison whose runs match, or are not both done, is returned unchanged."""
    record = _settings(divergence)
    with db.write() as s:
        comparison = _get(s, Comparison, comparison_id, lock=True)
        if comparison.tokens_match is not False:
            return comparison
        if record.get("position") != comparison.first_divergence:
            raise ValidationError(f"The divergence at token {record.get('position')} is not where comparison "
                                  f"{comparison_id}'s runs first differ (token {comparison.first_divergence}).")
        comparison.divergence = record
    return comparison


# -- worker state ----------------------------------------------------------------------

def set_worker_state(db: Database, worker_id: str, state: str, message: str = "", model: str | None = None,
                     pid: int | None = None) -> None:
    """Record what a worker is doing ("loading model", "compiling", "ready", "stopped")."""
    with db.write() as s:
        s.merge(WorkerState(worker_id=worker_id, state=state, message=message, model=model, pid=pid,
                            updated_at=utcnow()))


def get_worker_states(db: Database) -> list[WorkerState]:
    """Every worker's last reported state."""
    with db.read() as s:
        return list(s.scalars(select(WorkerState).order_by(WorkerState.worker_id)))
