"""The story's memory in the UI: a chapter's summary (Write tab) and the Story bible tab (outline, lorebook, every
chapter's summary), with their handlers.

Same rules as app.ui: handlers are plain methods of plain values, scoped to the session's writer through the main
``Handlers`` (``_me``, ``_project``, ``_chapter``), and every failure becomes a readable ``gr.Error``. Generation is
queued (app.jobs) and done by the worker: a summary run after each chapter run (or on request), an outline run on
request; the Write tab's poll shows the summary as it is written, the Story bible tab's own timer the outline.
"""
from __future__ import annotations

import html
import logging
import time
from dataclasses import dataclass
from typing import Any

import gradio as gr

import storage
from app import export as exporter
from app import jobs, views
from app.handling import guarded, owner_id
from app.live import LiveCache, View
from app.prompting import parse_outline

log = logging.getLogger(__name__)

DEFAULT_OUTLINE_CHAPTERS = 10


def _rows(table: Any, width: int) -> list[list[str]]:
    """A Dataframe's value (a list of rows, or pandas-like with ``values``) as rows of `width` strings."""
    if table is None:
        return []
    if hasattr(table, "values") and not isinstance(table, dict):
        table = table.values.tolist()
    if isinstance(table, dict):  # {"headers": ..., "data": ...}, as an API caller may send it
        table = table.get("data") or []
    rows = []
    for row in table:
        cells = ["" if c is None else str(c) for c in list(row)[:width]]
        rows.append(cells + [""] * (width - len(cells)))
    return rows


def _table(rows: list[list[str]], width: int) -> list[list[str]]:
    return rows or [[""] * width]  # an empty table still shows one row to type into


class StoryHandlers:
    """Handlers of the summary box and the Story bible tab; `h` is the studio's ``app.ui.Handlers``."""

    def __init__(self, h: Any) -> None:
        self.h = h
        self.db: storage.Database = h.db

    def _settings(self, project: Any) -> dict[str, Any]:
        return project.settings or {}

    # -- a chapter's summary ----------------------------------------------------------------------------------------

    @guarded
    def save_summary(self, view: View, chapter_owner: Any, summary: str) -> None:
        """Keep the writer's own summary of the open chapter (empty: none)."""
        self.h._check_owner(view, None, chapter_owner)
        chapter = self.h._chapter(view)
        storage.set_summary(self.db, chapter.id, summary or "", self.h._me(view))
        gr.Info("Summary saved: it is yours now, and automatic summaries leave it alone." if (summary or "").strip()
                else "Summary removed.")

    @guarded
    def summarize(self, view: View, chapter_owner: Any) -> None:
        """Queue a summary of the open chapter, written by the model (replacing the current one)."""
        self.h._check_owner(view, None, chapter_owner)
        chapter = self.h._chapter(view)
        project = self.h._project(view)
        ctx, hosting = self.h.ctx, self.h.hosting
        run = jobs.queue_summary(self.db, chapter.id, self._settings(project), model=ctx.model, heads=ctx.heads,
                                 owner=self.h._me(view), max_queued=hosting.max_queued)
        assert run is not None  # only automatic summaries are skipped silently
        gr.Info(f"Summary queued (run #{run.id}); it appears here as it is written.")

    # -- the Story bible tab ------------------------------------------------------------------------------------------

    @guarded
    def bible(self, view: View) -> list[Any]:
        """The tab's values: automatic summaries, lore share, lorebook table, summaries overview, outline state, and
        the id of the project they are of (a hidden field that saves are checked against)."""
        if view.project_id is None:
            return [gr.update(value=True), gr.update(value=storage.models.DEFAULT_LORE_TOKENS),
                    gr.update(value=_table([], 3)), '<div class="muted">Open or create a project first.</div>',
                    views.outline_status(None), 0]
        me = self.h._me(view)
        project = self.h._project(view)
        lore = [[e.name, e.keywords, e.text] for e in storage.list_lore(self.db, project.id, me)]
        chapters = storage.list_chapters(self.db, project.id, owner=me)
        outline = storage.latest_outline_run(self.db, project.id, me)
        return [gr.update(value=project.auto_summary), gr.update(value=project.lore_tokens),
                gr.update(value=_table(lore, 3)), views.summaries_overview(chapters), views.outline_status(outline),
                project.id]

    def _check_bible(self, view: View, bible_owner: Any) -> None:
        """Refuse a change sent from a tab that shows another project than the open one, or none yet."""
        shown = owner_id(bible_owner)
        if shown is None and view.project_id is not None:
            raise gr.Error("This tab is still loading the project; nothing was saved. Try again in a moment.",
                           print_exception=False)
        if shown != view.project_id:
            raise gr.Error("The page switched project while this tab showed another one; nothing was saved. "
                           "Check the tables and try again.", print_exception=False)

    @guarded
    def save_lore(self, view: View, bible_owner: Any, auto_summary: bool, lore_tokens: Any, table: Any) -> list[Any]:
        """Save the lorebook (the whole table, in its order), its token share and the automatic-summaries switch."""
        self._check_bible(view, bible_owner)
        project = self.h._project(view)
        me = self.h._me(view)
        if isinstance(lore_tokens, float) and lore_tokens.is_integer():
            lore_tokens = int(lore_tokens)  # Numbers arrive as floats
        entries = [{"name": n, "keywords": k, "text": t} for n, k, t in _rows(table, 3)]
        storage.set_lore(self.db, project.id, entries, me)
        storage.update_project(self.db, project.id, lore_tokens=lore_tokens, auto_summary=bool(auto_summary),
                               owner=me)
        gr.Info("Lorebook saved.")
        return self.bible(view)

    @guarded
    def propose_outline(self, view: View, bible_owner: Any, n_chapters: Any) -> str:
        """Queue an outline run: the model proposes a plan of `n_chapters` chapters from the premise. A tab that shows
        no project yet (a click right after opening it) proposes for the open project: nothing it shows is read."""
        if owner_id(bible_owner) is not None:
            self._check_bible(view, bible_owner)
        project = self.h._project(view)
        ctx, hosting = self.h.ctx, self.h.hosting
        run = jobs.queue_outline(self.db, project.id, n_chapters if n_chapters is not None else 0,
                                 self._settings(project), model=ctx.model, heads=ctx.heads, owner=self.h._me(view),
                                 max_queued=hosting.max_queued)
        return views.outline_status(run)

    def refresh_outline(self, view: View, cache: LiveCache) -> tuple[Any, ...]:
        """The Story bible tab's poll (outputs: outline state, outline table, then ``bible``'s but the state): the
        outline run's state, its proposal in the table once it is done (once per run, so what the writer edits
        afterwards is never overwritten), and the whole tab afresh when the page opened another project."""
        skip = tuple(gr.skip() for _ in range(7))
        try:
            run = (storage.latest_outline_run(self.db, view.project_id, self.h._me(view))
                   if view.project_id is not None else None)
            switched = cache.keys.get("outline-project") != view.project_id
            tab = self.bible(view) if switched else None
        except Exception:  # a transient database error, or no writer yet: try again on the next tick
            log.warning("outline refresh failed", exc_info=True)
            return skip
        now = time.monotonic()
        with cache.lock:
            status = views.outline_status(run)
            status_out = status if cache.due("outline-status", (view.project_id, status), now) else gr.skip()
            table, rest = gr.skip(), skip[:5]
            if tab is not None:  # another project: not its outline or lorebook any more
                cache.keys["outline-project"] = view.project_id
                cache.keys.pop("outline-filled", None)
                table, rest = gr.update(value=_table([], 2)), (*tab[:4], tab[5])
            if run is not None and run.status == "done" and cache.keys.get("outline-filled") != run.id:
                cache.keys["outline-filled"] = run.id
                table = gr.update(value=_table([list(r) for r in parse_outline(run.text)], 2))
        return (status_out, table, *rest)

    @guarded
    def apply_outline(self, view: View, bible_owner: Any, table: Any) -> None:
        """Give the chapters the outline's titles and instructions, adding chapters past the last."""
        self._check_bible(view, bible_owner)
        project = self.h._project(view)
        rows = [(title, instructions) for title, instructions in _rows(table, 2)]
        added, updated = storage.apply_outline(self.db, project.id, rows, self.h._me(view))
        gr.Info(f"Outline applied: {added} chapter(s) added, {updated} updated; their texts are unchanged.")

    # -- a project file ----------------------------------------------------------------------------------------------

    @guarded
    def import_project(self, view: View, path: Any) -> list[Any]:
        """Create a project from a JSON project file (exported here or by another studio) and open it."""
        if not path:
            raise gr.Error("Choose a project file (.json) first.", print_exception=False)
        project = exporter.import_project_file(self.db, str(path), self.h._me(view))
        view.project_id = project.id
        view.chapter_id = self.h._first_chapter(view, project.id)
        gr.Info(f"Imported “{html.escape(project.title)}”.")
        return self.h.project_outputs(view)


# -- layout -------------------------------------------------------------------------------------------------------------

@dataclass
class SummaryPanel:
    accordion: gr.Accordion
    box: gr.Textbox
    note: gr.HTML
    save: gr.Button
    again: gr.Button


def summary_panel() -> SummaryPanel:
    """The open chapter's summary, under its text (inside the Write tab's layout)."""
    with gr.Accordion("Summary (story so far)", open=False, elem_id="summary-box") as acc:
        box = gr.Textbox(label="Summary of this chapter", lines=4, max_lines=10, elem_id="chapter-summary",
                         placeholder="Written by the model when the chapter's run ends; or write your own.")
        note = gr.HTML(elem_id="summary-note", js_on_load=None)
        with gr.Row(elem_classes="tight-row"):
            save = gr.Button("Save summary", size="sm", elem_id="save-summary")
            again = gr.Button("Summarize again", size="sm", elem_id="summarize")
    return SummaryPanel(acc, box, note, save, again)


@dataclass
class BiblePanel:
    tab: gr.Tab
    n_chapters: gr.Number
    propose: gr.Button
    outline_status: gr.HTML
    outline: gr.Dataframe
    apply: gr.Button
    auto_summary: gr.Checkbox
    lore_tokens: gr.Number
    lore: gr.Dataframe
    save_lore: gr.Button
    overview: gr.HTML
    owner: gr.Number  # the project the tab shows (hidden)

    def outputs(self) -> list[Any]:
        """The components ``StoryHandlers.bible`` fills, in its order."""
        return [self.auto_summary, self.lore_tokens, self.lore, self.overview, self.outline_status, self.owner]

    def poll_outputs(self) -> list[Any]:
        """The components ``StoryHandlers.refresh_outline`` fills, in its order."""
        return [self.outline_status, self.outline, self.auto_summary, self.lore_tokens, self.lore, self.overview,
                self.owner]


def bible_tab() -> BiblePanel:
    """The Story bible tab (inside the app's gr.Tabs)."""
    with gr.Tab("Story bible", id="bible", elem_id="tab-bible") as tab:
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=420):
                gr.Markdown("### Outline")
                with gr.Row(equal_height=True):
                    n_chapters = gr.Number(label="Chapters", value=DEFAULT_OUTLINE_CHAPTERS, precision=0, minimum=1,
                                           maximum=jobs.MAX_OUTLINE_CHAPTERS, elem_id="outline-n", scale=0,
                                           min_width=120)
                    propose = gr.Button("Propose an outline", elem_id="propose-outline", scale=0, min_width=200)
                outline_status = gr.HTML(views.outline_status(None), elem_id="outline-status", js_on_load=None)
                outline = gr.Dataframe(headers=views.OUTLINE_COLUMNS, value=_table([], 2), type="array",
                                       interactive=True, wrap=True, elem_id="outline-table", max_height=420,
                                       column_widths=["30%", "70%"])
                apply = gr.Button("Apply to the chapters", variant="primary", elem_id="apply-outline")
            with gr.Column(scale=1, min_width=420):
                gr.Markdown("### Lorebook")
                gr.HTML('<div class="muted">An entry goes into a chapter\'s prompt when one of its keywords '
                        "(comma-separated) appears in the chapter's instructions or the text just before it, "
                        "in this order, within the token share.</div>", js_on_load=None)
                with gr.Row(equal_height=True):
                    lore_tokens = gr.Number(label="Lorebook share (tokens)", precision=0, minimum=0,
                                            maximum=storage.MAX_LORE_TOKENS, elem_id="lore-tokens",
                                            value=storage.models.DEFAULT_LORE_TOKENS)
                    auto_summary = gr.Checkbox(label="Summarize each chapter when its run ends", value=True,
                                               elem_id="auto-summary")
                lore = gr.Dataframe(headers=views.LORE_COLUMNS, value=_table([], 3), type="array", interactive=True,
                                    wrap=True, elem_id="lore-table", max_height=420,
                                    column_widths=["20%", "25%", "55%"])
                save_lore = gr.Button("Save lorebook", variant="primary", elem_id="save-lore")
        gr.Markdown("### Story so far")
        overview = gr.HTML(elem_id="summaries", js_on_load=None)
        owner = gr.Number(value=0, visible=False, precision=0)
    return BiblePanel(tab, n_chapters, propose, outline_status, outline, apply, auto_summary, lore_tokens, lore,
                      save_lore, overview, owner)


def wire(story: StoryHandlers, bible: BiblePanel, summary: SummaryPanel, *, view: Any, cache: Any,
         chapter_owner: Any, timer: Any, then_refresh: Any) -> None:
    """Events of the summary box and the Story bible tab (`timer`: the tab's poll, which app.ui turns on while the tab
    is open, and then fills the tab with ``StoryHandlers.bible``)."""
    quiet = {"show_progress": "hidden"}
    then_refresh(summary.save.click(story.save_summary, [view, chapter_owner, summary.box], None,
                                    api_name="save_summary"))
    then_refresh(summary.again.click(story.summarize, [view, chapter_owner], None, api_name="summarize"))
    bible_outs = bible.outputs()
    timer.tick(story.refresh_outline, [view, cache], bible.poll_outputs(),
               api_name="refresh_outline", concurrency_limit=8, concurrency_id="poll", **quiet)
    bible.save_lore.click(story.save_lore, [view, bible.owner, bible.auto_summary, bible.lore_tokens, bible.lore],
                          bible_outs, api_name="save_lore")
    bible.propose.click(story.propose_outline, [view, bible.owner, bible.n_chapters], bible.outline_status,
                        api_name="propose_outline")
    then_refresh(bible.apply.click(story.apply_outline, [view, bible.owner, bible.outline], None,
                                   api_name="apply_outline")).then(story.bible, [view], bible_outs,
                                                                   api_visibility="private", **quiet)
