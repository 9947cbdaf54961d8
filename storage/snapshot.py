"""A whole project as plain data (JSON-ready) and back: how a project moves between studios.

``project_snapshot`` reads a project with everything a writer made in it: premise, settings, goal, chapters with
their texts, summaries and revisions, and the lorebook. ``import_project`` checks such a snapshot completely, then
creates it as a new project of the importing writer in one transaction: a bad file adds nothing. Runs and
comparisons are history of the studio that made them and are not carried.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import select

from .db import Database
from .errors import ValidationError
from .models import (
    CHAPTER_STATUSES, LOCAL_OWNER, PROJECT_KINDS, SUMMARY_SOURCES, Chapter, ChapterRevision, LoreEntry, Project, utcnow,
)
from .queries import (
    MAX_GOAL_WORDS, MAX_INSTRUCTIONS, MAX_LORE_TOKENS, MAX_PREMISE, MAX_TITLE, _check_owner, _choice, _owned,
    _settings, _text, _words,
)
from .story import MAX_SUMMARY, lore_rows

FORMAT = "tokenswift-studio-project"
VERSION = 1
MAX_CHAPTERS = 1_000
MAX_TEXT = 5_000_000  # characters of one chapter or revision
MAX_REVISIONS = 1_000  # per chapter


def project_snapshot(db: Database, project_id: int, owner: str | None = None) -> dict[str, Any]:
    """Everything the writer made in a project, as JSON-ready data."""
    with db.read() as s:
        project = _owned(s, Project, project_id, owner)
        chapters = list(s.scalars(select(Chapter).where(Chapter.project_id == project_id)
                                  .order_by(Chapter.position, Chapter.id)))
        revisions: dict[int, list[ChapterRevision]] = {c.id: [] for c in chapters}
        for r in s.scalars(select(ChapterRevision).where(ChapterRevision.chapter_id.in_(list(revisions)))
                           .order_by(ChapterRevision.id)):
            revisions[r.chapter_id].append(r)
        lore = list(s.scalars(select(LoreEntry).where(LoreEntry.project_id == project_id)
                              .order_by(LoreEntry.position, LoreEntry.id)))
    return {
        "format": FORMAT, "version": VERSION, "exported_at": utcnow().isoformat(timespec="seconds") + "Z",
        "project": {"title": project.title, "kind": project.kind, "premise": project.premise,
                    "settings": project.settings, "goal_words": project.goal_words,
                    "lore_tokens": project.lore_tokens, "auto_summary": project.auto_summary},
        "chapters": [{"title": c.title, "instructions": c.instructions, "text": c.text, "status": c.status,
                      "summary": c.summary, "summary_source": c.summary_source,
                      "revisions": [{"text": r.text, "reason": r.reason,
                                     "created_at": r.created_at.isoformat(timespec="seconds")}
                                    for r in revisions[c.id]]}
                     for c in chapters],
        "lore": [{"name": e.name, "keywords": e.keywords, "text": e.text} for e in lore],
    }


def import_project(db: Database, snapshot: Any, owner: str = LOCAL_OWNER) -> Project:
    """Create a new project of ``owner`` from a ``project_snapshot`` (of this or another studio).

    Raises ValidationError, naming the part, for anything that is not such a snapshot; nothing is written then.
    """
    owner = _check_owner(owner)
    data = _mapping(snapshot, "The file")
    if data.get("format") != FORMAT:
        raise ValidationError(f"This is not a TokenSwift Studio project (expected \"format\": \"{FORMAT}\").")
    if data.get("version") != VERSION:
        raise ValidationError(f"This project file has version {data.get('version')!r}; this studio reads version "
                              f"{VERSION}.")
    p = _mapping(data.get("project"), "The project")
    goal = p.get("goal_words")
    if goal is not None and (not _whole(goal) or not 0 <= goal <= MAX_GOAL_WORDS):
        raise ValidationError(f"The project's word goal must be a whole number up to {MAX_GOAL_WORDS:,}.")
    lore_tokens = p.get("lore_tokens", 400)
    if not _whole(lore_tokens) or not 0 <= lore_tokens <= MAX_LORE_TOKENS:
        raise ValidationError(f"The project's lorebook share must be a whole number up to {MAX_LORE_TOKENS:,}.")
    auto_summary = p.get("auto_summary", True)
    if not isinstance(auto_summary, bool):
        raise ValidationError("The project's auto_summary must be true or false.")
    project = Project(owner=owner, title=_text(p.get("title"), "project title", MAX_TITLE, required=True).strip(),
                      kind=_choice(p.get("kind", "novel"), "project kind", PROJECT_KINDS),
                      premise=_text(p.get("premise", ""), "premise", MAX_PREMISE),
                      settings=_settings(p.get("settings") or {}), goal_words=goal or None, lore_tokens=lore_tokens,
                      auto_summary=auto_summary)
    chapters = data.get("chapters", [])
    if not isinstance(chapters, list) or len(chapters) > MAX_CHAPTERS:
        raise ValidationError(f"The chapters must be a list of at most {MAX_CHAPTERS:,}.")
    rows = [_chapter(c, i) for i, c in enumerate(chapters, 1)]
    lore = lore_rows(data.get("lore", []))
    with db.write() as s:
        s.add(project)
        s.flush()
        for position, (chapter, revisions) in enumerate(rows):
            chapter.project_id, chapter.position = project.id, position
            s.add(chapter)
            s.flush()
            for revision in revisions:
                revision.chapter_id = chapter.id
            s.add_all(revisions)
        for entry in lore:
            entry.project_id = project.id
        s.add_all(lore)
    return project


def _chapter(raw: Any, i: int) -> tuple[Chapter, list[ChapterRevision]]:
    c = _mapping(raw, f"Chapter {i}")
    text = _text(c.get("text", ""), f"text of chapter {i}", MAX_TEXT)
    status = c.get("status", "draft")
    _choice(status, f"status of chapter {i}", CHAPTER_STATUSES)
    if status == "generating" or (status == "empty") != (not text):  # no run writes it here
        status = "draft" if text else "empty"
    source = c.get("summary_source", "")
    _choice(source, f"summary source of chapter {i}", SUMMARY_SOURCES)
    summary = _text(c.get("summary", ""), f"summary of chapter {i}", MAX_SUMMARY)
    revisions = c.get("revisions", [])
    if not isinstance(revisions, list) or len(revisions) > MAX_REVISIONS:
        raise ValidationError(f"The revisions of chapter {i} must be a list of at most {MAX_REVISIONS:,}.")
    chapter = Chapter(title=_text(c.get("title"), f"title of chapter {i}", MAX_TITLE, required=True).strip(),
                      instructions=_text(c.get("instructions", ""), f"instructions of chapter {i}", MAX_INSTRUCTIONS),
                      text=text, word_count=_words(text), status=status, summary=summary,
                      summary_source=source if summary else "")
    return chapter, [_revision(r, i, j) for j, r in enumerate(revisions, 1)]


def _revision(raw: Any, i: int, j: int) -> ChapterRevision:
    r = _mapping(raw, f"Revision {j} of chapter {i}")
    try:
        when = datetime.fromisoformat(r.get("created_at", "")).replace(tzinfo=None)
    except (TypeError, ValueError):
        raise ValidationError(f"Revision {j} of chapter {i} has no valid created_at time.") from None
    return ChapterRevision(text=_text(r.get("text"), f"text of revision {j} of chapter {i}", MAX_TEXT),
                           reason=_text(r.get("reason", "imported"), f"reason of revision {j} of chapter {i}", 40),
                           created_at=when)


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValidationError(f"{what} must be a JSON object.")
    return value


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
