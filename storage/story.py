"""The story's memory in the database: chapter summaries, the lorebook, and applying an outline.

A chapter's summary is written by a "summary" run (``queue_summary``; the worker streams its output into
``chapters.summary``) or by the writer (``set_summary``). A summary the writer wrote is theirs: automatic summaries
leave it alone, only an explicit request replaces it. The lorebook is a project's ordered list of entries, saved
as a whole (``set_lore``), the way the writer edits it in one table. An outline (titles and instructions, usually
proposed by an "outline" run) is applied to the chapters in one transaction (``apply_outline``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import delete, select

from .db import Database
from .errors import ValidationError
from .models import ACTIVE_STATUSES, Chapter, LoreEntry, Project, Run
from .queries import (
    MAX_INSTRUCTIONS, MAX_PROMPT, MAX_TITLE, _check_queue, _choice, _owned, _owner_of, _settings, _text,
)

MAX_SUMMARY = 20_000
MAX_LORE_ENTRIES = 200
MAX_LORE_TEXT = 10_000
MAX_KEYWORDS = 1_000
MAX_OUTLINE_ROWS = 200
SUMMARY_METHODS = ("ar", "tokenswift")


# -- summaries ----------------------------------------------------------------------------------------------------------

def set_summary(db: Database, chapter_id: int, summary: str, owner: str | None = None) -> Chapter:
    """The writer's own summary of a chapter (empty: none). Refused while a summary run writes it."""
    summary = _text(summary, "summary", MAX_SUMMARY).strip()
    with db.write() as s:
        chapter = _owned(s, Chapter, chapter_id, owner, lock=True)
        if _active_summary_run(s, chapter_id) is not None:
            raise ValidationError("The model is writing this chapter's summary; stop that run before editing it.")
        chapter.summary, chapter.summary_source = summary, "writer" if summary else ""
    return chapter


def _active_summary_run(s: Any, chapter_id: int) -> int | None:
    return s.scalar(select(Run.id).where(Run.summary_of == chapter_id, Run.status.in_(ACTIVE_STATUSES)).limit(1))


def queue_summary(db: Database, chapter_id: int, *, model: str, settings: Mapping[str, Any], method: str = "tokenswift",
                  heads: str | None = None, owner: str | None = None, auto: bool = False,
                  max_queued: int | None = None) -> Run | None:
    """Queue a run that writes the chapter's summary; its prompt is built when a worker claims it.

    ``auto`` (after a chapter run ended): nothing is queued, and None returned, when the project has automatic
    summaries off, the writer wrote the summary themselves, the chapter is empty or a summary run is already
    waiting. Asked for by the writer (``auto`` False) those are refusals with a reason, except the writer's own
    summary, which the model then replaces.
    """
    _text(model, "model name", 500, required=True)
    _choice(method, "method", SUMMARY_METHODS)
    settings = _settings(settings)
    with db.write() as s:
        chapter = _owned(s, Chapter, chapter_id, owner, lock=True)
        project = s.get(Project, chapter.project_id)
        writer = _owner_of(s, chapter)
        skip = None
        if _active_summary_run(s, chapter_id) is not None:
            skip = "This chapter's summary is already being written."
        elif not chapter.text.strip():
            skip = "This chapter has no text to summarize yet."
        if auto and (skip or not project.auto_summary or chapter.summary_source == "writer"):
            return None
        if skip:
            raise ValidationError(skip)
        _check_queue(s, writer, 1, max_queued)
        run = Run(owner=writer, mode="summary", method=method, model=model, heads=heads, settings=settings,
                  project_id=chapter.project_id, summary_of=chapter_id)
        s.add(run)
    return run


def queue_outline(db: Database, project_id: int, *, model: str, settings: Mapping[str, Any], prompt: str,
                  heads: str | None = None, owner: str | None = None, max_queued: int | None = None) -> Run:
    """Queue a run that proposes an outline of the project (`prompt`: app.prompting's). Refused while another
    outline of it is queued or running, or when its writer already has ``max_queued`` runs waiting."""
    _text(model, "model name", 500, required=True)
    settings = _settings(settings)
    _text(prompt, "prompt", MAX_PROMPT, required=True)
    with db.write() as s:
        project = _owned(s, Project, project_id, owner, lock=True)
        if s.scalar(select(Run.id).where(Run.project_id == project_id, Run.mode == "outline",
                                         Run.status.in_(ACTIVE_STATUSES)).limit(1)):
            raise ValidationError("An outline for this project is already being written.")
        _check_queue(s, project.owner, 1, max_queued)
        run = Run(owner=project.owner, mode="outline", method="tokenswift", model=model, heads=heads,
                  settings=settings, prompt=prompt, project_id=project_id)
        s.add(run)
    return run


def summary_run(db: Database, chapter_id: int) -> Run | None:
    """The chapter's latest summary run (without its text), or None."""
    with db.read() as s:
        return s.scalars(select(Run).where(Run.summary_of == chapter_id).order_by(Run.id.desc()).limit(1)).first()


# -- lorebook ---------------------------------------------------------------------------------------------------------

def keywords_of(raw: str) -> list[str]:
    """The keywords of a comma-separated list (blank ones dropped, duplicates kept once, order kept)."""
    seen: dict[str, None] = {}
    for word in raw.split(","):
        word = " ".join(word.split())
        if word and word.lower() not in {k.lower() for k in seen}:
            seen[word] = None
    return list(seen)


def list_lore(db: Database, project_id: int, owner: str | None = None) -> list[LoreEntry]:
    """A project's lorebook in the writer's order."""
    with db.read() as s:
        _owned(s, Project, project_id, owner)
        return list(s.scalars(select(LoreEntry).where(LoreEntry.project_id == project_id)
                              .order_by(LoreEntry.position, LoreEntry.id)))


def set_lore(db: Database, project_id: int, entries: Sequence[Mapping[str, Any]],
             owner: str | None = None) -> list[LoreEntry]:
    """Replace a project's lorebook with ``entries`` (dicts with name, keywords, text), in that order.

    Rows with no name, keywords or text are dropped (a table's blank lines). An entry needs a name and at least one
    keyword (without one it could never be used); names are unique within the project.
    """
    rows = lore_rows(entries)
    with db.write() as s:
        _owned(s, Project, project_id, owner, lock=True)
        s.execute(delete(LoreEntry).where(LoreEntry.project_id == project_id))
        for row in rows:
            row.project_id = project_id
        s.add_all(rows)
    return rows


def lore_rows(entries: Sequence[Mapping[str, Any]]) -> list[LoreEntry]:
    """``entries`` checked and numbered as unsaved lorebook rows (see ``set_lore``); ValidationError if bad."""
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence) or len(entries) > MAX_LORE_ENTRIES:
        raise ValidationError(f"A lorebook is a list of at most {MAX_LORE_ENTRIES} entries.")
    rows: list[LoreEntry] = []
    names: set[str] = set()
    for i, entry in enumerate(entries, 1):
        if not isinstance(entry, Mapping):
            raise ValidationError(f"Lorebook entry {i} must be a mapping of name, keywords and text.")
        name = _text(entry.get("name") or "", f"name of lorebook entry {i}", MAX_TITLE).strip()
        keywords = _text(entry.get("keywords") or "", f"keywords of lorebook entry {i}", MAX_KEYWORDS)
        text = _text(entry.get("text") or "", f"text of lorebook entry {i}", MAX_LORE_TEXT).strip()
        if not (name or keywords.strip() or text):
            continue
        if not name:
            raise ValidationError(f"Lorebook entry {i} needs a name.")
        if name.lower() in names:
            raise ValidationError(f"Two lorebook entries are named {name!r}; names must differ.")
        words = keywords_of(keywords)
        if not words:
            raise ValidationError(f"Lorebook entry {name!r} needs at least one keyword (comma-separated) that "
                                  "brings it into a prompt.")
        names.add(name.lower())
        rows.append(LoreEntry(position=len(rows), name=name, keywords=", ".join(words), text=text))
    return rows


# -- outline ----------------------------------------------------------------------------------------------------------

def apply_outline(db: Database, project_id: int, rows: Sequence[tuple[str, str]],
                  owner: str | None = None) -> tuple[int, int]:
    """Make the project's chapters follow an outline: row i (title, instructions) sets chapter i's title and
    instructions, adding chapters past the last. Rows with neither are skipped, a blank title keeps the chapter's
    own; chapters beyond the outline and every chapter's text are left as they are. Returns (added, updated)."""
    plan: list[tuple[str, str]] = []
    for i, row in enumerate(rows, 1):
        if len(row) != 2:
            raise ValidationError(f"Outline row {i} must have a title and instructions.")
        title = _text(row[0] if row[0] is not None else "", f"title in outline row {i}", MAX_TITLE).strip()
        instructions = _text(row[1] if row[1] is not None else "", f"instructions in outline row {i}",
                             MAX_INSTRUCTIONS).strip()
        if title or instructions:
            plan.append((title, instructions))
    if not plan:
        raise ValidationError("The outline is empty: give at least one chapter a title or instructions.")
    if len(plan) > MAX_OUTLINE_ROWS:
        raise ValidationError(f"An outline has at most {MAX_OUTLINE_ROWS} chapters.")
    added = updated = 0
    with db.write() as s:
        _owned(s, Project, project_id, owner, lock=True)
        chapters = list(s.scalars(select(Chapter).where(Chapter.project_id == project_id)
                                  .order_by(Chapter.position, Chapter.id)))
        n = len(chapters)
        for position, (title, instructions) in enumerate(plan):
            if position < len(chapters):
                chapter = chapters[position]
                new_title = title or chapter.title
                if (new_title, instructions) == (chapter.title, chapter.instructions):
                    continue
                chapter.title, chapter.instructions = new_title, instructions
                updated += 1
            else:
                s.add(Chapter(project_id=project_id, position=n, title=title or f"Chapter {n + 1}",
                              instructions=instructions))
                n += 1
                added += 1
    return added, updated


def latest_outline_run(db: Database, project_id: int, owner: str | None = None) -> Run | None:
    """The project's latest outline run (with its text), or None."""
    with db.read() as s:
        _owned(s, Project, project_id, owner)
        return s.scalars(select(Run).where(Run.project_id == project_id, Run.mode == "outline")
                         .order_by(Run.id.desc()).limit(1)).first()
