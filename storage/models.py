"""The database schema, as typed SQLAlchemy models.

This module owns the tables and the allowed values of their status/kind columns;
it holds no behaviour (see ``storage.queries``). The schema itself is created by
the Alembic migrations in ``storage/migrations``: change a model, then add a
migration (see ``storage.db``). All timestamps are naive UTC.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import ForeignKey, Index, MetaData, String, Text, true
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

log = logging.getLogger(__name__)

PROJECT_KINDS = ("novel", "report", "other")
CHAPTER_STATUSES = ("empty", "draft", "generating", "done")
RUN_MODES = ("generate", "continue", "regenerate", "resume", "compare", "summary", "outline")
RUN_METHODS = ("ar", "tokenswift")
RUN_STATUSES = ("queued", "running", "done", "failed", "cancelled", "interrupted")
ACTIVE_STATUSES = ("queued", "running")
FINAL_STATUSES = ("done", "failed", "cancelled", "interrupted")
# The writer of a single-user studio (a laptop): every row made without a signed-in or browser-keyed writer.
LOCAL_OWNER = "local"
MAX_OWNER = 100
# Who wrote a chapter's summary: nobody yet, the model (a summary run) or the writer (a hand edit, which the
# automatic summaries then leave alone).
SUMMARY_SOURCES = ("", "model", "writer")
DEFAULT_LORE_TOKENS = 400


def utcnow() -> datetime:
    # Naive UTC: SQLite drops tz info anyway, and one convention keeps comparisons
    # (stale heartbeats, queue order) correct on every backend.
    return datetime.now(UTC).replace(tzinfo=None)


class JSONDict(TypeDecorator[dict]):
    """A dict stored as JSON text.

    A damaged value reads back as ``{}`` with a logged warning, so one bad row
    cannot break a whole listing; the stored text is left as it is.
    """

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: dict | None, dialect: Any) -> str | None:
        return None if value is None else json.dumps(value, allow_nan=False)

    def process_result_value(self, value: str | None, dialect: Any) -> dict:
        try:
            out = json.loads(value) if value is not None else {}
        except ValueError:
            out = None
        if not isinstance(out, dict):
            log.warning("ignoring corrupt JSON settings %.80r; using {}", value)
            return {}
        return out


class Base(DeclarativeBase):
    # Named constraints let Alembic batch migrations (SQLite table rebuilds) find them.
    metadata = MetaData(naming_convention={
        "ix": "ix_%(column_0_label)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    })

    def __repr__(self) -> str:
        keys = ", ".join(f"{c.key}={getattr(self, str(c.key))!r}" for c in self.__mapper__.primary_key)
        return f"<{type(self).__name__} {keys}>"


class Project(Base):
    __tablename__ = "projects"

    id: Mapped[int] = mapped_column(primary_key=True)
    # Who may see it: LOCAL_OWNER, "hf:<username>" or "key:<hash of a browser's secret key>" (app.identity).
    owner: Mapped[str] = mapped_column(String(MAX_OWNER), default=LOCAL_OWNER, server_default=LOCAL_OWNER,
                                       index=True)
    title: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(20), default="novel")
    premise: Mapped[str] = mapped_column(Text, default="")
    settings: Mapped[dict[str, Any]] = mapped_column(JSONDict, default=dict)  # default generation settings
    goal_words: Mapped[int | None]  # the writer's word-count goal for the whole project
    # The story's memory (app.prompting): at most this many prompt tokens for lorebook entries, and whether a
    # chapter's summary is written by the model after each of its runs.
    lore_tokens: Mapped[int] = mapped_column(default=DEFAULT_LORE_TOKENS, server_default=str(DEFAULT_LORE_TOKENS))
    auto_summary: Mapped[bool] = mapped_column(default=True, server_default=true())
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Chapter(Base):
    __tablename__ = "chapters"
    __table_args__ = (Index("ix_chapters_project_position", "project_id", "position"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    position: Mapped[int]  # 0-based, dense within a project
    title: Mapped[str] = mapped_column(String(200))
    instructions: Mapped[str] = mapped_column(Text, default="")
    text: Mapped[str] = mapped_column(Text, default="")
    word_count: Mapped[int] = mapped_column(default=0)
    status: Mapped[str] = mapped_column(String(20), default="empty")
    summary: Mapped[str] = mapped_column(Text, default="", server_default="")  # "story so far" for later prompts
    summary_source: Mapped[str] = mapped_column(String(20), default="", server_default="")  # SUMMARY_SOURCES
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class LoreEntry(Base):
    """A lorebook entry: a character, a place, a rule of the world, put into a chapter's prompt when one of its
    keywords appears in the recent text or the chapter's instructions."""

    __tablename__ = "lore_entries"
    __table_args__ = (Index("ix_lore_entries_project_position", "project_id", "position"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    position: Mapped[int]  # the writer's order, which is also the order of priority within the token share
    name: Mapped[str] = mapped_column(String(200))
    keywords: Mapped[str] = mapped_column(Text, default="")  # comma-separated
    text: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ChapterRevision(Base):
    """An earlier text of a chapter, saved before it was replaced."""

    __tablename__ = "chapter_revisions"

    id: Mapped[int] = mapped_column(primary_key=True)
    chapter_id: Mapped[int] = mapped_column(ForeignKey("chapters.id", ondelete="CASCADE"), index=True)
    text: Mapped[str] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(String(40))  # "regenerate", "manual edit", ...
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Comparison(Base):
    """The same prompt and settings run with plain AR decoding and with TokenSwift."""

    __tablename__ = "comparisons"

    id: Mapped[int] = mapped_column(primary_key=True)
    owner: Mapped[str] = mapped_column(String(MAX_OWNER), default=LOCAL_OWNER, server_default=LOCAL_OWNER,
                                       index=True)
    project_id: Mapped[int | None] = mapped_column(ForeignKey("projects.id", ondelete="SET NULL"), index=True)
    prompt: Mapped[str] = mapped_column(Text)
    settings: Mapped[dict[str, Any]] = mapped_column(JSONDict, default=dict)
    # Plain ids, no foreign keys: runs point at their comparison, and a cycle of
    # foreign keys would complicate table creation and batch migrations.
    ar_run_id: Mapped[int | None]
    tokenswift_run_id: Mapped[int | None]
    tokens_match: Mapped[bool | None]
    first_divergence: Mapped[int | None]  # first differing token index (or the shorter length)
    # Where the runs differ, vanilla decoding's draw there as the worker recomputed it (core/generation/divergence.py:
    # position, both tokens, top-1 / top-2 and their gap, the raw logits' gap); {} until then, or if it failed.
    divergence: Mapped[dict[str, Any] | None] = mapped_column(JSONDict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Run(Base):
    """One generation job: queued by the UI, claimed and executed by a worker."""

    __tablename__ = "runs"
    __table_args__ = (Index("ix_runs_status_queued_at", "status", "queued_at", "id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    # Its project's or comparison's owner, kept when those are deleted (history, per-writer queue limits).
    owner: Mapped[str] = mapped_column(String(MAX_OWNER), default=LOCAL_OWNER, server_default=LOCAL_OWNER,
                                       index=True)
    # SET NULL: deleting a project or chapter keeps the run history.
    project_id: Mapped[int | None] = mapped_column(ForeignKey("projects.id", ondelete="SET NULL"), index=True)
    chapter_id: Mapped[int | None] = mapped_column(ForeignKey("chapters.id", ondelete="SET NULL"), index=True)
    comparison_id: Mapped[int | None] = mapped_column(ForeignKey("comparisons.id", ondelete="SET NULL"), index=True)
    # A "summary" run writes the summary of this chapter (not its text: chapter_id stays NULL, so a summary never
    # counts as the chapter's latest run).
    summary_of: Mapped[int | None] = mapped_column(ForeignKey("chapters.id", ondelete="SET NULL"), index=True)
    mode: Mapped[str] = mapped_column(String(20))
    method: Mapped[str] = mapped_column(String(20))
    model: Mapped[str] = mapped_column(String(500))
    heads: Mapped[str | None] = mapped_column(String(500))
    settings: Mapped[dict[str, Any]] = mapped_column(JSONDict, default=dict)
    prompt: Mapped[str | None] = mapped_column(Text)  # the text actually fed to the model
    # What went into a chapter prompt: each part's tokens and what was left out (app.prompting.PromptReport).
    prompt_info: Mapped[dict[str, Any] | None] = mapped_column(JSONDict)
    status: Mapped[str] = mapped_column(String(20), default="queued")
    cancel_requested: Mapped[bool] = mapped_column(default=False)
    worker_id: Mapped[str | None] = mapped_column(String(100))
    queued_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    n_tokens: Mapped[int] = mapped_column(default=0)
    prefill_s: Mapped[float | None]
    decode_s: Mapped[float | None]
    tokens_per_s: Mapped[float | None]
    mean_accepted: Mapped[float | None]  # tokens produced per decoding step
    text: Mapped[str] = mapped_column(Text, default="")  # this run's own output
    # JSON list as text, appended to in SQL. Never loaded with the row (it can be
    # large): read it with queries.get_run_token_ids().
    token_ids: Mapped[str] = mapped_column(Text, default="[]", deferred=True, deferred_raiseload=True)
    error: Mapped[str | None] = mapped_column(Text)


class StepMetric(Base):
    """Per decoding-step metrics of a run, for the live charts."""

    __tablename__ = "step_metrics"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step: Mapped[int] = mapped_column(primary_key=True)
    new_tokens: Mapped[int]
    accepted: Mapped[int] = mapped_column(default=0)  # draft tokens accepted
    from_ngram: Mapped[int] = mapped_column(default=0)
    tree_size: Mapped[int] = mapped_column(default=0)
    step_ms: Mapped[float]
    tokens_so_far: Mapped[int]
    tokens_per_s: Mapped[float | None]
    repetition: Mapped[float | None]


class WorkerState(Base):
    """What a worker process is doing, for the UI's "loading model… / ready" line."""

    __tablename__ = "worker_states"

    worker_id: Mapped[str] = mapped_column(String(100), primary_key=True)
    state: Mapped[str] = mapped_column(String(40))  # "loading model", "compiling", "ready", "stopped"
    message: Mapped[str] = mapped_column(Text, default="")
    model: Mapped[str | None] = mapped_column(String(500))
    pid: Mapped[int | None]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
