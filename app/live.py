"""Live progress: what changed in the database since a browser session last looked.

The page polls about once a second. Each session keeps a ``LiveCache`` (in ``gr.State``) with what it last showed;
``poll_write`` / ``poll_compare`` read the database and return only the parts that changed (None = unchanged), so an
idle page sends almost nothing, and a long run is read incrementally: step rows with ``after_step`` into bounded
``StepBuckets``, the chapter text only when its row changed. Everything shown comes from the database, so a reload,
a second tab or a server restart shows the same text and progress.

A running run's charts are redrawn every ``CHARTS_EVERY_S`` seconds, not on every poll (its text, counts and status
line still move every second): the page's Plotly redraws of three charts each second kept a browser on the same
machine busy for about half a core, which the model's threads then lacked (``python -m app.page_bench``), and the
server built three figures for each poll.

A changed part is sent again on every poll for ``RESEND_S`` seconds after its change. Polls are computed one at a
time per session, but a timer tick and an action's follow-up refresh run side by side and their responses may reach
the page in either order: an older response arriving last would otherwise stay on the page for good (e.g. "running"
after Stop), because the cache believes the newer part is shown. The next tick's resend repairs it.

The chapter text is the exception, because the writer types into it: the page sends a digest of the text it holds
with every poll (``text_digest``, computed in the browser by ``DIGEST_JS``), and the text is sent exactly when the
page holds something else than it should, unless what it holds is the writer's own typing (a text this session
neither sent nor saw stored, in the same editable chapter), which is never overwritten. A stale response that lands last is then
repaired by the next poll too, without a window in which typing is replaced.

The chapter list's pick is the writer's too: the page says which chapter it shows picked and whether a pick of its
own is still on its way to the server (``PageChapter``), and a poll moves the pick only when none is and it differs
from the server's. A response computed before a click and landing after it would otherwise put the old chapter back,
and a click on that chapter, already shown picked, would send nothing.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import storage
from app import jobs, views
from app.charts import Figures, StepBuckets, all_figures

# While a run writes, the textbox shows at most this much of the chapter's end: resending and re-laying out a
# 400 KB textarea every second would make the page sluggish. The whole text is shown (and editable) once it stops.
LIVE_TAIL_CHARS = 50_000
RESEND_S = 2.0  # polls run about once a second: a change is sent on one or two later ticks too
CHARTS_EVERY_S = 5.0  # a running run's charts are redrawn this often, at most
SENT_KEPT = 8  # digests of recently sent texts remembered per session

# The browser's half of text_digest: FNV-1a over the string's UTF-16 code units, and its length.
DIGEST_JS = """(text) => {
  if (typeof text !== "string") return null;
  let h = 0x811c9dc5;
  for (let i = 0; i < text.length; i++) { h ^= text.charCodeAt(i); h = Math.imul(h, 0x01000193) >>> 0; }
  return text.length + ":" + h.toString(16);
}"""


def text_digest(text: str) -> str:
    """A short digest of `text` that the page computes too (DIGEST_JS): its length and FNV-1a hash in UTF-16."""
    units = text.encode("utf-16-le")
    h = 0x811C9DC5
    for i in range(0, len(units), 2):
        h = ((h ^ (units[i] | units[i + 1] << 8)) * 0x01000193) & 0xFFFFFFFF
    return f"{len(units) // 2}:{h:x}"


@dataclass
class View:
    """What one browser session has open (its gr.State). Ids only: everything else is read from the database."""

    project_id: int | None = None
    chapter_id: int | None = None
    compare_id: int | None = None
    owner: str | None = None  # the writer (app.identity), set by the page-load handler on a multi-user studio
    loaded: bool = False  # set by the page-load handler; False in a session the server does not know (restart)
    picks: int = 0  # the number of the page's newest chapter pick opened (ui.PICK_JS counts them)


@dataclass
class LiveCache:
    """What one session's page currently shows, to send only changes. Owned by the poll handlers."""

    keys: dict[str, Any] = field(default_factory=dict)  # part -> key of what was last sent for it
    resend_until: dict[str, float] = field(default_factory=dict)  # part -> time.monotonic() to resend it until
    chapter_id: int | None = None  # the chapter whose text the textbox holds
    text_full: bool = False  # the textbox holds the whole chapter (not a live tail)
    text_editable: bool = False
    # (the text part's key, digest of the text the page should hold, the whole text's length, whether it is a tail)
    text_digest: tuple[Any, str, int, bool] | None = None
    sent_digests: dict[str, None] = field(default_factory=dict)  # texts recently sent or stored, oldest first
    summary_chapter_id: int | None = None  # the chapter whose summary the summary box holds, editable
    run_id: int | None = None
    buckets: StepBuckets | None = None
    # Compare
    compare_id: int | None = None
    compare_runs: dict[str, StepBuckets] = field(default_factory=dict)
    # Charts: per part, the key and figures last built (a resend sends them again) and when they were built.
    built: dict[str, tuple[Any, Figures, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # An attribute, not a field: Gradio turns a State's dataclass value into a dict of its fields for the page's
        # config, and a lock cannot be copied.
        self.lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> "LiveCache":
        # gr.State deep-copies its initial value per session; the initial cache is always empty.
        return LiveCache()

    def due(self, part: str, key: Any, now: float, resend: bool = True) -> bool:
        """Whether `part`, whose content is now described by `key`, is to be sent: it changed since the last poll, or
        (with `resend` when it changed) it changed less than RESEND_S ago."""
        if part not in self.keys or self.keys[part] != key:
            self.keys[part] = key
            self.resend_until[part] = now + RESEND_S if resend else now
            return True
        return now < self.resend_until[part]

    def charts(self, part: str, shows: Any, steps: tuple[int, ...], running: bool, now: float,
               build: Callable[[], Figures]) -> Figures | None:
        """The charts of `part` to send, or None. `shows` is what they are of (runs, statuses), `steps` each run's
        step count: they are drawn anew when `shows` changes or a run's first steps arrive, and with more steps at
        most every CHARTS_EVERY_S while a run is `running`; a resend (see due) sends the figures last built."""
        shown = self.keys.get(part)
        built_key, figures, drawn_at = self.built.get(part, (None, None, -math.inf))
        held = (running and shown is not None and shown[0] == shows and now - drawn_at < CHARTS_EVERY_S
                and not any(new and not old for old, new in zip(shown[1], steps)))
        key = shown if held else (shows, steps)
        if not self.due(part, key, now):
            return None
        if figures is None or built_key != key:
            figures = build()
            self.built[part] = (key, figures, now)
        return figures

    def forget(self, *parts: str) -> None:
        for part in parts:
            self.keys.pop(part, None)


@dataclass(frozen=True)
class PageChapter:
    """The chapter the page's list shows picked, and whether the writer picked one the server has not answered."""

    picked: int | None
    pending: bool


@dataclass
class WriteUpdate:
    """Changes for the Write tab; None = leave as it is."""

    worker_html: str | None = None
    chapters: list[tuple[str, int]] | None = None  # the list's choices
    select: bool = False  # whether to set the list's pick to `selected`
    selected: int | None = None
    status_html: str | None = None
    text: tuple[str | None, bool] | None = None  # (value, editable); value None: only the state
    counts_html: str | None = None
    goal_html: str | None = None
    summary: tuple[str, bool] | None = None  # the open chapter's summary (value, editable)
    summary_note: str | None = None
    figures: Figures | None = None
    controls: dict[str, Any] | None = None  # can_write, active, resumable, run_id


def worker_html(db: storage.Database, zerogpu: bool = False) -> tuple[str, bool]:
    """(header HTML, whether some worker is ready). A "ready" row not refreshed for a minute is a dead worker's
    (killed without a chance to say so): it counts as not ready, and the header says it is not responding."""
    states = storage.get_worker_states(db)
    now = views.utcnow()
    ready = any(s.state == "ready" for s in views.responsive_workers(states, now, zerogpu))
    return views.worker_badge(states, zerogpu, now=now), zerogpu or ready


def _refresh_buckets(db: storage.Database, cache_buckets: StepBuckets | None, run_id: int) -> StepBuckets:
    """`cache_buckets` (or new ones) with the run's step rows recorded since their last step added."""
    buckets = cache_buckets or StepBuckets()
    buckets.extend(storage.get_steps(db, run_id, after_step=buckets.last_step))
    return buckets


def poll_write(db: storage.Database, view: View, cache: LiveCache, *, zerogpu: bool = False,
               now: float | None = None, shown: str | None = None, page: PageChapter | None = None) -> WriteUpdate:
    """Read the open chapter's state and return what is to be sent since ``cache`` (which is updated); ``now`` is a
    time.monotonic() reading (default: the current one); ``shown`` the page's digest of the chapter text it holds and
    ``page`` its chapter list's pick (None: unknown, as from an API caller)."""
    with cache.lock:  # a timer tick and an action's follow-up refresh may overlap for one session
        return _poll_write(db, view, cache, zerogpu, time.monotonic() if now is None else now, shown, page)


def _shown_text(db: storage.Database, chapter_id: int, active: bool) -> tuple[str, bool, int]:
    """The text the chapter box is to show, whether it is a live tail (while a run writes a long chapter), and the
    length of the whole text."""
    text = storage.get_chapter(db, chapter_id).text
    tail = active and len(text) > LIVE_TAIL_CHARS
    return ("…" + text[-LIVE_TAIL_CHARS:] if tail else text), tail, len(text)


def _known(cache: LiveCache, digest: str) -> None:
    """Remember `digest` as a text the page may hold from us (sent, or stored before a change): not typing."""
    cache.sent_digests.pop(digest, None)
    cache.sent_digests[digest] = None
    while len(cache.sent_digests) > SENT_KEPT:
        cache.sent_digests.pop(next(iter(cache.sent_digests)))


def _poll_write(db: storage.Database, view: View, cache: LiveCache, zerogpu: bool, now: float,
                shown: str | None, page: PageChapter | None) -> WriteUpdate:
    up = WriteUpdate()
    header, ready = worker_html(db, zerogpu)
    if cache.due("worker", header, now):
        up.worker_html = header

    chapters = storage.list_chapters(db, view.project_id) if view.project_id is not None else []
    chapter = next((c for c in chapters if c.id == view.chapter_id), None)
    selected = chapter.id if chapter else None
    due = cache.due("chapters", tuple((c.id, c.title, c.status) for c in chapters) + (view.chapter_id,), now)
    if due:
        up.chapters = [(views.chapter_label(i, c), c.id) for i, c in enumerate(chapters)]
    # the pick: with the list for an API caller; for a page, only where it shows another and has none on its way
    up.select = due if page is None else not page.pending and page.picked != selected
    if up.select:
        up.selected = selected
    goal = None
    if view.project_id is not None:
        try:
            goal = storage.get_project(db, view.project_id).goal_words
        except storage.NotFoundError:
            pass
    goal_html = views.goal_line(sum(c.word_count for c in chapters), goal)
    if cache.due("goal", goal_html, now):
        up.goal_html = goal_html

    run = storage.latest_run_for_chapter(db, chapter.id) if chapter is not None else None
    active = run is not None and run.status in views.ACTIVE

    # -- text and counts (read only when the chapter row changed, or to resend them) --
    if chapter is None:
        if cache.due("text", (None, view.project_id, view.chapter_id), now):
            message = "" if view.project_id is None else "This chapter no longer exists; pick another one."
            up.text = ("" if view.chapter_id is None else message, False)
            up.counts_html = views.counts_line(0, None, None)
            cache.text_full, cache.text_editable, cache.chapter_id = False, False, None
    elif shown is None:  # a caller that does not say what it holds (the API): by change and resend, as the rest
        # Resending an editable text could overwrite what the writer types: not done when the same chapter was
        # already editable (a save), only where an older response may have left other or read-only text.
        keeps_editing = not active and cache.text_editable and cache.chapter_id == chapter.id
        if cache.due("text", (chapter.id, chapter.updated_at, chapter.word_count, chapter.status, active), now,
                     resend=not keeps_editing):
            text, tail, full = _shown_text(db, chapter.id, active)
            up.text = (text, not active)
            up.counts_html = views.counts_line(chapter.word_count, full, run.n_tokens if run else None,
                                               LIVE_TAIL_CHARS if tail else None)
            cache.text_full, cache.text_editable, cache.chapter_id = not tail, not active, chapter.id
    else:
        key = (chapter.id, chapter.updated_at, chapter.word_count, chapter.status, active)
        same_editable = not active and cache.text_editable and cache.chapter_id == chapter.id
        text = None
        if cache.text_digest is None or cache.text_digest[0] != key:
            if cache.text_digest is not None:
                _known(cache, cache.text_digest[1])  # the stored text it replaces: a page holding that is stale
            text, tail, full = _shown_text(db, chapter.id, active)
            cache.text_digest = (key, text_digest(text), full, tail)
        _, want, full, tail = cache.text_digest
        typed = same_editable and shown != want and shown not in cache.sent_digests
        state_due = cache.due("text-state", (chapter.id, active), now)  # read-only <-> editable, resent a while
        if not typed and shown != want:
            if text is None:
                text = _shown_text(db, chapter.id, active)[0]
            up.text = (text, not active)
            _known(cache, want)
        elif not typed and state_due:
            up.text = (None, not active)  # the right text, perhaps in the wrong state: never resend the value
        if up.text is not None:
            cache.text_full, cache.text_editable, cache.chapter_id = not tail, not active, chapter.id
        if cache.due("counts", key, now):
            up.counts_html = views.counts_line(chapter.word_count, full, run.n_tokens if run else None,
                                               LIVE_TAIL_CHARS if tail else None)

    # -- summary (the same care as the text: never resent over what the writer may be typing) --
    summary_run = storage.summary_run(db, chapter.id) if chapter is not None else None
    writing = summary_run is not None and summary_run.status in views.ACTIVE
    if chapter is None:
        if cache.due("summary", None, now):
            up.summary, up.summary_note, cache.summary_chapter_id = ("", False), "", None
    else:
        keeps_editing = not writing and cache.summary_chapter_id == chapter.id
        if cache.due("summary", (chapter.id, chapter.summary, chapter.summary_source, writing), now,
                     resend=not keeps_editing):
            up.summary = (chapter.summary, not writing)
            cache.summary_chapter_id = None if writing else chapter.id
        note = views.summary_note(chapter, summary_run)
        if cache.due("summary-note", note, now):
            up.summary_note = note

    # -- charts (incremental) --
    run_id = run.id if run else None
    if run_id != cache.run_id:
        cache.run_id, cache.buckets = run_id, None
    if run is not None:
        cache.buckets = _refresh_buckets(db, cache.buckets, run.id)
    empty = ("No run yet" if run is None else
             "Queued: waiting for the worker" if run.status == "queued" else "No steps recorded")
    steps = (cache.buckets.n_steps if cache.buckets else 0,)
    up.figures = cache.charts("charts", (run_id, run.status if run else None), steps,
                              run is not None and run.status == "running", now,
                              lambda: all_figures(cache.buckets, empty=empty))

    # -- status line --
    b = cache.buckets
    position = storage.queue_position(db, run.id) if run is not None and run.status == "queued" else None
    status = views.run_status(run, position=position,
                              tokens_per_s=(run.tokens_per_s or (b.last_tokens_per_s if b else None)) if run else None,
                              tokens_per_step=b.mean_tokens_per_step if b and b.n_steps else None,
                              worker_ready=ready) + views.prompt_line(run.prompt_info if run else None)
    if cache.due("status", status, now):
        up.status_html = status

    # -- buttons --
    controls = {"can_write": chapter is not None and not active, "active": active,
                "resumable": run is not None and run.status in jobs.RESUMABLE and run.n_tokens > 0, "run_id": run_id}
    if cache.due("controls", tuple(controls.items()), now):
        up.controls = controls
    return up


# -- Compare --------------------------------------------------------------------------------------------------------

COMPARE_PARTS = ("cmp-summary", "cmp-listing", "cmp-figures", "ar_line", "ts_line", "ar_text", "ts_text")


@dataclass
class CompareUpdate:
    summary_html: str | None = None
    ar_line: str | None = None
    ts_line: str | None = None
    ar_text: str | None = None
    ts_text: str | None = None
    figures: Figures | None = None
    active: bool = False
    listing_changed: bool = False  # a run's status or the verdict changed: the past-comparisons table is stale


def poll_compare(db: storage.Database, compare_id: int | None, cache: LiveCache, *,
                 now: float | None = None) -> CompareUpdate:
    """Read a comparison's two runs and return what is to be sent since ``cache`` (which is updated)."""
    with cache.lock:
        return _poll_compare(db, compare_id, cache, time.monotonic() if now is None else now)


def _poll_compare(db: storage.Database, compare_id: int | None, cache: LiveCache, now: float) -> CompareUpdate:
    up = CompareUpdate()
    if compare_id != cache.compare_id:  # another comparison: everything is sent afresh
        cache.compare_id, cache.compare_runs = compare_id, {}
        cache.forget(*COMPARE_PARTS)
    if compare_id is None:
        if cache.due("cmp-summary", None, now):
            up.summary_html = views.compare_summary(None, None, None)
            up.ar_line = up.ts_line = ""
            up.ar_text = up.ts_text = ""
            up.figures = all_figures(None, empty="No comparison selected")
        return up
    try:
        comparison = storage.get_comparison(db, compare_id)
    except storage.NotFoundError:
        comparison = None
    runs: dict[str, Any] = {}
    for label, run_id in (("Vanilla", comparison and comparison.ar_run_id),
                          ("TokenSwift", comparison and comparison.tokenswift_run_id)):
        if run_id is None:
            runs[label] = None
            continue
        try:
            runs[label] = storage.get_run(db, run_id)
        except storage.NotFoundError:
            runs[label] = None
    ar, ts = runs["Vanilla"], runs["TokenSwift"]
    up.active = any(r is not None and r.status in views.ACTIVE for r in runs.values())
    first_sight = "cmp-listing" not in cache.keys  # the past-comparisons table was filled when the page loaded
    # the verdict includes where the runs differ and the gap there, which the worker stores just after settling
    listing = (tuple(r.status if r else None for r in runs.values()),
               (comparison.tokens_match, bool(comparison.divergence)) if comparison else None)
    up.listing_changed = cache.due("cmp-listing", listing, now) and not first_sight

    shows, n_steps = [], []
    for label, run in runs.items():
        if run is None:
            continue
        buckets = cache.compare_runs[label] = _refresh_buckets(db, cache.compare_runs.get(label), run.id)
        shows.append((label, run.status))
        n_steps.append(buckets.n_steps)
    up.figures = cache.charts("cmp-figures", tuple(shows), tuple(n_steps),
                              any(status == "running" for _, status in shows), now,
                              lambda: all_figures(dict(cache.compare_runs), empty="Waiting for the first steps"))

    per_step = {k: (b.mean_tokens_per_step if b.n_steps else None) for k, b in cache.compare_runs.items()}
    summary = views.compare_summary(comparison, ar, ts, per_step.get("Vanilla"), per_step.get("TokenSwift"))
    if cache.due("cmp-summary", summary, now):
        up.summary_html = summary
    for label, run, line_attr, text_attr in (("Vanilla", ar, "ar_line", "ar_text"),
                                             ("TokenSwift", ts, "ts_line", "ts_text")):
        position = storage.queue_position(db, run.id) if run is not None and run.status == "queued" else None
        line = views.compare_run_line(f"{label} decoding" if label == "Vanilla" else label, run, position)
        if cache.due(line_attr, line, now):
            setattr(up, line_attr, line)
        if cache.due(text_attr, (run.id, len(run.text), run.status) if run is not None else None, now):
            setattr(up, text_attr, run.text if run is not None else "")
    return up


# -- History ---------------------------------------------------------------------------------------------------------

def speedups_for(db: storage.Database, runs: list[Any]) -> dict[int, float]:
    """Speedup of each TokenSwift run that belongs to a comparison (keyed by run id)."""
    by_id = {r.id: r for r in runs}
    out: dict[int, float] = {}
    for r in runs:
        if r.method != "tokenswift" or r.comparison_id is None or r.status != "done":
            continue
        try:
            comparison = storage.get_comparison(db, r.comparison_id)
            ar = by_id.get(comparison.ar_run_id) or (storage.get_run(db, comparison.ar_run_id)
                                                     if comparison.ar_run_id else None)
        except storage.NotFoundError:
            continue
        x = views.speedup(ar, r)
        if x:
            out[r.id] = x
    return out
