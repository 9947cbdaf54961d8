"""The Gradio UI of TokenSwift Studio: layout (Write, Compare, History & export), per-session state, event wiring.

The UI never generates. Buttons queue runs through ``app.jobs``; a ``gr.Timer`` (about 1 s) reads progress back
from the database (``app.live``), so a refresh, a second tab or a server restart shows the same text, and many
sessions share one queue. Per-session state lives in ``gr.State`` (ids of what is open, and what the page last
showed); nothing here is module-level mutable state. Every handler turns failures into a readable ``gr.Error``
(escaped: Gradio renders those as HTML), never a traceback. Handlers have ``api_name``s for gradio_client.

Inputs that belong to a project or chapter travel with hidden "owner" ids captured when the page showed them, so a
premise typed for one project can never be saved into another after a quick switch (events may run concurrently).

On a multi-user studio (app.hosting) each session belongs to a writer (app.identity), found by the page-load
handler from the Hugging Face sign-in or the browser's key; every id a handler receives is looked up as that
writer's (storage's ``owner=``), so another writer's project, comparison or run is "not found". A session that
never loaded the page (an API caller that skipped ``/load``) is refused.
"""
from __future__ import annotations

import functools
import html
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr

import storage
from app import export as exporter
from app import identity, jobs, live, settings_panel, story_ui, views
from app.charts import all_figures, buckets_from_rows
from app.handling import guarded, owner_id, page_id, skip_none
from app.hosting import Hosting
from app.live import LiveCache, View
from app.model_offers import Offer
from app.zerogpu import ChunkDriver

log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CSS_PATH = ASSETS / "studio.css"
POLL_S = 1.0
BROWSER_KEY = "tokenswift-studio-view"
WRITER_KEY = "tokenswift-studio-writer"
KIND_CHOICES = [("Novel", "novel"), ("Report", "report"), ("Other", "other")]
EXPORT_CHOICES = [("Markdown", "markdown"), ("Plain text", "text"), ("EPUB", "epub"),
                  ("Project file (JSON: lorebook, summaries, revisions)", "json")]
RUN_MODES = ("generate", "continue", "regenerate", "resume")


@dataclass(frozen=True)
class StudioContext:
    """What every handler needs, fixed at start-up (shared by all sessions, never mutated)."""

    db: storage.Database
    model: str
    heads: str | None = None
    driver: ChunkDriver | None = None  # ZeroGPU only
    poll_s: float = POLL_S
    hosting: Hosting = field(default_factory=Hosting)
    offers: tuple[Offer, ...] = ()  # models a writer may pick (app.model_offers); none: the studio's model only
    contexts: Mapping[str, int | None] = field(default_factory=dict)  # tokens, by model spec, where known at start

    def allowed_models(self) -> list[str]:
        return [self.model, *(o.spec for o in self.offers if o.spec != self.model)]

    def context_of(self, model: str) -> int | None:
        """The context of `model` in tokens, where known (core.runtime.loading.model_context); None: the default
        model's is assumed here, and the worker checks the real one when it runs."""
        return self.contexts.get(model)

    def longest_context(self) -> int | None:
        """The longest known context of the models on offer: the bound of the panels' "Max new tokens"."""
        known = [c for c in (self.context_of(m) for m in self.allowed_models()) if c is not None]
        return max(known) if known else None


def theme() -> gr.themes.Base:
    """A calm theme with fonts Gradio serves itself (no font CDN: the page works offline)."""
    return gr.themes.Soft(
        primary_hue="indigo", secondary_hue="slate", neutral_hue="slate", radius_size="md",
        font=[gr.themes.LocalFont("IBM Plex Sans"), "ui-sans-serif", "system-ui", "sans-serif"],
        font_mono=[gr.themes.LocalFont("IBM Plex Mono"), "ui-monospace", "Consolas", "monospace"],
    ).set(block_label_text_size="*text_sm", block_title_text_size="*text_sm")


def launch_kwargs() -> dict[str, Any]:
    """Arguments for ``Blocks.launch`` that style the app (Gradio 6 takes theme/CSS at launch)."""
    return {"theme": theme(), "css_paths": [CSS_PATH]}


def _unknown_session(view: View) -> bool:
    """A session that never loaded the page and has nothing open (e.g. the server restarted under the page)."""
    return not view.loaded and view.project_id is None and view.compare_id is None


class Handlers:
    """Event handlers. Plain methods of plain values, so tests can call them without a browser."""

    def __init__(self, ctx: StudioContext) -> None:
        self.ctx = ctx
        self.db = ctx.db
        self.hosting = ctx.hosting
        self.write_panel: settings_panel.SettingsPanel | None = None
        self.compare_panel: settings_panel.SettingsPanel | None = None

    # -- helpers ----------------------------------------------------------------------------------------------

    def _me(self, view: View) -> str:
        """The session's writer: everything it reads or writes is scoped to them."""
        if not self.hosting.multi_user:
            return storage.LOCAL_OWNER
        if view.owner is None:
            raise gr.Error("This session does not know who you are yet; reload the page.", print_exception=False)
        return view.owner

    def _project(self, view: View) -> Any:
        if view.project_id is None:
            raise gr.Error("Open or create a project first.", print_exception=False)
        return storage.get_project(self.db, view.project_id, self._me(view))

    def _chapter(self, view: View) -> Any:
        if view.chapter_id is None:
            raise gr.Error("Pick a chapter first (or add one).", print_exception=False)
        chapter = storage.get_chapter(self.db, view.chapter_id, self._me(view))
        if chapter.project_id != view.project_id:  # never act on another project's chapter
            raise gr.Error("That chapter belongs to another project; pick a chapter again.", print_exception=False)
        return chapter

    def _check_owner(self, view: View, project_owner: Any = None, chapter_owner: Any = None) -> None:
        p, c = owner_id(project_owner), owner_id(chapter_owner)
        if (p is not None and p != view.project_id) or (c is not None and c != view.chapter_id):
            raise gr.Error("The page switched project or chapter while you were typing; nothing was saved. "
                           "Please try again.", print_exception=False)

    def _model(self, picked: str | None) -> str:
        """The model a run is queued for: the picked one, which must be on offer, or the studio's."""
        if picked is None:
            return self.ctx.model
        if picked not in self.ctx.allowed_models():
            raise gr.Error(f"This studio does not offer the model {html.escape(str(picked))[:200]}.",
                           print_exception=False)
        return picked

    def _heads(self, model: str) -> str | None:
        """The heads to queue with a run: the studio's for its own model; a published checkpoint's own heads."""
        return self.ctx.heads if model == self.ctx.model else "default"

    def _project_choices(self, view: View) -> list[tuple[str, int]]:
        return [(views.project_label(p), p.id) for p in storage.list_projects(self.db, self._me(view))]

    def _remembered(self, view: View) -> dict[str, Any]:
        return {"project_id": view.project_id, "chapter_id": view.chapter_id, "compare_id": view.compare_id}

    def project_outputs(self, view: View) -> list[Any]:
        """Values for PROJECT outputs: picker, title, kind, premise (+ owner), goal, settings, then chapter outputs."""
        project = storage.get_project(self.db, view.project_id, self._me(view)) if view.project_id is not None else None
        panel = self.write_panel
        settings = panel.updates(project.settings if project else None) if panel else []
        head = [
            gr.update(choices=self._project_choices(view), value=project.id if project else None),
            gr.update(value=project.title if project else ""),
            gr.update(value=project.kind if project else "novel"),
            gr.update(value=project.premise if project else "", interactive=project is not None),
            project.id if project else 0,
            gr.update(value=(project.goal_words or 0) if project else 0),
        ]
        return head + settings + self.chapter_outputs(view)

    def chapter_outputs(self, view: View) -> list[Any]:
        """Values for CHAPTER outputs: title, instructions, owner id, the browser-remembered view."""
        chapter = None
        if view.chapter_id is not None:
            try:
                chapter = storage.get_chapter(self.db, view.chapter_id, self._me(view))
            except storage.NotFoundError:
                view.chapter_id = None
        return [
            gr.update(value=chapter.title if chapter else "", interactive=chapter is not None),
            gr.update(value=chapter.instructions if chapter else "", interactive=chapter is not None),
            chapter.id if chapter else 0,
            self._remembered(view),
        ]

    def _first_chapter(self, view: View, project_id: int) -> int | None:
        chapters = storage.list_chapters(self.db, project_id, owner=self._me(view))
        return chapters[0].id if chapters else None

    # -- page load --------------------------------------------------------------------------------------------

    @guarded
    def load(self, view: View, remembered: dict | None, key: str | None = None,
             profile: gr.OAuthProfile | None = None) -> list[Any]:
        """Know the writer, then restore what this browser had open (ids remembered in localStorage) if it is
        still there. Also returns the browser key to keep, the identity line and the claim offer."""
        key = self._identify(view, key, profile)
        self._restore(view, remembered)
        outputs = self.project_outputs(view)
        has_projects = bool(outputs[0]["choices"])  # the project picker's
        return outputs + [gr.update(open=not has_projects), self.comparison_picker(view)[0], skip_none(key),
                          *self._identity_outputs(view, key, profile)]

    def _identify(self, view: View, key: str | None, profile: Any) -> str | None:
        """Set the session's writer (multi-user only); returns the browser key to keep (None: leave it)."""
        if not self.hosting.multi_user:
            return None
        if not self.hosting.oauth:
            profile = None  # a sign-in is only trusted where this studio offers one
        view.owner, key = identity.resolve(key, profile)
        return key

    def _identity_outputs(self, view: View, key: str | None, profile: Any) -> list[Any]:
        """The header's identity line and the claim button (projects this browser made before signing in)."""
        if not self.hosting.multi_user:
            return ["", gr.update(visible=False)]
        if profile is not None and self.hosting.oauth and view.owner is not None and key:
            line = f"Signed in as <b>{views.esc(profile.username)}</b>: your projects are private to you."
            unclaimed = len(storage.list_projects(self.db, identity.key_owner(key)))
            if unclaimed:
                noun = "project" if unclaimed == 1 else "projects"
                return [line, gr.update(visible=True, value=f"Keep the {unclaimed} {noun} made in this browser")]
            return [line, gr.update(visible=False)]
        line = "Your projects are private to this browser."
        if self.hosting.oauth:
            line += " Sign in to reach them from anywhere."
        return [line, gr.update(visible=False)]

    @guarded
    def claim(self, view: View, key: str | None, profile: gr.OAuthProfile | None = None) -> list[Any]:
        """Give the projects this browser's key made to the signed-in writer."""
        if profile is None or not self.hosting.oauth:
            raise gr.Error("Sign in first.", print_exception=False)
        me = identity.profile_owner(profile)
        if view.owner != me:
            raise gr.Error("The page's sign-in changed; reload it.", print_exception=False)
        moved = storage.transfer_projects(self.db, identity.key_owner(key or ""), me)
        gr.Info(f"{moved} project(s) are now yours wherever you sign in.")
        return self.project_outputs(view) + self._identity_outputs(view, key, profile)

    def _restore(self, view: View, remembered: dict | None, *, only_if_unknown: bool = False) -> None:
        """Open what ``remembered`` names, where it still exists (else nothing / the newest comparison)."""
        remembered = remembered if isinstance(remembered, dict) else {}
        pid, cid, cmp = remembered.get("project_id"), remembered.get("chapter_id"), remembered.get("compare_id")
        project_id = chapter_id = compare_id = None
        me = self._me(view)
        if isinstance(pid, int):
            try:
                project_id = storage.get_project(self.db, pid, me).id
            except storage.NotFoundError:
                pass
        if project_id is not None:
            chapter_ids = [c.id for c in storage.list_chapters(self.db, project_id, owner=me)]
            chapter_id = cid if cid in chapter_ids else (chapter_ids[0] if chapter_ids else None)
        if isinstance(cmp, int):
            try:
                compare_id = storage.get_comparison(self.db, cmp, me).id
            except storage.NotFoundError:
                pass
        if compare_id is None:
            latest = storage.list_comparisons(self.db, limit=1, owner=me)
            compare_id = latest[0].id if latest else None
        if only_if_unknown and not _unknown_session(view):
            return  # the page-load handler got there first (it runs concurrently with the timer)
        # All at once: a concurrent poll never sees a half-restored view.
        view.project_id, view.chapter_id, view.compare_id, view.loaded = project_id, chapter_id, compare_id, True

    def _rejoin(self, view: View, remembered: dict | None, key: str | None, profile: Any) -> None:
        """A poll from a page whose session this server does not know (it restarted under the page): find the
        writer and what the browser remembers instead of blanking the page. Never raises: it runs every second."""
        if not (_unknown_session(view) and remembered):
            return
        try:
            if self.hosting.multi_user and view.owner is None:
                if not key:
                    return  # a first visit: the page-load handler makes the key
                self._identify(view, key, profile)
            self._restore(view, remembered, only_if_unknown=True)
        except Exception:  # a bad key, a transient database error: the page-load handler will say what is wrong
            log.warning("rejoining a page failed", exc_info=True)

    # -- projects -------------------------------------------------------------------------------------------

    @guarded
    def create_project(self, view: View, title: str, kind: str, premise: str) -> list[Any]:
        """Create a project with a first chapter and open it."""
        project = storage.create_project(self.db, title or "", kind or "novel", premise or "", owner=self._me(view))
        chapter = storage.add_chapter(self.db, project.id)
        view.project_id, view.chapter_id = project.id, chapter.id
        gr.Info(f"Created “{html.escape(project.title)}”.")
        return self.project_outputs(view) + [gr.update(value=""), gr.update(value=""), gr.update(open=False)]

    @guarded
    def open_project(self, view: View, project_id: int | None) -> list[Any]:
        if project_id in (None, ""):
            view.project_id = view.chapter_id = None
            return self.project_outputs(view)
        project = storage.get_project(self.db, page_id(project_id, "project"), self._me(view))
        view.project_id = project.id
        view.chapter_id = self._first_chapter(view, project.id)
        return self.project_outputs(view)

    @guarded
    def save_project(self, view: View, owner: Any, title: str, kind: str, goal: Any = None) -> list[Any]:
        """Rename the open project, change its kind and/or its word goal (0: none)."""
        self._check_owner(view, owner)
        project = self._project(view)
        if title != project.title:
            storage.rename_project(self.db, project.id, title, self._me(view))
        if kind and kind != project.kind:
            storage.update_project(self.db, project.id, kind=kind, owner=self._me(view))
        if goal is not None and goal != (project.goal_words or 0):
            if isinstance(goal, float) and goal.is_integer():
                goal = int(goal)  # Numbers arrive as floats
            storage.update_project(self.db, project.id, goal_words=goal, owner=self._me(view))
        gr.Info("Project saved.")
        return self.project_outputs(view)

    @guarded
    def ask_delete_project(self, view: View) -> tuple[Any, Any]:
        project = self._project(view)
        return (gr.update(visible=True),
                f'<div class="confirm">Delete <b>{views.esc(project.title)}</b> and all its chapters? '
                "Its run history is kept. This cannot be undone.</div>")

    @guarded
    def delete_project(self, view: View) -> list[Any]:
        project = self._project(view)
        storage.delete_project(self.db, project.id, self._me(view))
        view.project_id = view.chapter_id = None
        gr.Info(f"Deleted “{html.escape(project.title)}”.")
        return self.project_outputs(view) + [gr.update(visible=False)]

    # -- chapters -------------------------------------------------------------------------------------------

    @guarded
    def open_chapter(self, view: View, chapter_id: int | None, pick: str | None = None) -> list[Any]:
        """Open a chapter; `pick`: the page's number of this pick (PICK_JS), so an older pick overtaken on its way by
        a newer one is not opened after it (API callers leave it out)."""
        number = int(pick) if isinstance(pick, str) and pick.isdigit() else None
        if number is not None:
            if number <= view.picks:
                return self.chapter_outputs(view)
            view.picks = number
        if chapter_id in (None, ""):
            return self.chapter_outputs(view)
        chapter = storage.get_chapter(self.db, page_id(chapter_id, "chapter"), self._me(view))
        if chapter.project_id != view.project_id:
            raise gr.Error("That chapter belongs to another project.", print_exception=False)
        view.chapter_id = chapter.id
        return self.chapter_outputs(view)

    @guarded
    def add_chapter(self, view: View) -> list[Any]:
        project = self._project(view)
        chapter = storage.add_chapter(self.db, project.id)
        view.chapter_id = chapter.id
        return self.chapter_outputs(view)

    @guarded
    def move_chapter(self, view: View, delta: int) -> None:
        chapter = self._chapter(view)
        storage.move_chapter(self.db, chapter.id, max(0, chapter.position + int(delta)), self._me(view))

    @guarded
    def ask_delete_chapter(self, view: View) -> tuple[Any, Any]:
        chapter = self._chapter(view)
        return (gr.update(visible=True),
                f'<div class="confirm">Delete <b>{views.esc(chapter.title)}</b> '
                f"({chapter.word_count:,} words)? This cannot be undone.</div>")

    @guarded
    def delete_chapter(self, view: View) -> list[Any]:
        chapter = self._chapter(view)
        storage.delete_chapter(self.db, chapter.id, self._me(view))
        view.chapter_id = self._first_chapter(view, chapter.project_id)
        return self.chapter_outputs(view) + [gr.update(visible=False)]

    def _save_meta(self, view: View, premise: str | None, title: str | None, instructions: str | None) -> None:
        """Store premise / chapter title / instructions where they differ from the database."""
        if view.project_id is not None and premise is not None:
            project = self._project(view)
            if premise != project.premise:
                storage.update_project(self.db, project.id, premise=premise, owner=self._me(view))
        if view.chapter_id is not None and (title is not None or instructions is not None):
            chapter = self._chapter(view)
            new_title = title if title is not None and title.strip() and title.strip() != chapter.title else None
            new_instr = instructions if instructions is not None and instructions != chapter.instructions else None
            if new_title is not None or new_instr is not None:
                storage.update_chapter(self.db, chapter.id, title=new_title, instructions=new_instr,
                                       owner=self._me(view))

    @guarded
    def autosave(self, view: View, project_owner: Any, chapter_owner: Any, premise: str, title: str,
                 instructions: str) -> None:
        """Save the premise and chapter fields when they lose focus (silently: nothing to tell)."""
        if owner_id(project_owner) != view.project_id or owner_id(chapter_owner) != view.chapter_id:
            return  # the page moved on; these values belong to what was shown before
        self._save_meta(view, premise, title, instructions)

    @guarded
    def save_chapter(self, view: View, cache: LiveCache, project_owner: Any, chapter_owner: Any, premise: str,
                     title: str, instructions: str, text: str) -> None:
        """Save the chapter's title, instructions and hand-edited text (and the premise)."""
        self._check_owner(view, project_owner, chapter_owner)
        chapter = self._chapter(view)
        self._save_meta(view, premise, title, instructions)
        # Only a textbox that holds the whole chapter may replace it (while a run writes it shows a tail).
        if text is not None and text != chapter.text:
            if cache.chapter_id != chapter.id or not cache.text_full:
                raise gr.Error("The text cannot be saved while the chapter is being written.", print_exception=False)
            storage.set_chapter_text(self.db, chapter.id, text, owner=self._me(view))
        gr.Info("Saved.")

    # -- revisions ------------------------------------------------------------------------------------------

    def _revision(self, view: View, revision_id: Any) -> Any:
        revision = storage.get_revision(self.db, page_id(revision_id, "revision"), self._me(view))
        if revision.chapter_id != view.chapter_id:
            raise gr.Error("That revision belongs to another chapter; pick one again.", print_exception=False)
        return revision

    @guarded
    def revisions(self, view: View) -> list[Any]:
        """The open chapter's revisions, newest first (picker, and the shown revision's text and diff cleared)."""
        found = storage.list_revisions(self.db, view.chapter_id, self._me(view)) if view.chapter_id else []
        note = ('<div class="muted">Earlier texts appear here when a chapter is regenerated, edited by hand or '
                "restored.</div>") if not found else ""
        return [gr.update(choices=[(views.revision_label(r), r.id) for r in found], value=None),
                gr.update(value="", visible=False), note]

    @guarded
    def show_revision(self, view: View, revision_id: Any) -> list[Any]:
        """A revision's text and what changed from it to the chapter's current text."""
        if revision_id in (None, ""):
            return [gr.update(value="", visible=False), ""]
        revision = self._revision(view, revision_id)
        chapter = self._chapter(view)
        return [gr.update(value=revision.text, visible=True), views.revision_diff(revision.text, chapter.text)]

    @guarded
    def restore_revision(self, view: View, revision_id: Any) -> list[Any]:
        """Make a revision the chapter's text; the text it replaces becomes a revision (nothing is lost)."""
        if revision_id in (None, ""):
            raise gr.Error("Pick a revision first.", print_exception=False)
        revision = self._revision(view, revision_id)
        storage.restore_revision(self.db, revision.id, self._me(view))
        gr.Info(f"Restored revision #{revision.id}; the text it replaced is saved as a revision.")
        return self.revisions(view)

    # -- runs -----------------------------------------------------------------------------------------------

    @guarded
    def queue_run(self, mode: str, view: View, project_owner: Any, chapter_owner: Any, premise: str, title: str,
                  instructions: str, **settings_values: Any) -> str:
        """Queue a generate / continue / regenerate / resume run for the open chapter; returns the status line."""
        if mode not in RUN_MODES:
            raise gr.Error(f"Unknown action {html.escape(str(mode))}.", print_exception=False)
        self._check_owner(view, project_owner, chapter_owner)
        chapter = self._chapter(view)
        self._save_meta(view, premise, title, instructions)
        model = self._model(settings_panel.pop_model(settings_values))
        if mode == "resume":
            # app.jobs reuses the stopped run's prompt and settings: that is what makes the continuation exact.
            settings = None
            latest = storage.latest_run_for_chapter(self.db, chapter.id, owner=self._me(view))
            if latest is not None and latest.model in self.ctx.allowed_models():
                model = latest.model  # only the model that wrote it can continue it
        else:
            settings = settings_panel.validated(settings_values, self.ctx.context_of(model))
            # Remember them as the project's defaults (shown the next time the project is opened).
            storage.update_project(self.db, chapter.project_id, settings=settings, owner=self._me(view))
        run = jobs.queue_chapter_run(self.db, chapter.id, mode, settings, model=model, heads=self._heads(model),
                                     context=self.ctx.context_of(model), owner=self._me(view),
                                     max_queued=self.hosting.max_queued, max_tokens=self.hosting.max_tokens)
        return views.run_status(run, position=storage.queue_position(self.db, run.id))

    @guarded
    def stop(self, view: View) -> None:
        """Cancel the open chapter's queued or running run."""
        chapter = self._chapter(view)
        run = storage.latest_run_for_chapter(self.db, chapter.id)
        if run is None or run.status not in views.ACTIVE:
            gr.Info("Nothing is running in this chapter.")
            return
        status = storage.request_cancel(self.db, run.id, self._me(view))
        gr.Info("Stopped." if status == "cancelled" else "Stopping after the current step…")

    def tick(self, view: View, cache: LiveCache, remembered: dict | None = None, key: str | None = None,
             shown: str | None = None, picked: Any = None, page: str | None = None,
             profile: gr.OAuthProfile | None = None) -> tuple[Any, ...]:
        """The Write tab's timer: ``refresh``, after rejoining a page the server does not know."""
        self._rejoin(view, remembered, key, profile)
        return self.refresh(view, cache, shown, picked, page)

    def refresh(self, view: View, cache: LiveCache, shown: str | None = None, picked: Any = None,
                page: str | None = None) -> tuple[Any, ...]:
        """The 1 s poll of the Write tab (and header): only changed parts are sent. `shown`: the page's digest of
        the chapter text it holds (live.DIGEST_JS); anything else (an API caller's text) counts as unknown. `page`:
        the page's chapter pick (PAGE_JS; `picked`, the list's own value, is left empty by it)."""
        if not (isinstance(shown, str) and DIGEST.fullmatch(shown)):
            shown = None
        try:
            up = live.poll_write(self.db, view, cache, zerogpu=self.ctx.driver is not None, shown=shown,
                                 page=_page_chapter(page))
        except Exception:  # a transient database error must not pop a modal every second
            log.warning("refresh failed", exc_info=True)
            return tuple(gr.skip() for _ in range(WRITE_POLL_OUTPUTS))
        pick = {"value": up.selected} if up.select else {}
        chapters = (gr.update(choices=up.chapters, interactive=True, **pick) if up.chapters is not None
                    else gr.update(**pick) if pick else gr.skip())
        if up.text is None:
            text = gr.skip()
        elif up.text[0] is None:
            text = gr.update(interactive=up.text[1])
        else:
            text = gr.update(value=up.text[0], interactive=up.text[1])
        figures = up.figures or (gr.skip(), gr.skip(), gr.skip())
        if up.controls is not None:
            c = up.controls
            controls = [gr.update(interactive=c["can_write"]), gr.update(interactive=c["can_write"]),
                        gr.update(interactive=c["can_write"]), gr.update(interactive=c["active"]),
                        gr.update(visible=c["resumable"]), gr.update(interactive=c["can_write"])]
        else:
            controls = [gr.skip()] * 6
        summary = (gr.update(value=up.summary[0], interactive=up.summary[1]) if up.summary is not None
                   else gr.skip())
        return (skip_none(up.worker_html), chapters, skip_none(up.status_html), text, skip_none(up.counts_html),
                *figures, *controls, skip_none(up.goal_html), summary, skip_none(up.summary_note))

    def drive(self) -> None:
        """ZeroGPU: work through the queue in GPU-bounded chunks inside this request (no-op elsewhere)."""
        if self.ctx.driver is not None:
            self.ctx.driver.drive()

    # -- compare --------------------------------------------------------------------------------------------

    def comparison_picker(self, view: View) -> list[Any]:
        comparisons = storage.list_comparisons(self.db, limit=100, owner=self._me(view))
        return [gr.update(choices=[(views.comparison_label(c), c.id) for c in comparisons], value=view.compare_id),
                self._remembered(view)]

    @guarded
    def start_comparison(self, view: View, prompt: str, **settings_values: Any) -> list[Any]:
        """Queue vanilla then TokenSwift on the same prompt, seed and settings; open the comparison."""
        if not (prompt or "").strip():
            raise gr.Error("Write a prompt to compare on.", print_exception=False)
        model = self._model(settings_panel.pop_model(settings_values))
        context = self.ctx.context_of(model)
        settings = settings_panel.validated(settings_values, context)
        comparison = jobs.queue_comparison(self.db, prompt, settings, model=model, heads=self._heads(model),
                                           project_id=view.project_id, context=context, owner=self._me(view),
                                           max_queued=self.hosting.max_queued, max_tokens=self.hosting.max_tokens)
        view.compare_id = comparison.id
        return self.comparison_picker(view) + [self.comparisons_table(view)]

    @guarded
    def open_comparison(self, view: View, compare_id: Any) -> list[Any]:
        if compare_id in (None, ""):
            return self.comparison_picker(view)
        comparison = storage.get_comparison(self.db, page_id(compare_id, "comparison"), self._me(view))
        view.compare_id = comparison.id
        return self.comparison_picker(view)

    def select_comparison(self, view: View, evt: gr.SelectData) -> list[Any]:
        """A click on a row of the past-comparisons table opens it."""
        row = evt.row_value or []
        try:
            return self.open_comparison(view, int(row[0]))
        except (TypeError, ValueError, IndexError):
            return [gr.skip(), gr.skip()]

    def comparisons_table(self, view: View) -> Any:
        try:
            comparisons = storage.list_comparisons(self.db, limit=100, owner=self._me(view))
        except gr.Error:  # no writer yet: nothing to list
            comparisons = []
        run_ids = [i for c in comparisons for i in (c.ar_run_id, c.tokenswift_run_id) if i is not None]
        runs = {}
        for run_id in run_ids:
            try:
                runs[run_id] = storage.get_run(self.db, run_id)
            except storage.NotFoundError:
                pass
        return gr.update(value=views.comparisons_table(comparisons, runs), headers=views.COMPARE_COLUMNS)

    def tick_compare(self, view: View, cache: LiveCache, remembered: dict | None = None, key: str | None = None,
                     profile: gr.OAuthProfile | None = None) -> tuple[Any, ...]:
        """The Compare tab's timer: ``refresh_compare``, after rejoining a page the server does not know."""
        self._rejoin(view, remembered, key, profile)
        return self.refresh_compare(view, cache)

    def refresh_compare(self, view: View, cache: LiveCache) -> tuple[Any, ...]:
        """The 1 s poll of the Compare tab."""
        try:
            up = live.poll_compare(self.db, view.compare_id, cache)
        except Exception:
            log.warning("compare refresh failed", exc_info=True)
            return tuple(gr.skip() for _ in range(COMPARE_POLL_OUTPUTS))
        figures = up.figures or (gr.skip(), gr.skip(), gr.skip())
        table = self.comparisons_table(view) if up.listing_changed else gr.skip()
        return (skip_none(up.summary_html), skip_none(up.ar_line), skip_none(up.ts_line), skip_none(up.ar_text),
                skip_none(up.ts_text), *figures, table)

    # -- history & export ---------------------------------------------------------------------------------

    @guarded
    def history(self, view: View, all_projects: bool, picked: Any = None) -> tuple[Any, Any]:
        """The runs table (open project, or all) and the run picker (keeps ``picked``, else the newest run)."""
        project_id = None if all_projects else view.project_id
        if project_id is None and not all_projects:
            return gr.update(value=[], headers=views.RUN_COLUMNS), gr.update(choices=[], value=None)
        me = self._me(view)
        runs = storage.list_runs(self.db, project_id=project_id, limit=200, owner=me)
        titles: dict[int, str] = {}
        for pid in {r.project_id for r in runs if r.project_id is not None}:
            titles.update({c.id: c.title for c in storage.list_chapters(self.db, pid, owner=me)})
        rows = views.runs_table(runs, titles, live.speedups_for(self.db, runs))
        ids = [r.id for r in runs]
        keep = picked if picked in ids else (ids[0] if ids else None)
        return (gr.update(value=rows, headers=views.RUN_COLUMNS),
                gr.update(choices=[(views.run_label(r), r.id) for r in runs], value=keep))

    def select_run(self, evt: gr.SelectData) -> Any:
        """A click on a row of the runs table picks that run."""
        try:
            return int((evt.row_value or [])[0])
        except (TypeError, ValueError, IndexError):
            return gr.skip()

    @guarded
    def run_details(self, view: View, run_id: Any) -> tuple[Any, ...]:
        """Summary, metrics (JSON) and charts of any of the writer's runs."""
        if run_id in (None, ""):
            empty = '<div class="muted">Pick a run to see its metrics.</div>'
            return (empty, {}, *all_figures(None, "No run selected"))
        run = storage.get_run(self.db, page_id(run_id, "run"), self._me(view))
        buckets = buckets_from_rows(storage.get_steps(self.db, run.id))
        chapter_title = None
        if run.chapter_id is not None:
            try:
                chapter_title = storage.get_chapter(self.db, run.chapter_id).title
            except storage.NotFoundError:
                pass
        x = live.speedups_for(self.db, [run]).get(run.id)
        metrics = {
            "run_id": run.id, "status": run.status, "mode": run.mode, "method": run.method, "model": run.model,
            "n_tokens": run.n_tokens, "steps": buckets.n_steps, "tokens_per_s": run.tokens_per_s,
            "decode_s": run.decode_s, "prefill_s": run.prefill_s,
            "tokens_per_step": buckets.mean_tokens_per_step or run.mean_accepted,
            "accepted_drafts": buckets.accepted, "from_ngram": buckets.from_ngram,
            "last_repetition": buckets.last_repetition, "speedup": x, "error": run.error,
        }
        summary = views.run_summary(run, chapter_title=chapter_title, tokens_per_step=buckets.mean_tokens_per_step,
                                    speedup_x=x)
        return (summary, metrics, *all_figures(buckets, empty="No steps recorded"))

    @guarded
    def export(self, view: View, fmt: str) -> Any:
        """Write the open project as Markdown / plain text / EPUB; the browser downloads the file."""
        project = self._project(view)
        path = exporter.export_project(self.db, project.id, fmt or "markdown", owner=self._me(view))
        return gr.update(value=str(path), visible=True)


def _queue_handler(h: Handlers, mode: str) -> Callable[..., str]:
    """``h.queue_run`` bound to one mode, with a plain signature (Gradio reads it to name the API parameters)."""
    def queue(view: View, project_owner: Any, chapter_owner: Any, premise: str, title: str, instructions: str,
              **settings: Any) -> str:
        return h.queue_run(mode, view, project_owner, chapter_owner, premise, title, instructions, **settings)
    queue.__name__ = mode
    return queue


WRITE_POLL_OUTPUTS = 17
# The Write tab's polls send a digest of the chapter text the page holds, not the text (app.live).
DIGEST = re.compile(r"\d+:[0-9a-f]{1,8}")
# And what the chapter list shows picked, with whether a pick of the writer's is still on its way (app.live): a click
# counts one in PICK_JS, its answer one in PICKED_JS. The list's own value goes as empty, the pick as JSON text.
PAGE_JS = ("(picked) => JSON.stringify({picked: picked ?? null, "
           "pending: (window.tsPicks || 0) > (window.tsPicked || 0)})")
PICK_JS = ("(view, picked) => { window.tsPicks = (window.tsPicks || 0) + 1; "
           "return [view, picked, String(window.tsPicks)]; }")
PICKED_JS = "() => { window.tsPicked = (window.tsPicked || 0) + 1; }"
# The page-load handler has answered: for scripts driving the page (the browser tests), which must not act before
# it (it opens what the browser had open, and closes the new-project form once projects exist).
LOADED_JS = "() => { window.tsLoaded = true; }"
TICK_JS = (f"(view, cache, remembered, key, text, picked) => [view, cache, remembered, key, ({live.DIGEST_JS})(text), "
           f"null, ({PAGE_JS})(picked)]")
REFRESH_JS = f"(view, cache, text, picked) => [view, cache, ({live.DIGEST_JS})(text), null, ({PAGE_JS})(picked)]"


def _page_chapter(page: Any) -> live.PageChapter | None:
    """PAGE_JS's text as a PageChapter; None for anything else (an API caller)."""
    try:
        data = json.loads(page) if isinstance(page, str) else None
        picked, pending = data["picked"], data["pending"]
    except (ValueError, TypeError, KeyError):
        return None
    if not (picked is None or type(picked) is int) or type(pending) is not bool:
        return None
    return live.PageChapter(picked, pending)
COMPARE_POLL_OUTPUTS = 9


# -- layout -----------------------------------------------------------------------------------------------------------

HEADER = """<div class="brand">
  <div class="brand-mark">⚡</div>
  <div><h1>TokenSwift Studio</h1>
  <p>Long-form writing on lossless speculative decoding: the same text as plain decoding, sooner.</p></div>
</div>"""


def _hide() -> Any:
    return gr.update(visible=False)


def _plots(prefix: str) -> list[gr.Plot]:
    return [gr.Plot(show_label=False, elem_id=f"{prefix}-{name}", elem_classes="chart")
            for name in ("accepted", "throughput", "repetition")]


def confirm_box(action: str, elem_id: str) -> tuple[gr.Group, gr.HTML, gr.Button, gr.Button]:
    """A hidden confirmation box for a destructive action: the group, its message, the confirm and cancel buttons."""
    with gr.Group(visible=False, elem_classes="confirm-box") as box:
        message = gr.HTML(js_on_load=None)
        with gr.Row(elem_classes="tight-row"):
            yes = gr.Button(action, variant="stop", size="sm", elem_id=elem_id)
            no = gr.Button("Cancel", size="sm")
    return box, message, yes, no


def build_ui(ctx: StudioContext) -> gr.Blocks:
    """Build the Blocks app (launch it with ``**launch_kwargs()``)."""
    h = Handlers(ctx)
    story = story_ui.StoryHandlers(h)
    with gr.Blocks(title="TokenSwift Studio", fill_width=True, analytics_enabled=False) as demo:
        # Plain values, copied for each session on its first event. A callable would make Gradio add a page-load
        # event that sets the state, racing the page-load handler: on a busy server it could replace the View that
        # handler had just given its writer, and the session's next click would not know who it is.
        view = gr.State(View())
        cache = gr.State(LiveCache())
        remembered = gr.BrowserState({"project_id": None, "chapter_id": None, "compare_id": None},
                                     storage_key=BROWSER_KEY, secret="tokenswift-studio")
        # The writer's key (multi-user studios): made on the first visit, kept by this browser (app.identity).
        key = gr.BrowserState("", storage_key=WRITER_KEY, secret="tokenswift-studio")
        timer = gr.Timer(ctx.poll_s)
        # The Compare tab's poll runs only while that tab is open: every poll is a round trip that the page's
        # scripts handle, beside the model on a small machine (an idle page took 35% of a core in Chromium here
        # with both polls running, 24% with one).
        compare_timer = gr.Timer(ctx.poll_s, active=False)
        bible_timer = gr.Timer(ctx.poll_s, active=False)  # the Story bible tab's outline poll, the same way
        # Owner ids of what the premise / chapter fields currently show (see the module docstring).
        project_owner = gr.Number(value=0, visible=False, precision=0)
        chapter_owner = gr.Number(value=0, visible=False, precision=0)

        with gr.Row(elem_classes="studio-header", equal_height=True):
            gr.HTML(HEADER, elem_classes="brand-wrap", js_on_load=None)
            with gr.Column(elem_classes="identity-wrap", visible=ctx.hosting.multi_user, scale=0, min_width=260):
                identity_html = gr.HTML(elem_id="identity", js_on_load=None)
                if ctx.hosting.oauth:
                    gr.LoginButton(size="sm")
                claim_btn = gr.Button("Keep this browser's projects", size="sm", visible=False, elem_id="claim")
            worker_html = gr.HTML(elem_id="worker-state", elem_classes="worker-wrap", js_on_load=None)
        if ctx.hosting.storage_warning:
            gr.HTML(f'<div class="storage-warning" id="storage-warning">{views.esc(ctx.hosting.storage_warning)}'
                    "</div>", js_on_load=None)

        # -- sidebar: projects and chapters --
        with gr.Sidebar(label="Projects", open=True, width=310, elem_id="sidebar"):
            project_dd = gr.Dropdown(label="Project", choices=[], value=None, elem_id="project-picker",
                                     info="Everything is saved as you go.")
            with gr.Accordion("New project", open=False, elem_id="new-project") as new_acc:
                new_title = gr.Textbox(label="Title", placeholder="The Lighthouse Keeper", max_length=200,
                                       elem_id="new-title")
                new_kind = gr.Radio(KIND_CHOICES, value="novel", label="Kind", elem_id="new-kind")
                new_premise = gr.Textbox(label="Premise", lines=4, elem_id="new-premise",
                                         placeholder="What is it about? Setting, characters, tone…")
                create_btn = gr.Button("Create project", variant="primary", elem_id="create-project")
            chapters_radio = gr.Radio(label="Chapters", choices=[], elem_id="chapter-list",
                                      elem_classes="chapter-list")
            # Never shown: the channel of the page's chapter pick to the server (PAGE_JS for the polls, PICK_JS).
            page_pick = gr.Textbox(visible=False, elem_id="page-pick")
            goal_html = gr.HTML(elem_id="goal", js_on_load=None)
            with gr.Row(elem_classes="tight-row"):
                add_ch_btn = gr.Button("+ Chapter", size="sm", elem_id="add-chapter", min_width=60)
                up_btn = gr.Button("↑", size="sm", elem_id="chapter-up", min_width=36)
                down_btn = gr.Button("↓", size="sm", elem_id="chapter-down", min_width=36)
                del_ch_btn = gr.Button("Delete", size="sm", variant="stop", elem_id="delete-chapter", min_width=60)
            del_ch_confirm, del_ch_msg, del_ch_yes, del_ch_no = confirm_box("Delete chapter", "confirm-delete-chapter")
            with gr.Accordion("Project settings", open=False, elem_id="project-settings"):
                proj_title = gr.Textbox(label="Title", max_length=200, elem_id="project-title")
                proj_kind = gr.Radio(KIND_CHOICES, label="Kind", value="novel")
                proj_goal = gr.Number(label="Word goal (0 = none)", value=0, precision=0, minimum=0,
                                      maximum=storage.MAX_GOAL_WORDS, elem_id="project-goal")
                with gr.Row(elem_classes="tight-row"):
                    save_proj_btn = gr.Button("Save", size="sm", elem_id="save-project")
                    del_proj_btn = gr.Button("Delete project", size="sm", variant="stop", elem_id="delete-project")
                del_proj_confirm, del_proj_msg, del_proj_yes, del_proj_no = confirm_box("Delete project",
                                                                                         "confirm-delete-project")

        with gr.Tabs(elem_id="tabs"):
            # -- Write --
            with gr.Tab("Write", id="write", elem_id="tab-write") as write_tab:
                with gr.Row(equal_height=False):
                    with gr.Column(scale=3, min_width=460):
                        with gr.Row(equal_height=True):
                            chapter_title = gr.Textbox(label="Chapter title", max_length=200, scale=3,
                                                       elem_id="chapter-title", interactive=False)
                        with gr.Accordion("Premise and chapter instructions", open=True, elem_id="premise-box"):
                            with gr.Row():
                                premise = gr.Textbox(label="Premise (whole project)", lines=3, max_lines=8,
                                                     elem_id="premise", interactive=False,
                                                     placeholder="What the book or report is about.")
                                instructions = gr.Textbox(label="Instructions for this chapter", lines=3,
                                                          max_lines=8, elem_id="instructions", interactive=False,
                                                          placeholder="What should happen in this chapter?")
                        with gr.Row(elem_classes="run-buttons"):
                            gen_btn = gr.Button("Generate", variant="primary", elem_id="generate", interactive=False)
                            cont_btn = gr.Button("Continue", elem_id="continue", interactive=False)
                            regen_btn = gr.Button("Regenerate", elem_id="regenerate", interactive=False)
                            stop_btn = gr.Button("Stop", variant="stop", elem_id="stop", interactive=False)
                            resume_btn = gr.Button("Resume", variant="primary", elem_id="resume", visible=False)
                        status_html = gr.HTML(elem_id="run-status", js_on_load=None)
                        # The text is what a writer came for: right under the buttons and the status line. The
                        # settings wait, collapsed, below it (they are remembered per project).
                        chapter_text = gr.Textbox(label="Chapter text", lines=18, max_lines=36, interactive=True,
                                                  elem_id="chapter-text", elem_classes="chapter-text",
                                                  buttons=["copy"], autoscroll=True)
                        with gr.Row(equal_height=True, elem_classes="counts-row"):
                            counts_html = gr.HTML(elem_id="counts", js_on_load=None)
                            save_btn = gr.Button("Save edits", size="sm", elem_id="save-chapter", interactive=False,
                                                 scale=0, min_width=120)
                        with gr.Accordion("Revisions", open=False, elem_id="revisions") as revisions_acc:
                            revision_pick = gr.Dropdown(label="Earlier texts of this chapter", choices=[], value=None,
                                                        elem_id="revision-pick",
                                                        info="Pick one to see it and what changed since.")
                            revision_diff = gr.HTML(elem_id="revision-diff", js_on_load=None)
                            revision_text = gr.Textbox(label="That revision", lines=8, max_lines=16,
                                                       interactive=False, visible=False, elem_id="revision-text")
                            restore_btn = gr.Button("Restore this revision", size="sm", elem_id="restore-revision")
                        summary = story_ui.summary_panel()
                        with gr.Accordion("Generation settings", open=False, elem_id="write-settings"):
                            h.write_panel = settings_panel.build("write", models=ctx.offers,
                                                           context=ctx.longest_context())
                    with gr.Column(scale=2, min_width=340, elem_classes="charts"):
                        write_plots = _plots("write")

            bible = story_ui.bible_tab()

            # -- Compare --
            with gr.Tab("Compare", id="compare", elem_id="tab-compare") as compare_tab:
                with gr.Row(equal_height=False):
                    with gr.Column(scale=3):
                        cmp_prompt = gr.Textbox(label="Prompt", lines=5, max_lines=12, elem_id="compare-prompt",
                                                placeholder="The same prompt, seed and settings go to vanilla "
                                                            "decoding and to TokenSwift, one after the other.")
                        with gr.Row():
                            cmp_btn = gr.Button("Run comparison", variant="primary", elem_id="run-compare", scale=0,
                                                min_width=220)
                    with gr.Column(scale=2):
                        h.compare_panel = settings_panel.build("compare", include_method=False, compact=True,
                                                               models=ctx.offers, context=ctx.longest_context())
                cmp_summary = gr.HTML(elem_id="compare-summary", js_on_load=None)
                with gr.Row(elem_classes="compare-grid", equal_height=False):
                    with gr.Column():
                        cmp_ar_line = gr.HTML(js_on_load=None)
                        cmp_ar_text = gr.Textbox(label="Vanilla decoding", lines=12, max_lines=24, interactive=False,
                                                 elem_id="compare-ar", elem_classes="chapter-text")
                    with gr.Column():
                        cmp_ts_line = gr.HTML(js_on_load=None)
                        cmp_ts_text = gr.Textbox(label="TokenSwift", lines=12, max_lines=24, interactive=False,
                                                 elem_id="compare-ts", elem_classes="chapter-text")
                with gr.Row():
                    cmp_plots = _plots("compare")
                with gr.Accordion("Past comparisons", open=True):
                    cmp_pick = gr.Dropdown(label="Show comparison", choices=[], value=None, elem_id="compare-pick",
                                           info="Or click a row of the table.")
                    # Fixed widths: left to itself the prompt column took the row and squeezed the figures'
                    # headers to a few letters a line.
                    cmp_table = gr.Dataframe(headers=views.COMPARE_COLUMNS, interactive=False, wrap=True,
                                             elem_id="compare-table", max_height=320,
                                             column_widths=["4%", "13%", "30%", "8%", "11%", "13%", "9%", "12%"])

            # -- History & export --
            with gr.Tab("History & export", id="history", elem_id="tab-history") as history_tab:
                with gr.Row(equal_height=False):
                    with gr.Column(scale=1, min_width=260):
                        gr.Markdown("### Export the open project")
                        export_fmt = gr.Radio(EXPORT_CHOICES, value="markdown", label="Format", elem_id="export-format")
                        export_btn = gr.Button("Export", variant="primary", elem_id="export")
                        export_file = gr.File(label="Download", interactive=False, elem_id="export-file",
                                              visible=False)
                        gr.Markdown("### Import a project file")
                        import_file = gr.File(label="Project file (.json)", file_types=[".json"], type="filepath",
                                              elem_id="import-file")
                        import_btn = gr.Button("Import as a new project", elem_id="import-project")
                    with gr.Column(scale=4):
                        with gr.Row(equal_height=True):
                            all_projects = gr.Checkbox(label="All projects", value=False, elem_id="all-projects")
                            history_btn = gr.Button("Refresh", size="sm", scale=0, min_width=100)
                        runs_table = gr.Dataframe(headers=views.RUN_COLUMNS, interactive=False, elem_id="runs-table",
                                                  max_height=340)
                        run_pick = gr.Dropdown(label="Run", choices=[], value=None, elem_id="run-pick")
                        run_summary = gr.HTML(js_on_load=None, elem_id="run-summary")
                        with gr.Accordion("Raw metrics", open=False):
                            run_metrics = gr.JSON(elem_id="run-metrics")
                with gr.Row():
                    run_plots = _plots("history")

        # -- wiring --
        panel_w, panel_c = h.write_panel, h.compare_panel
        assert panel_w is not None and panel_c is not None
        chapter_outs = [chapter_title, instructions, chapter_owner, remembered]
        revision_outs = [revision_pick, revision_text, revision_diff]
        project_outs = [project_dd, proj_title, proj_kind, premise, project_owner, proj_goal, *panel_w.components,
                        *chapter_outs]
        write_poll_outs = [worker_html, chapters_radio, status_html, chapter_text, counts_html, *write_plots,
                           gen_btn, cont_btn, regen_btn, stop_btn, resume_btn, save_btn, goal_html, summary.box,
                           summary.note]
        assert len(write_poll_outs) == WRITE_POLL_OUTPUTS
        cmp_poll_outs = [cmp_summary, cmp_ar_line, cmp_ts_line, cmp_ar_text, cmp_ts_text, *cmp_plots, cmp_table]
        assert len(cmp_poll_outs) == COMPARE_POLL_OUTPUTS
        cmp_pick_outs = [cmp_pick, remembered]
        quiet = {"show_progress": "hidden"}
        # The events that move a session's open project or chapter share one lane of width 1. Two clicks in quick
        # succession otherwise run on two threads, and the earlier one could finish last: the server would hold
        # the chapter clicked first while the page shows the one clicked last, and a save would land on the
        # former. Gradio's queue is first in, first out within a lane; these handlers only read and write rows.
        # The pickers also send every pick (Gradio's default drops one made while the one before is on its way).
        navigate = {"concurrency_id": "navigate", "concurrency_limit": 1}

        def then_refresh(event: Any) -> Any:
            return event.then(h.refresh, [view, cache, chapter_text, chapters_radio, page_pick], write_poll_outs,
                              api_visibility="private", js=REFRESH_JS, **quiet)

        def then_drive(event: Any) -> Any:
            # ZeroGPU only: run the queue in GPU chunks inside a request. Elsewhere the worker thread does it.
            if ctx.driver is None:
                return event
            return event.then(h.drive, None, None, api_visibility="private", **quiet)

        # The polls first: follow-up refreshes below reuse their functions, and the first registration gets the name.
        timer.tick(h.tick, [view, cache, remembered, key, chapter_text, chapters_radio, page_pick], write_poll_outs,
                   api_name="refresh",
                   js=TICK_JS, concurrency_limit=8,
                   concurrency_id="poll", **quiet)
        compare_timer.tick(h.tick_compare, [view, cache, remembered, key], cmp_poll_outs, api_name="refresh_compare",
                           concurrency_limit=8, concurrency_id="poll", **quiet)
        # A tab's own poll runs while it is open (each tab select sets both timers).
        tab_timers = [compare_timer, bible_timer]
        selected = {}
        for tab, own in ((write_tab, None), (bible.tab, bible_timer), (compare_tab, compare_timer),
                         (history_tab, None)):
            states = tuple(t is own for t in tab_timers)
            selected[tab] = tab.select(lambda states=states: tuple(gr.Timer(active=on) for on in states), None,
                                       tab_timers, api_visibility="private", **quiet)
        selected[compare_tab].then(h.refresh_compare, [view, cache], cmp_poll_outs, api_visibility="private", **quiet)
        selected[bible.tab].then(story.bible, [view], bible.outputs(), api_name="story_bible")
        story_ui.wire(story, bible, summary, view=view, cache=cache, chapter_owner=chapter_owner, timer=bible_timer,
                      then_refresh=then_refresh)
        identity_outs = [identity_html, claim_btn]
        loaded = demo.load(h.load, [view, remembered, key], project_outs + [new_acc, cmp_pick, key, *identity_outs],
                           api_name="load")
        then_refresh(loaded).then(h.comparisons_table, [view], cmp_table, api_visibility="private", **quiet)
        loaded.then(None, None, None, js=LOADED_JS)
        then_refresh(claim_btn.click(h.claim, [view, key], project_outs + identity_outs, api_name="claim"))

        then_refresh(create_btn.click(h.create_project, [view, new_title, new_kind, new_premise],
                                      project_outs + [new_title, new_premise, new_acc], api_name="create_project",
                                      **navigate))
        then_refresh(project_dd.input(h.open_project, [view, project_dd], project_outs, api_name="open_project",
                                      trigger_mode="multiple", **navigate))
        then_refresh(save_proj_btn.click(h.save_project, [view, project_owner, proj_title, proj_kind, proj_goal],
                                         project_outs, api_name="save_project"))
        del_proj_btn.click(h.ask_delete_project, [view], [del_proj_confirm, del_proj_msg], api_visibility="private")
        del_proj_no.click(_hide, None, del_proj_confirm, api_visibility="private")
        then_refresh(del_proj_yes.click(h.delete_project, [view], project_outs + [del_proj_confirm],
                                        api_name="delete_project", **navigate))

        opened = chapters_radio.input(h.open_chapter, [view, chapters_radio, page_pick], chapter_outs,
                                      api_name="open_chapter", js=PICK_JS, trigger_mode="multiple", **navigate)
        then_refresh(opened.then(None, None, None, js=PICKED_JS)).then(h.revisions, [view], revision_outs,
                                                                       api_visibility="private", **quiet)
        revisions_acc.expand(h.revisions, [view], revision_outs, api_name="revisions")
        revision_pick.input(h.show_revision, [view, revision_pick], [revision_text, revision_diff],
                            api_name="show_revision")
        then_refresh(restore_btn.click(h.restore_revision, [view, revision_pick], revision_outs,
                                       api_name="restore_revision"))
        then_refresh(add_ch_btn.click(h.add_chapter, [view], chapter_outs, api_name="add_chapter", **navigate))
        then_refresh(up_btn.click(functools.partial(h.move_chapter, delta=-1), [view], None,
                                  api_name="move_chapter_up"))
        then_refresh(down_btn.click(functools.partial(h.move_chapter, delta=1), [view], None,
                                    api_name="move_chapter_down"))
        del_ch_btn.click(h.ask_delete_chapter, [view], [del_ch_confirm, del_ch_msg], api_visibility="private")
        del_ch_no.click(_hide, None, del_ch_confirm, api_visibility="private")
        then_refresh(del_ch_yes.click(h.delete_chapter, [view], chapter_outs + [del_ch_confirm],
                                      api_name="delete_chapter", **navigate))

        meta_inputs = [view, project_owner, chapter_owner, premise, chapter_title, instructions]
        for box in (premise, chapter_title, instructions):
            then_refresh(box.blur(h.autosave, meta_inputs, None, api_visibility="private", **quiet))
        then_refresh(save_btn.click(h.save_chapter, [view, cache, project_owner, chapter_owner, premise,
                                                     chapter_title, instructions, chapter_text], None,
                                    api_name="save_chapter")).then(h.revisions, [view], revision_outs,
                                                                   api_visibility="private", **quiet)

        for button, mode in ((gen_btn, "generate"), (cont_btn, "continue"), (regen_btn, "regenerate"),
                             (resume_btn, "resume")):
            then_drive(then_refresh(button.click(_queue_handler(h, mode), meta_inputs, status_html, api_name=mode,
                                                 inputs_kwargs=panel_w.by_name())))
        then_refresh(stop_btn.click(h.stop, [view], None, api_name="stop"))

        cmp_started = cmp_btn.click(h.start_comparison, [view, cmp_prompt], cmp_pick_outs + [cmp_table],
                                    api_name="compare", inputs_kwargs=panel_c.by_name())
        then_drive(cmp_started.then(h.refresh_compare, [view, cache], cmp_poll_outs, api_visibility="private",
                                    **quiet))
        cmp_pick.input(h.open_comparison, [view, cmp_pick], cmp_pick_outs, api_name="open_comparison").then(
            h.refresh_compare, [view, cache], cmp_poll_outs, api_visibility="private", **quiet)
        cmp_table.select(h.select_comparison, [view], cmp_pick_outs, api_visibility="private").then(
            h.refresh_compare, [view, cache], cmp_poll_outs, api_visibility="private", **quiet)

        history_outs = [runs_table, run_pick]
        details_outs = [run_summary, run_metrics, *run_plots]
        run_pick.input(h.run_details, [view, run_pick], details_outs, api_name="run_details")
        history_btn.click(h.history, [view, all_projects, run_pick], history_outs, api_name="history").then(
            h.run_details, [view, run_pick], details_outs, api_visibility="private")
        for trigger in (history_tab.select, all_projects.input):
            trigger(h.history, [view, all_projects, run_pick], history_outs, api_visibility="private").then(
                h.run_details, [view, run_pick], details_outs, api_visibility="private")
        runs_table.select(h.select_run, None, run_pick, api_visibility="private").then(
            h.run_details, [view, run_pick], details_outs, api_visibility="private")
        export_btn.click(h.export, [view, export_fmt], export_file, api_name="export")
        then_refresh(import_btn.click(story.import_project, [view, import_file], project_outs,
                                      api_name="import_project", **navigate))
    demo.queue(default_concurrency_limit=4)
    return demo
