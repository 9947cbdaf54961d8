"""Persistence for TokenSwift Studio: projects, chapters, generation runs and their metrics.

The UI queues runs and reads; the worker claims runs and streams output into the
database. Knows nothing of torch, gradio or the model.

    from storage import open_database, create_project
    db = open_database()            # $TOKENSWIFT_DB or data/studio.db, migrated to head
    project = create_project(db, "My novel")
"""

from .db import Database, open_database, resolve_url
from .errors import NotFoundError, StorageError, ValidationError
from .models import (
    CHAPTER_STATUSES, LOCAL_OWNER, PROJECT_KINDS, RUN_METHODS, RUN_MODES, RUN_STATUSES,
    Chapter, ChapterRevision, Comparison, LoreEntry, Project, Run, StepMetric, WorkerState,
)
from .queries import (
    MAX_GOAL_WORDS, MAX_LORE_TOKENS, STEP_FIELDS, active_runs, add_chapter, append_output, claim_next_run, create_comparison,
    create_project, delete_chapter, delete_project, enqueue_run, finish_run, first_divergence, get_chapter,
    get_comparison, get_project, get_revision, get_run, get_run_token_ids, get_steps, get_worker_states,
    is_cancel_requested, latest_run_for_chapter, list_chapters, list_comparisons, list_projects, list_revisions,
    list_runs, mark_interrupted, move_chapter, queue_position, rename_project, request_cancel, restore_revision,
    set_chapter_text, set_comparison_divergence, set_run_prompt, set_worker_state, settle_comparison,
    start_chapter_run, transfer_projects, update_chapter, update_project,
)
from .snapshot import import_project, project_snapshot
from .story import (
    apply_outline, keywords_of, latest_outline_run, list_lore, queue_outline, queue_summary, set_lore, set_summary, summary_run,
)

__all__ = [
    "Database", "open_database", "resolve_url", "NotFoundError",
    "StorageError", "ValidationError", "CHAPTER_STATUSES", "PROJECT_KINDS", "RUN_METHODS", "RUN_MODES",
    "RUN_STATUSES", "LOCAL_OWNER", "Chapter", "ChapterRevision", "Comparison", "LoreEntry", "Project", "Run", "StepMetric",
    "WorkerState", "MAX_GOAL_WORDS", "MAX_LORE_TOKENS", "STEP_FIELDS", "active_runs", "add_chapter", "append_output", "claim_next_run",
    "create_comparison", "create_project", "delete_chapter", "delete_project", "enqueue_run", "finish_run",
    "first_divergence", "get_chapter", "get_comparison", "get_project", "get_revision", "get_run", "get_run_token_ids",
    "get_steps", "get_worker_states", "is_cancel_requested", "latest_run_for_chapter", "list_chapters",
    "list_comparisons", "list_projects", "list_revisions", "list_runs", "mark_interrupted", "move_chapter",
    "queue_position", "rename_project", "request_cancel", "restore_revision", "set_chapter_text",
    "set_comparison_divergence", "set_worker_state",
    "settle_comparison", "start_chapter_run", "transfer_projects", "update_chapter", "update_project",
    "import_project", "project_snapshot", "apply_outline", "keywords_of", "latest_outline_run", "list_lore", "queue_outline", "queue_summary", "set_lore",
    "set_summary", "summary_run",
]
