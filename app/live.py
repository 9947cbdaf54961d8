"""Live progress: what changed in the database since a browser session last looked.

The page polls about once a second. Each session keeps a ``LiveCache`` (in ``gr.State``) with what it last showed;
``poll_write`` / ``poll_compare`` read the database and return only the parts that changed (None = unchanged), so an
idle page sends almost nothing, and a long run is read incrementally: step rows with ``after_step`` into bounded
``StepBuckets``, the chapter text only when its row changed. Everything shown comes from the database, so a reload,
a second tab or a server restart shows the same text and progress.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go

import storage
from app import jobs, views
from app.charts import StepBuckets, all_figures

# While a run writes, the textbox shows at most this much of the chapter's end: resending and re-laying out a
# 400 KB textarea every second would make the page sluggish. The whole text is shown (and editable) once it stops.
LIVE_TAIL_CHARS = 50_000


@dataclass
class View:
    """What one browser session has open (its gr.State). Ids only: everything else is read from the database."""

    project_id: int | None = None
    chapter_id: int | None = None
    compare_id: int | None = None
    loaded: bool = False  # set by the page-load handler; False in a session the server does not know (restart)


@dataclass
class LiveCache:
    """What one session's page currently shows, to send only changes. Owned by the poll handlers."""

    worker_key: str | None = None
    chapters_key: tuple | None = None
    chapter_id: int | None = None
    text_key: tuple | None = None
    text_full: bool = False  # the textbox holds the whole chapter (not a live tail)
    run_id: int | None = None
    buckets: StepBuckets | None = None
    charts_key: tuple | None = None
    status_key: str | None = None
    counts_key: tuple | None = None
    controls_key: tuple | None = None
    # Compare
    compare_id: int | None = None
    compare_runs: dict[str, StepBuckets] = field(default_factory=dict)
    compare_keys: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __deepcopy__(self, memo: dict) -> "LiveCache":
        # gr.State deep-copies its initial value per session; a lock cannot be copied, and the initial cache is
        # always empty anyway.
        return LiveCache()


@dataclass
class WriteUpdate:
    """Changes for the Write tab; None = leave as it is."""

    worker_html: str | None = None
    chapters: tuple[list[tuple[str, int]], int | None] | None = None  # (choices, selected)
    status_html: str | None = None
    text: tuple[str, bool] | None = None  # (value, editable)
    counts_html: str | None = None
    figures: tuple[go.Figure, go.Figure, go.Figure] | None = None
    controls: dict[str, Any] | None = None  # can_write, active, resumable, run_id


def worker_html(db: storage.Database, zerogpu: bool = False) -> tuple[str, bool]:
    """(header HTML, whether some worker is ready). A "ready" row not refreshed for a minute is a dead worker's
    (killed without a chance to say so): it counts as not ready, and the header says it is not responding."""
    states = storage.get_worker_states(db)
    now = views.utcnow()
    ready = any(s.state == "ready" for s in views.responsive_workers(states, now, zerogpu))
    return views.worker_badge(states, zerogpu, now=now), zerogpu or ready


def _refresh_buckets(db: storage.Database, cache_buckets: StepBuckets | None, run_id: int) -> tuple[StepBuckets, int]:
    buckets = cache_buckets or StepBuckets()
    added = buckets.extend(storage.get_steps(db, run_id, after_step=buckets.last_step))
    return buckets, added


def poll_write(db: storage.Database, view: View, cache: LiveCache, *, zerogpu: bool = False) -> WriteUpdate:
    """Read the open chapter's state and return what changed since ``cache`` (which is updated)."""
    with cache.lock:  # a timer tick and an action's follow-up refresh may overlap for one session
        return _poll_write(db, view, cache, zerogpu)


def _poll_write(db: storage.Database, view: View, cache: LiveCache, zerogpu: bool) -> WriteUpdate:
    up = WriteUpdate()
    header, ready = worker_html(db, zerogpu)
    if header != cache.worker_key:
        up.worker_html = cache.worker_key = header

    chapters = storage.list_chapters(db, view.project_id) if view.project_id is not None else []
    chapter = next((c for c in chapters if c.id == view.chapter_id), None)
    ckey = tuple((c.id, c.title, c.status) for c in chapters) + (view.chapter_id,)
    if ckey != cache.chapters_key:
        cache.chapters_key = ckey
        up.chapters = ([(views.chapter_label(i, c), c.id) for i, c in enumerate(chapters)],
                       chapter.id if chapter else None)

    if chapter is None:
        run = None
    else:
        run = storage.latest_run_for_chapter(db, chapter.id)
    active = run is not None and run.status in views.ACTIVE

    # -- text (only when the chapter row changed) --
    if chapter is None:
        tkey: tuple = (None, view.project_id, view.chapter_id)
        if tkey != cache.text_key:
            cache.text_key, cache.text_full, cache.chapter_id = tkey, False, None
            message = "" if view.project_id is None else "This chapter no longer exists; pick another one."
            up.text = ("" if view.chapter_id is None else message, False)
            up.counts_html = views.counts_line(0, None, None)
            cache.counts_key = None
    else:
        tkey = (chapter.id, chapter.updated_at, chapter.word_count, chapter.status, active)
        if tkey != cache.text_key or cache.chapter_id != chapter.id:
            text = storage.get_chapter(db, chapter.id).text
            tail = active and len(text) > LIVE_TAIL_CHARS
            shown = "…" + text[-LIVE_TAIL_CHARS:] if tail else text
            up.text = (shown, not active)
            cache.text_key, cache.text_full, cache.chapter_id = tkey, not tail, chapter.id
            counts = (chapter.word_count, len(text), run.n_tokens if run else None, tail)
            if counts != cache.counts_key:
                cache.counts_key = counts
                up.counts_html = views.counts_line(chapter.word_count, len(text), run.n_tokens if run else None,
                                                   LIVE_TAIL_CHARS if tail else None)

    # -- charts (incremental) --
    run_id = run.id if run else None
    if run_id != cache.run_id:
        cache.run_id, cache.buckets, cache.charts_key = run_id, None, None
    added = 0
    if run is not None:
        cache.buckets, added = _refresh_buckets(db, cache.buckets, run.id)
    chart_key = (run_id, run.status if run else None, cache.buckets.n_steps if cache.buckets else 0)
    if chart_key != cache.charts_key:
        cache.charts_key = chart_key
        empty = ("No run yet" if run is None else
                 "Queued: waiting for the worker" if run.status == "queued" else "No steps recorded")
        up.figures = all_figures(cache.buckets, empty=empty)

    # -- status line --
    b = cache.buckets
    position = storage.queue_position(db, run.id) if run is not None and run.status == "queued" else None
    status = views.run_status(run, position=position,
                              tokens_per_s=(run.tokens_per_s or (b.last_tokens_per_s if b else None)) if run else None,
                              tokens_per_step=b.mean_tokens_per_step if b and b.n_steps else None,
                              worker_ready=ready)
    if status != cache.status_key:
        up.status_html = cache.status_key = status

    # -- buttons --
    controls = {"can_write": chapter is not None and not active, "active": active,
                "resumable": run is not None and run.status in jobs.RESUMABLE and run.n_tokens > 0, "run_id": run_id}
    ctl_key = tuple(controls.items())
    if ctl_key != cache.controls_key:
        cache.controls_key = ctl_key
        up.controls = controls
    return up


# -- Compare --------------------------------------------------------------------------------------------------------

@dataclass
class CompareUpdate:
    summary_html: str | None = None
    ar_line: str | None = None
    ts_line: str | None = None
    ar_text: str | None = None
    ts_text: str | None = None
    figures: tuple[go.Figure, go.Figure, go.Figure] | None = None
    active: bool = False
    listing_changed: bool = False  # a run's status or the verdict changed: the past-comparisons table is stale


def poll_compare(db: storage.Database, compare_id: int | None, cache: LiveCache) -> CompareUpdate:
    """Read a comparison's two runs and return what changed since ``cache``."""
    with cache.lock:
        return _poll_compare(db, compare_id, cache)


def _poll_compare(db: storage.Database, compare_id: int | None, cache: LiveCache) -> CompareUpdate:
    up = CompareUpdate()
    if compare_id != cache.compare_id:
        cache.compare_id, cache.compare_runs, cache.compare_keys = compare_id, {}, {}
    keys = cache.compare_keys
    if compare_id is None:
        if keys.get("summary") != "none":
            keys["summary"] = "none"
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
    lkey = (tuple(r.status if r else None for r in runs.values()), comparison.tokens_match if comparison else None)
    if lkey != keys.get("listing"):
        up.listing_changed = "listing" in keys  # not on first sight: the table was filled when the page loaded
        keys["listing"] = lkey

    n_steps = []
    for label, run in runs.items():
        if run is None:
            continue
        buckets, _ = _refresh_buckets(db, cache.compare_runs.get(label), run.id)
        cache.compare_runs[label] = buckets
        n_steps.append((label, run.status, buckets.n_steps))
    fkey = tuple(n_steps)
    if fkey != keys.get("figures"):
        keys["figures"] = fkey
        up.figures = all_figures({k: v for k, v in cache.compare_runs.items()}, empty="Waiting for the first steps")

    per_step = {k: (b.mean_tokens_per_step if b.n_steps else None) for k, b in cache.compare_runs.items()}
    summary = views.compare_summary(comparison, ar, ts, per_step.get("Vanilla"), per_step.get("TokenSwift"))
    if summary != keys.get("summary"):
        keys["summary"] = up.summary_html = summary
    for label, run, line_attr, text_attr in (("Vanilla", ar, "ar_line", "ar_text"),
                                             ("TokenSwift", ts, "ts_line", "ts_text")):
        position = storage.queue_position(db, run.id) if run is not None and run.status == "queued" else None
        line = views.compare_run_line(f"{label} decoding" if label == "Vanilla" else label, run, position)
        if line != keys.get(line_attr):
            keys[line_attr] = line
            setattr(up, line_attr, line)
        tkey = (run.id, len(run.text), run.status) if run is not None else None
        if tkey != keys.get(text_attr):
            keys[text_attr] = tkey
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
