"""The UI's handlers and live polling without a browser or a model: a fake worker writes progress through storage
the way app/worker.py does, and the tests check what each session's page would be sent."""
from __future__ import annotations

import time
from datetime import datetime, timedelta
from types import SimpleNamespace

import gradio as gr
import pytest

import storage
from app import jobs, live, views
from app.handling import guarded
from app.live import LIVE_TAIL_CHARS, LiveCache, View
from app.ui import Handlers, StudioContext, build_ui

MODEL = "tiny"


@pytest.fixture
def h(db):
    handlers = Handlers(StudioContext(db=db, model=MODEL))
    with gr.Blocks():  # the settings panels need a Blocks context to be created in
        from app import settings_panel

        handlers.write_panel = settings_panel.build("write")
        handlers.compare_panel = settings_panel.build("compare", include_method=False)
    return handlers


def new_project(h: Handlers, view: View, title: str = "Novel", premise: str = "A premise.") -> int:
    h.create_project(view, title, "novel", premise)
    return view.project_id


def generate(h: Handlers, view: View, mode: str = "generate", **settings) -> str:
    return h.queue_run(mode, view, view.project_id, view.chapter_id, None, None, None,
                       **{"max_new_tokens": 64, **settings})


class FakeWorker:
    """Claims runs and appends output the way app/worker.py does (no model)."""

    def __init__(self, db):
        self.db = db

    def claim(self):
        return storage.claim_next_run(self.db, "fake-worker")

    def write(self, run_id: int, text: str, first_step: int, n_steps: int, tokens_per_step: int = 2) -> None:
        steps = [{"step": first_step + i, "new_tokens": tokens_per_step, "accepted": tokens_per_step - 1,
                  "from_ngram": 1 if i % 2 else 0, "step_ms": 10.0,
                  "tokens_so_far": (first_step + i + 1) * tokens_per_step, "repetition": 0.1}
                 for i in range(n_steps)]
        ids = list(range(n_steps * tokens_per_step))
        storage.append_output(self.db, run_id, text, ids, steps, tokens_per_s=200.0, mean_accepted=2.0)


def test_blocks_build_with_named_api():
    with storage.open_database(":memory:") as db:
        demo = build_ui(StudioContext(db=db, model=MODEL))
        names = set(demo.get_api_info()["named_endpoints"])
    for name in ("load", "refresh", "refresh_compare", "create_project", "open_project", "save_project",
                 "delete_project", "open_chapter", "add_chapter", "move_chapter_up", "move_chapter_down",
                 "delete_chapter", "save_chapter", "generate", "continue", "regenerate", "resume", "stop", "compare",
                 "open_comparison", "history", "run_details", "export"):
        assert f"/{name}" in names, name


def test_the_page_load_handler_is_the_only_page_load_event():
    """A session's View is set by nothing but the handlers' own mutations: no page-load event of Gradio's replaces
    it (one races the page-load handler, which then gives its writer to a View the session no longer holds), and
    each session gets its own copy."""
    with storage.open_database(":memory:") as db:
        demo = build_ui(StudioContext(db=db, model=MODEL))
    loads = [fn.api_name for fn in demo.fns.values() if any(t[1] == "load" for t in fn.targets)]
    assert loads == ["load"]
    from gradio.state_holder import SessionState
    states = [b for b in demo.blocks.values() if isinstance(b, gr.State)]
    first, second = SessionState(demo), SessionState(demo)
    for state in states:
        assert first[state._id] is first[state._id]
        assert first[state._id] is not second[state._id]
    views = [first[s._id] for s in states if isinstance(first[s._id], View)]
    assert len(views) == 1 and views[0] == View()


def test_the_tab_polls_run_only_while_their_tab_is_open():
    """Every poll is a round trip the page's scripts handle, beside the model on a small machine: the Compare and
    Story bible tabs' polls have their own timers, off until that tab is selected, on while it is, off again when
    another tab is."""
    with storage.open_database(":memory:") as db:
        demo = build_ui(StudioContext(db=db, model=MODEL))
    fns = list(demo.fns.values())
    timer_of = {fn.api_name: demo.blocks[fn.targets[0][0]] for fn in fns
                if fn.api_name in ("refresh", "refresh_compare", "refresh_outline")}
    write_timer, compare_timer, bible_timer = (timer_of[k] for k in ("refresh", "refresh_compare", "refresh_outline"))
    assert all(isinstance(t, gr.Timer) for t in (compare_timer, bible_timer))
    assert len({id(write_timer), id(compare_timer), id(bible_timer)}) == 3
    assert write_timer.active and not compare_timer.active and not bible_timer.active
    tabs = {block.label: block for block in demo.blocks.values() if isinstance(block, gr.Tab)}
    switches = {}
    for fn in fns:
        if fn.targets[0][1] == "select" and compare_timer in fn.outputs:
            states = dict(zip((id(b) for b in fn.outputs), (t.active for t in fn.fn())))
            switches[demo.blocks[fn.targets[0][0]].label] = (states[id(compare_timer)], states[id(bible_timer)])
    assert switches == {"Write": (False, False), "Story bible": (False, True), "Compare": (True, False),
                        "History & export": (False, False)}
    assert set(switches) == set(tabs)


def test_create_generate_and_watch_progress(h, db):
    view, cache = View(), LiveCache()
    new_project(h, view)
    assert view.chapter_id is not None  # a first chapter comes with the project

    up = live.poll_write(db, view, cache)
    assert up.chapters is not None and up.chapters[0][0] == "1. Chapter 1"
    assert "Not written yet" in up.status_html
    assert up.controls == {"can_write": True, "active": False, "resumable": False, "run_id": None}

    status = generate(h, view, method="ar", seed=3)
    assert "queued" in status and "position 1" in status
    run = storage.latest_run_for_chapter(db, view.chapter_id)
    assert run.settings["method"] == "ar" and run.settings["seed"] == 3 and run.model == MODEL
    assert storage.get_project(db, view.project_id).settings["seed"] == 3  # remembered as project defaults

    up = live.poll_write(db, view, cache)
    assert "queued" in up.status_html and up.controls["active"] and not up.controls["can_write"]

    worker = FakeWorker(db)
    worker.claim()
    worker.write(run.id, "Once upon a time", 0, 10)
    up = live.poll_write(db, view, cache)
    assert up.text == ("Once upon a time", False)  # live: read-only
    assert "running" in up.status_html and "20</span> tokens" in up.status_html
    assert up.figures is not None and len(up.figures[0].data[0].x) == 10
    assert 'num">4</span> words' in up.counts_html

    # Nothing changed: nothing is sent (once the changes are older than the resend window).
    assert live.poll_write(db, view, cache, now=time.monotonic() + live.RESEND_S) == live.WriteUpdate()

    worker.write(run.id, ", there was a keeper.", 10, 5)
    up = live.poll_write(db, view, cache, now=time.monotonic() + live.CHARTS_EVERY_S)
    assert up.text[0] == "Once upon a time, there was a keeper."
    assert cache.buckets.n_steps == 15 and len(up.figures[0].data[0].x) == 15

    storage.finish_run(db, run.id, "done", decode_s=0.5)
    up = live.poll_write(db, view, cache)
    assert up.text == ("Once upon a time, there was a keeper.", True)  # editable again
    assert "done" in up.status_html and up.controls["can_write"]


def test_a_running_runs_charts_are_redrawn_every_few_seconds(h, db):
    """The text moves on every poll; a running run's charts at most every CHARTS_EVERY_S (three Plotly redraws a
    second kept a browser on the same machine busy), at once when its first steps arrive or its status changes; a
    resend repeats the figures last built."""
    view, cache = View(), LiveCache()
    new_project(h, view)
    generate(h, view)
    worker = FakeWorker(db)
    run = worker.claim()
    assert live.poll_write(db, view, cache, now=0.0).figures is not None  # running, no steps yet
    worker.write(run.id, "Once", 0, 10)
    first = live.poll_write(db, view, cache, now=0.5)  # the first steps: drawn at once
    assert len(first.figures[0].data[0].x) == 10
    worker.write(run.id, " upon", 10, 5)
    up = live.poll_write(db, view, cache, now=1.0)
    assert up.text == ("Once upon", False) and up.figures is first.figures  # resent as built
    up = live.poll_write(db, view, cache, now=1.0 + live.RESEND_S)
    assert up == live.WriteUpdate()  # 15 steps stored, the 10-step charts kept until their next redraw
    up = live.poll_write(db, view, cache, now=0.5 + live.CHARTS_EVERY_S)
    assert len(up.figures[0].data[0].x) == 15 and up.text is None
    worker.write(run.id, " a time", 15, 5)
    storage.finish_run(db, run.id, "done", decode_s=0.5)
    up = live.poll_write(db, view, cache, now=1.0 + live.CHARTS_EVERY_S)  # ended: drawn at once, whole
    assert len(up.figures[0].data[0].x) == 20 and "done" in up.status_html


def show(page: dict, up: live.WriteUpdate) -> None:
    """Apply a poll's update to a page modelled as {part: what it shows}, as the browser does."""
    page.update({k: v for k, v in vars(up).items() if v is not None})


def test_a_late_response_cannot_leave_a_stale_part_on_the_page(h, db):
    """A timer tick computed before Stop can reach the page after the follow-up refresh that showed the run
    cancelled (two events, one session, side by side). The next tick sends the changed parts again, so the page
    ends showing the truth, and once nothing changes nothing is sent."""
    view, cache, page = View(), LiveCache(), {}
    new_project(h, view)
    generate(h, view)
    worker = FakeWorker(db)
    run = worker.claim()
    worker.write(run.id, "Once upon a time", 0, 10)
    show(page, live.poll_write(db, view, cache, now=0.0))
    worker.write(run.id, ", there was", 10, 5)
    tick = live.poll_write(db, view, cache, now=10.0)  # computed while running; its response is late
    h.stop(view)
    storage.finish_run(db, run.id, "cancelled")
    show(page, live.poll_write(db, view, cache, now=10.1))  # Stop's follow-up refresh arrives first
    show(page, tick)
    assert "running" in page["status_html"] and page["text"] == ("Once upon a time, there was", False)

    show(page, live.poll_write(db, view, cache, now=11.0))  # the next tick
    assert "cancelled" in page["status_html"] and "running" not in page["status_html"]
    assert page["text"] == ("Once upon a time, there was", True) and page["controls"]["can_write"]
    assert live.poll_write(db, view, cache, now=11.0 + live.RESEND_S) == live.WriteUpdate()


def test_a_saved_text_is_not_resent_over_the_writers_typing(h, db):
    """The resend window never sends an editable chapter again after a save: the writer may be typing in it. It
    does after switching chapters, where an older response could have left the other chapter's text."""
    view, cache = View(), LiveCache()
    project_id = new_project(h, view)
    first = view.chapter_id
    assert live.poll_write(db, view, cache, now=0.0).text == ("", True)
    h.save_chapter(view, cache, project_id, first, None, None, None, "Hand-written text.")
    assert live.poll_write(db, view, cache, now=100.0).text == ("Hand-written text.", True)
    assert live.poll_write(db, view, cache, now=100.5).text is None

    h.add_chapter(view)
    assert live.poll_write(db, view, cache, now=200.0).text == ("", True)
    assert live.poll_write(db, view, cache, now=200.5).text == ("", True)  # resent: another chapter
    assert live.poll_write(db, view, cache, now=200.0 + live.RESEND_S).text is None


def test_stop_queued_and_running(h, db):
    view = View()
    new_project(h, view)
    generate(h, view)
    h.stop(view)
    assert storage.latest_run_for_chapter(db, view.chapter_id).status == "cancelled"
    generate(h, view, mode="regenerate")
    run = FakeWorker(db).claim()
    h.stop(view)
    assert storage.is_cancel_requested(db, run.id)


def test_interrupted_run_offers_resume(h, db):
    view, cache = View(), LiveCache()
    new_project(h, view)
    generate(h, view)
    worker = FakeWorker(db)
    run = worker.claim()
    worker.write(run.id, "Half a story", 0, 3)
    storage.mark_interrupted(db, "fake-worker")
    up = live.poll_write(db, view, cache)
    assert up.controls["resumable"] and "interrupted" in up.status_html and "Resume" in up.status_html
    with pytest.raises(gr.Error, match="no saved prompt"):
        generate(h, view, mode="resume")


def test_long_text_shows_a_read_only_tail_while_running(h, db):
    view, cache = View(), LiveCache()
    new_project(h, view)
    generate(h, view)
    worker = FakeWorker(db)
    run = worker.claim()
    long_text = "word " * (LIVE_TAIL_CHARS // 4)
    worker.write(run.id, long_text, 0, 2)
    up = live.poll_write(db, view, cache)
    shown, editable = up.text
    assert not editable and shown.startswith("…") and len(shown) == LIVE_TAIL_CHARS + 1
    assert "showing the last" in up.counts_html
    # A textbox holding only the tail must never replace the chapter.
    with pytest.raises(gr.Error, match="being written"):
        h.save_chapter(view, cache, view.project_id, view.chapter_id, None, None, None, shown)
    storage.finish_run(db, run.id, "done")
    up = live.poll_write(db, view, cache)
    assert up.text == (long_text, True) and cache.text_full


def test_manual_edit_and_chapter_management(h, db):
    view, cache = View(), LiveCache()
    project_id = new_project(h, view)
    first = view.chapter_id
    live.poll_write(db, view, cache)
    h.save_chapter(view, cache, project_id, first, "New premise", "Opening", "Be brief.", "Hand-written text.")
    chapter = storage.get_chapter(db, first)
    assert (chapter.title, chapter.instructions, chapter.text) == ("Opening", "Be brief.", "Hand-written text.")
    assert storage.get_project(db, project_id).premise == "New premise"

    h.add_chapter(view)
    second = view.chapter_id
    assert second != first
    h.move_chapter(view, delta=-1)
    assert [c.id for c in storage.list_chapters(db, project_id)] == [second, first]
    # The page numbers its picks: one overtaken on its way by a newer one is not opened after it.
    h.open_chapter(view, second, "2")
    h.open_chapter(view, first, "1")
    assert view.chapter_id == second
    h.open_chapter(view, first, "3")
    assert view.chapter_id == first
    h.delete_chapter(view)
    assert [c.id for c in storage.list_chapters(db, project_id)] == [second] and view.chapter_id == second

    h.save_project(view, project_id, "Renamed", "report")
    project = storage.get_project(db, project_id)
    assert (project.title, project.kind) == ("Renamed", "report")
    h.delete_project(view)
    assert view.project_id is None and storage.list_projects(db) == []


def test_sessions_never_touch_each_others_projects(h, db):
    a, b = View(), View()
    pa = new_project(h, a, "Alpha", "Alpha premise")
    pb = new_project(h, b, "Beta", "Beta premise")
    # b cannot open a's chapter, and stale owner ids (the page showed another project) are refused.
    with pytest.raises(gr.Error, match="another project"):
        h.open_chapter(b, a.chapter_id)
    with pytest.raises(gr.Error, match="switched project"):
        h.queue_run("generate", a, pb, None, "leaked", None, None)
    h.autosave(a, pb, b.chapter_id, "leaked", "x", "y")  # silently ignored
    assert storage.get_project(db, pa).premise == "Alpha premise"
    assert storage.get_project(db, pb).premise == "Beta premise"
    # A chapter opened in a, then its project switched away in the same session: no cross-project writes.
    a.chapter_id = b.chapter_id
    with pytest.raises(gr.Error, match="another project"):
        generate(h, a)


def test_errors_become_readable_escaped_messages(h, db):
    view = View()
    with pytest.raises(gr.Error) as e:
        h.create_project(view, "  ", "novel", "")
    assert "cannot be empty" in e.value.message
    with pytest.raises(gr.Error, match="Open or create a project first"):
        h.add_chapter(view)
    with pytest.raises(gr.Error) as e:
        h.create_project(view, "x", "<script>", "")
    assert "<script>" not in e.value.message and "&lt;script&gt;" in e.value.message

    @guarded
    def boom():
        raise RuntimeError("disk <full>")

    with pytest.raises(gr.Error) as e:
        boom()
    assert "Something went wrong" in e.value.message and "&lt;full&gt;" in e.value.message
    new_project(h, view)
    with pytest.raises(gr.Error, match="Temperature must be between"):
        generate(h, view, temperature=9.0)


def test_compare_flow_and_history(h, db):
    view, cache = View(), LiveCache()
    h.start_comparison(view, "A prompt", max_new_tokens=16, seed=5)
    comparison = storage.get_comparison(db, view.compare_id)
    up = live.poll_compare(db, view.compare_id, cache)
    assert "Vanilla" in up.summary_html and "queued" in up.ar_line and up.active
    worker = FakeWorker(db)
    for run_id, per_step in ((comparison.ar_run_id, 1), (comparison.tokenswift_run_id, 2)):
        run = worker.claim()
        assert run.id == run_id  # vanilla first, then TokenSwift
        worker.write(run.id, "Same text.", 0, 8 // per_step, tokens_per_step=per_step)  # the same 8 token ids
        storage.finish_run(db, run.id, "done", decode_s=1.0 / per_step)
    up = live.poll_compare(db, view.compare_id, cache)
    assert up.ar_text == up.ts_text == "Same text."
    assert "✓ yes" in up.summary_html and "×" in up.summary_html and up.listing_changed and not up.active
    assert up.figures is not None and [t.name for t in up.figures[1].data] == ["Vanilla", "TokenSwift"]

    table, picker = h.history(view, True)
    rows = table["value"]
    assert [r[4] for r in rows] == ["TokenSwift", "Vanilla"] and rows[0][8].endswith("×")
    assert picker["value"] == comparison.tokenswift_run_id
    summary, metrics, *figures = h.run_details(view, comparison.tokenswift_run_id)
    assert metrics["steps"] == 4 and metrics["speedup"] == pytest.approx(2.0) and "TokenSwift" in summary
    assert metrics["tokens_per_step"] == pytest.approx(2.0)
    assert len(figures) == 3


def test_the_gap_where_a_comparisons_runs_differ_reaches_the_open_compare_tab(h, db):
    """The worker stores the gap just after the verdict: the next poll shows it in the tile and the table."""
    view, cache = View(), LiveCache()
    h.start_comparison(view, "A prompt", max_new_tokens=16, seed=5)
    live.poll_compare(db, view.compare_id, cache)
    worker = FakeWorker(db)
    for n_steps in (8, 3):  # vanilla writes ids 0..7, TokenSwift 0..5: they part at token 6
        run = worker.claim()
        worker.write(run.id, "Text.", 0, n_steps, tokens_per_step=1 if n_steps == 8 else 2)
        storage.finish_run(db, run.id, "done", decode_s=1.0)
    up = live.poll_compare(db, view.compare_id, cache)
    assert "first differ at token 6</div>" in up.summary_html and up.listing_changed
    storage.set_comparison_divergence(db, view.compare_id, {
        "position": 6, "vanilla_token": 6, "tokenswift_token": None, "top1": 6, "top2": 40, "gap": 3.14e-06,
        "logit_gap": 0.5})
    up = live.poll_compare(db, view.compare_id, cache)
    assert "first differ at token 6 · top-2 gap 3.1e-06</div>" in up.summary_html and up.listing_changed
    assert h.comparisons_table(view)["value"][0][-1] == "no (token 6, gap 3.1e-06)"
    one = SimpleNamespace(tokens_match=False, first_divergence=2, divergence={"position": 2, "gap": None})
    assert "first differ at token 2 · top-2 gap ∞</div>" in views.compare_summary(one, None, None)


def test_views_escape_user_and_model_text():
    run = storage.Run(id=1, mode="generate", method="tokenswift", model="m", status="failed", n_tokens=3,
                      error="<img src=x onerror=alert(1)>", settings={"x": "<b>"})
    html = views.run_status(run)
    assert "<img" not in html and "&lt;img" in html
    assert "<b>" not in views.run_summary(run)
    state = storage.WorkerState(worker_id="w", state="failed", message="<script>bad</script>", model="m")
    assert "<script>" not in views.worker_badge([state])
    assert "No worker" in views.worker_badge([])


def backdate_worker(db, worker_id: str, seconds: float) -> None:
    """Make a worker's state row look ``seconds`` old (as if the worker had been killed then)."""
    import sqlalchemy as sa

    from storage.models import utcnow

    with db.engine.begin() as conn:
        conn.execute(sa.text("UPDATE worker_states SET updated_at = :t WHERE worker_id = :w"),
                     {"t": utcnow() - timedelta(seconds=seconds), "w": worker_id})


def test_a_killed_worker_shows_as_not_responding(h, db):
    """A worker killed with SIGKILL leaves its row "ready"; once the row is a minute old the header says the worker
    is not responding (and when it was last seen), and queued runs say they wait for a worker."""
    view, cache = View(), LiveCache()
    new_project(h, view)
    generate(h, view)
    storage.set_worker_state(db, "dead", "ready", "Generating run 1.", model="/models/tiny-llama")
    up = live.poll_write(db, view, cache)
    assert "Worker ready" in up.worker_html and "waiting for the worker" not in up.status_html

    backdate_worker(db, "dead", 30)  # a beat missed or two: still fine
    assert "Worker ready" in live.worker_html(db)[0]

    backdate_worker(db, "dead", 5 * 60 + 10)
    up = live.poll_write(db, view, cache)
    assert "not responding" in up.worker_html and "last seen 5 min ago" in up.worker_html
    assert "tiny-llama" in up.worker_html and "Worker ready" not in up.worker_html
    assert "badge-failed" in up.worker_html
    assert "waiting for the worker" in up.status_html
    later = time.monotonic() + live.RESEND_S
    assert live.poll_write(db, view, cache, now=later).worker_html is None  # the same minute: nothing resent

    # Another worker that is alive: it is the one shown; the dead one's row is ignored.
    storage.set_worker_state(db, "alive", "ready", "Idle.", model="tiny")
    header, ready = live.worker_html(db)
    assert ready and "Worker ready" in header and "not responding" not in header and "(2 workers)" not in header
    # ZeroGPU's in-request worker is idle between requests without refreshing its row: never "not responding".
    storage.set_worker_state(db, "alive", "stopped", "Stopped.")
    assert "not responding" in live.worker_html(db)[0]
    header, ready = live.worker_html(db, zerogpu=True)
    assert ready and "not responding" not in header


def test_worker_badge_staleness_rules():
    now = datetime(2025, 1, 1, 12, 0, 0)

    def state(name: str, age_s: float | None, **kw):
        updated = None if age_s is None else now - timedelta(seconds=age_s)
        return storage.WorkerState(worker_id=kw.pop("wid", "w"), state=name, message=kw.pop("message", ""),
                                   model=kw.pop("model", None), updated_at=updated)

    assert "Worker ready" in views.worker_badge([state("ready", 59)], now=now)
    assert "Loading model" in views.worker_badge([state("loading model", 30)], now=now)
    stale = views.worker_badge([state("loading model", 3 * 3600)], now=now)
    assert "Worker not responding" in stale and "last seen 3 h ago" in stale
    # Last words never go stale: a failed worker keeps its reason, a stopped one says it stopped.
    failed = views.worker_badge([state("failed", 86400, message="Could not load model x")], now=now)
    assert "Worker failed" in failed and "Could not load model x" in failed
    assert "Worker stopped" in views.worker_badge([state("stopped", 86400)], now=now)
    assert "Worker ready" in views.worker_badge([state("ready", None)], now=now)  # no timestamp: not judged
    assert "Worker ready" in views.worker_badge([state("ready", -5)], now=now)  # clock skew: not stale
    assert views.ago(61) == "1 min ago" and views.ago(59 * 60) == "59 min ago" and views.ago(3 * 86400) == "3 days ago"
    assert "&lt;x&gt;" in views.worker_badge([state("ready", 600, model="<x>")], now=now)


def test_jobs_limits_drive_the_settings_panel(h):
    panel = h.write_panel
    assert panel.names[0] == "method" and set(panel.names) == set(jobs.DEFAULT_SETTINGS)
    by_name = panel.by_name()
    assert by_name["max_new_tokens"].maximum == jobs.LIMITS["max_new_tokens"][1]
    assert by_name["temperature"].value == jobs.DEFAULT_SETTINGS["temperature"]
    assert "method" not in h.compare_panel.names


def test_a_long_run_is_read_incrementally_and_stays_small(h, db):
    """20K steps: each poll reads only the new rows, and the charts stay at most MAX_POINTS points."""
    import time

    from app.charts import MAX_POINTS

    view, cache = View(), LiveCache()
    new_project(h, view)
    generate(h, view)
    worker = FakeWorker(db)
    run = worker.claim()
    polls = []
    for batch in range(20):
        worker.write(run.id, "word " * 200, batch * 1000, 1000)
        t0 = time.perf_counter()
        up = live.poll_write(db, view, cache, now=batch * live.CHARTS_EVERY_S)  # each poll redraws the charts
        polls.append(time.perf_counter() - t0)
        assert up.figures is not None
    assert cache.buckets.n_steps == 20_000 and cache.buckets.last_step == 19_999
    assert all(len(t.x) <= MAX_POINTS for fig in up.figures for t in fig.data)
    assert max(polls) < 2.0, polls  # bounded by the new rows, not the run's length
    assert sum(len(f.to_json()) for f in up.figures) < 200_000


def test_a_word_goal_shows_progress_in_the_sidebar(h, db):
    view = View()
    new_project(h, view)
    out = h.save_project(view, view.project_id, "Novel", "novel", 10.0)  # a Number hands over floats
    assert out[5]["value"] == 10 and storage.get_project(db, view.project_id).goal_words == 10
    storage.set_chapter_text(db, view.chapter_id, "one two three four")
    up = live.poll_write(db, view, LiveCache())
    assert "4 / 10 words (40%)" in up.goal_html and "width:40.0%" in up.goal_html
    storage.set_chapter_text(db, h.add_chapter(view) and view.chapter_id, " ".join(["w"] * 8))
    up = live.poll_write(db, view, LiveCache())
    assert "12 / 10 words (100%) · reached ✓" in up.goal_html
    h.save_project(view, view.project_id, "Novel", "novel", 0)
    assert live.poll_write(db, view, LiveCache()).goal_html == ""
    with pytest.raises(gr.Error, match="word goal"):
        h.save_project(view, view.project_id, "Novel", "novel", -5)
