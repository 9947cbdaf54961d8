"""storage.queries on a real SQLite file and a real PostgreSQL server: projects, chapters, the run queue, comparisons,
corrupt rows."""

import logging
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

import storage as st
from storage.models import utcnow


@pytest.fixture
def db(any_db):
    """Every test here runs on SQLite and on a real PostgreSQL server."""
    return any_db


@pytest.fixture
def chapter(db):
    project = st.create_project(db, "Novel", premise="A lighthouse keeper.")
    return st.add_chapter(db, project.id, "Storm")


def step(i, **kw):
    return {"step": i, "new_tokens": 2, "step_ms": 10.0, "tokens_so_far": 2 * (i + 1), **kw}


def run_sql(db, sql, **params):
    with db.engine.begin() as conn:
        return conn.execute(sa.text(sql), params)


# -- projects -------------------------------------------------------------------------

def test_project_crud(db):
    p = st.create_project(db, "  My novel  ", kind="report", premise="p", settings={"temperature": 0.7})
    assert (p.title, p.kind, p.settings) == ("My novel", "report", {"temperature": 0.7})
    st.rename_project(db, p.id, "Renamed")
    st.update_project(db, p.id, premise="new premise", settings={"top_p": 0.9})
    got = st.get_project(db, p.id)
    assert (got.title, got.premise, got.settings, got.kind) == ("Renamed", "new premise", {"top_p": 0.9}, "report")
    assert got.updated_at >= got.created_at
    assert [x.id for x in st.list_projects(db)] == [p.id]
    with pytest.raises(st.NotFoundError, match="Project 999 does not exist"):
        st.get_project(db, 999)


@pytest.mark.parametrize("kwargs, message", [
    ({"title": "   "}, "title cannot be empty"),
    ({"title": "x" * 201}, "title is too long"),
    ({"title": "ok", "kind": "poem"}, "Unknown project kind 'poem'"),
    ({"title": "ok", "premise": "x" * 20_001}, "premise is too long"),
    ({"title": "ok", "settings": [1, 2]}, "Settings must be a dictionary"),
    ({"title": "ok", "settings": {"t": float("nan")}}, "cannot be stored as JSON"),
])
def test_project_validation(db, kwargs, message):
    with pytest.raises(st.ValidationError, match=message):
        st.create_project(db, **kwargs)
    assert st.list_projects(db) == []


def test_run_validation(db, chapter):
    with pytest.raises(st.ValidationError, match="Unknown mode"):
        st.enqueue_run(db, mode="dream", method="ar", model="m")
    with pytest.raises(st.ValidationError, match="Unknown method"):
        st.enqueue_run(db, mode="generate", method="beam", model="m")
    with pytest.raises(st.NotFoundError, match="Chapter 77"):
        st.enqueue_run(db, mode="generate", method="ar", model="m", chapter_id=77)
    with pytest.raises(st.ValidationError, match="Unknown chapter mode"):
        st.start_chapter_run(db, chapter.id, "compare", method="ar", model="m")
    with pytest.raises(st.ValidationError, match="Unknown step metric field"):
        run = st.enqueue_run(db, mode="generate", method="ar", model="m")
        st.claim_next_run(db, "w")
        st.append_output(db, run.id, "x", [1], [step(0, bogus=1)])
    assert st.get_run(db, run.id).text == ""  # the whole batch was rejected


# -- chapters -------------------------------------------------------------------------

def test_chapter_order_move_delete(db):
    p = st.create_project(db, "Book")
    ids = [st.add_chapter(db, p.id).id for _ in range(4)]
    assert [c.title for c in st.list_chapters(db, p.id)] == ["Chapter 1", "Chapter 2", "Chapter 3", "Chapter 4"]

    def order():
        chapters = st.list_chapters(db, p.id)
        assert [c.position for c in chapters] == list(range(len(chapters)))  # always dense
        return [c.id for c in chapters]

    assert st.move_chapter(db, ids[3], 0).position == 0
    assert order() == [ids[3], ids[0], ids[1], ids[2]]
    st.move_chapter(db, ids[3], 99)  # clamped to the end
    assert order() == ids
    st.move_chapter(db, ids[0], 2)
    assert order() == [ids[1], ids[2], ids[0], ids[3]]
    st.delete_chapter(db, ids[2])
    assert order() == [ids[1], ids[0], ids[3]]
    st.update_chapter(db, ids[1], title="Opening", instructions="Start slow.")
    got = st.get_chapter(db, ids[1])
    assert (got.title, got.instructions) == ("Opening", "Start slow.")
    with pytest.raises(SQLAlchemyError):  # listings do not load the long text
        st.list_chapters(db, p.id)[0].text
    assert st.list_chapters(db, p.id, with_text=True)[0].text == ""


def test_hand_edit_keeps_revision(db, chapter):
    st.set_chapter_text(db, chapter.id, "First draft here.")
    st.set_chapter_text(db, chapter.id, "First draft here.")  # unchanged: no revision
    edited = st.set_chapter_text(db, chapter.id, "Second, better draft now.")
    assert (edited.word_count, edited.status) == (4, "draft")
    revisions = st.list_revisions(db, chapter.id)
    assert [(r.text, r.reason) for r in revisions] == [("First draft here.", "manual edit")]


def test_restoring_a_revision_loses_nothing(db, chapter):
    st.set_chapter_text(db, chapter.id, "One.")
    st.set_chapter_text(db, chapter.id, "Two.")
    first = st.list_revisions(db, chapter.id)[0]
    restored = st.restore_revision(db, first.id)
    assert (restored.text, restored.word_count) == ("One.", 1)
    # The replaced text is a revision now; restoring it undoes the restore. Nothing was deleted.
    revisions = st.list_revisions(db, chapter.id)
    assert [(r.text, r.reason) for r in revisions] == [("Two.", f"before restoring #{first.id}"),
                                                       ("One.", "manual edit")]
    assert st.restore_revision(db, revisions[0].id).text == "Two."
    assert len(st.list_revisions(db, chapter.id)) == 3
    assert st.get_revision(db, first.id).text == "One."
    run = st.start_chapter_run(db, chapter.id, "continue", method="ar", model="m")
    assert st.claim_next_run(db, "w").id == run.id
    with pytest.raises(st.ValidationError, match="being generated"):
        st.restore_revision(db, first.id)
    assert st.get_chapter(db, chapter.id).text == "Two."
    with pytest.raises(st.NotFoundError, match="ChapterRevision 999 does not exist"):
        st.restore_revision(db, 999)


# -- the run queue --------------------------------------------------------------------

def test_queue_claim_append_finish(db, chapter):
    runs = [st.enqueue_run(db, mode="generate", method="tokenswift", model="m", settings={"seed": i})
            for i in range(3)]
    assert [st.queue_position(db, r.id) for r in runs] == [1, 2, 3]

    claimed = st.claim_next_run(db, "w1")
    assert (claimed.id, claimed.status, claimed.worker_id, claimed.settings) == (runs[0].id, "running", "w1", {"seed": 0})
    assert claimed.started_at is not None and st.queue_position(db, claimed.id) is None
    assert [st.queue_position(db, r.id) for r in runs[1:]] == [1, 2]
    assert [r.id for r in st.active_runs(db)] == [r.id for r in runs]  # running first, then the queue

    st.append_output(db, claimed.id, "Hello", [10, 11], [step(0), step(1)], prefill_s=0.5, tokens_per_s=40.0)
    st.append_output(db, claimed.id, " world", [12, 13], [step(2)])
    st.append_output(db, claimed.id)  # heartbeat only
    run = st.get_run(db, claimed.id)
    assert (run.text, run.n_tokens, run.prefill_s, run.tokens_per_s) == ("Hello world", 4, 0.5, 40.0)
    assert st.get_run_token_ids(db, run.id) == [10, 11, 12, 13]
    assert [s.step for s in st.get_steps(db, run.id)] == [0, 1, 2]
    assert [s.step for s in st.get_steps(db, run.id, after_step=1)] == [2]

    done = st.finish_run(db, run.id, "done", prefill_s=0.5, decode_s=2.0)
    assert (done.status, done.tokens_per_s, done.mean_accepted) == ("done", 2.0, 2.0)
    assert done.finished_at >= done.started_at
    assert st.finish_run(db, run.id, "failed").status == "done"  # finished runs are left alone

    assert [st.claim_next_run(db, "w1").id for _ in range(2)] == [r.id for r in runs[1:]]
    assert st.claim_next_run(db, "w1") is None
    assert [r.id for r in st.list_runs(db, limit=2)] == [runs[2].id, runs[1].id]
    with pytest.raises(SQLAlchemyError):  # listings do not load the long text
        st.list_runs(db)[0].text


def test_append_to_non_running_run_is_refused(db):
    run = st.enqueue_run(db, mode="generate", method="ar", model="m")
    with pytest.raises(st.StorageError, match="is queued, not running"):
        st.append_output(db, run.id, "text")
    with pytest.raises(st.NotFoundError):
        st.append_output(db, 12345, "text")


def test_continue_appends_to_chapter(db, chapter):
    st.set_chapter_text(db, chapter.id, "The storm")
    run = st.start_chapter_run(db, chapter.id, "continue", method="ar", model="m")
    assert run.project_id == chapter.project_id
    with pytest.raises(st.ValidationError, match="already has a run"):
        st.start_chapter_run(db, chapter.id, "continue", method="ar", model="m")

    st.claim_next_run(db, "w")
    assert st.get_chapter(db, chapter.id).status == "generating"
    with pytest.raises(st.ValidationError, match="being generated"):
        st.set_chapter_text(db, chapter.id, "hand edit")
    for delta in ["s", " at night", "", " and the ", "lamp went out."]:
        st.append_output(db, run.id, delta)
    ch = st.get_chapter(db, chapter.id)
    assert ch.text == "The storms at night and the lamp went out."
    assert ch.word_count == len(ch.text.split()) == 9  # exact across word boundaries
    assert st.get_run(db, run.id).text == "s at night and the lamp went out."
    st.finish_run(db, run.id, "done")
    assert st.get_chapter(db, chapter.id).status == "done"
    assert st.latest_run_for_chapter(db, chapter.id).id == run.id
    assert st.list_revisions(db, chapter.id) == []


def test_regenerate_keeps_revision(db, chapter):
    st.set_chapter_text(db, chapter.id, "Old text.")
    run = st.start_chapter_run(db, chapter.id, "regenerate", method="tokenswift", model="m")
    assert st.get_chapter(db, chapter.id).text == "Old text."  # nothing changes while queued
    st.claim_next_run(db, "w")
    ch = st.get_chapter(db, chapter.id)
    assert (ch.text, ch.word_count, ch.status) == ("", 0, "generating")
    assert [(r.text, r.reason) for r in st.list_revisions(db, chapter.id)] == [("Old text.", "regenerate")]
    st.append_output(db, run.id, "New text.", [1, 2])
    st.finish_run(db, run.id, "done")
    assert st.get_chapter(db, chapter.id).text == "New text."


def test_cancel_queued_and_running(db, chapter):
    st.set_chapter_text(db, chapter.id, "Kept.")
    running = st.start_chapter_run(db, chapter.id, "continue", method="ar", model="m")
    queued = st.enqueue_run(db, mode="generate", method="ar", model="m")
    st.claim_next_run(db, "w")

    assert st.request_cancel(db, queued.id) == "cancelled"
    assert st.get_run(db, queued.id).finished_at is not None
    assert st.claim_next_run(db, "w") is None  # a cancelled run is never claimed

    assert not st.is_cancel_requested(db, running.id)
    assert st.request_cancel(db, running.id) == "running"
    assert st.is_cancel_requested(db, running.id)
    st.append_output(db, running.id, " More.")  # the worker may flush what it has
    st.finish_run(db, running.id, "cancelled")
    assert st.request_cancel(db, running.id) == "cancelled"
    ch = st.get_chapter(db, chapter.id)
    assert (ch.text, ch.status) == ("Kept. More.", "draft")


def test_mark_interrupted_keeps_text(db, chapter):
    mine = st.start_chapter_run(db, chapter.id, "generate", method="ar", model="m")
    other = st.enqueue_run(db, mode="generate", method="ar", model="m")
    stale = st.enqueue_run(db, mode="generate", method="ar", model="m")
    for worker in ("w1", "w2", "w3"):
        st.claim_next_run(db, worker)
    st.append_output(db, mine.id, "Half a chapter", [1, 2, 3])
    run_sql(db, "UPDATE runs SET heartbeat_at = :t WHERE id = :id", t=utcnow() - timedelta(minutes=5), id=stale.id)

    assert st.mark_interrupted(db, "w1", stale_after_s=60) == [mine.id, stale.id]
    run = st.get_run(db, mine.id)
    assert (run.status, run.text, run.n_tokens) == ("interrupted", "Half a chapter", 3)
    assert "Interrupted" in run.error
    ch = st.get_chapter(db, chapter.id)
    assert (ch.text, ch.status) == ("Half a chapter", "draft")
    assert st.get_run(db, other.id).status == "running"
    with pytest.raises(st.StorageError, match="interrupted, not running"):  # a zombie worker cannot write
        st.append_output(db, mine.id, "more")
    assert st.finish_run(db, mine.id, "done").status == "interrupted"
    assert st.mark_interrupted(db) == [other.id]  # no filter: every running run

    resumed = st.start_chapter_run(db, chapter.id, "resume", method="ar", model="m")
    st.claim_next_run(db, "w1")
    st.append_output(db, resumed.id, " and the rest.")
    assert st.get_chapter(db, chapter.id).text == "Half a chapter and the rest."


def test_delete_project_keeps_runs(db, chapter):
    st.set_chapter_text(db, chapter.id, "v1")
    st.set_chapter_text(db, chapter.id, "v2")
    done = st.start_chapter_run(db, chapter.id, "continue", method="ar", model="m")
    st.claim_next_run(db, "w")
    st.append_output(db, done.id, " more", [5], [step(0)])
    st.finish_run(db, done.id, "done")
    queued = st.start_chapter_run(db, chapter.id, "continue", method="ar", model="m")
    other = st.create_project(db, "Other")
    st.add_chapter(db, other.id)

    st.delete_project(db, chapter.project_id)
    with pytest.raises(st.NotFoundError):
        st.get_chapter(db, chapter.id)
    assert run_sql(db, "SELECT count(*) FROM chapter_revisions").scalar() == 0
    kept = st.get_run(db, done.id)
    assert (kept.project_id, kept.chapter_id, kept.text) == (None, None, " more")
    assert len(st.get_steps(db, done.id)) == 1
    assert st.get_run(db, queued.id).status == "cancelled"
    assert len(st.list_chapters(db, other.id)) == 1  # other projects untouched
    with pytest.raises(st.NotFoundError):
        st.delete_project(db, chapter.project_id)


def test_delete_chapter_flags_running_run(db, chapter):
    run = st.start_chapter_run(db, chapter.id, "generate", method="ar", model="m")
    st.claim_next_run(db, "w")
    st.delete_chapter(db, chapter.id)
    assert st.is_cancel_requested(db, run.id)
    st.append_output(db, run.id, "still saved on the run")  # chapter gone: only the run gets it
    assert st.get_run(db, run.id).text == "still saved on the run"


# -- comparisons -------------------------------------------------------------------------

def _play(db, comparison, ar_ids, ts_ids):
    for ids in (ar_ids, ts_ids):  # ar is claimed first
        run = st.claim_next_run(db, "w")
        st.append_output(db, run.id, "x" * len(ids), ids)
        st.finish_run(db, run.id, "done")
    return st.get_comparison(db, comparison.id)


@pytest.mark.parametrize("ar_ids, ts_ids, match, divergence", [
    ([1, 2, 3], [1, 2, 3], True, None),
    ([1, 2, 3], [1, 9, 3], False, 1),
    ([1, 2, 3], [1, 2], False, 2),  # length mismatch: index of the first missing token
])
def test_comparison_settles(db, ar_ids, ts_ids, match, divergence):
    c = st.create_comparison(db, "Once upon a time", model="m", heads="h", settings={"seed": 1})
    ar, ts = st.get_run(db, c.ar_run_id), st.get_run(db, c.tokenswift_run_id)
    assert (ar.method, ar.heads, ts.method, ts.heads) == ("ar", None, "tokenswift", "h")
    assert ar.comparison_id == ts.comparison_id == c.id and ar.settings == ts.settings == {"seed": 1}
    assert st.settle_comparison(db, c.id).tokens_match is None  # not run yet
    settled = _play(db, c, ar_ids, ts_ids)
    assert (settled.tokens_match, settled.first_divergence) == (match, divergence)
    assert [x.id for x in st.list_comparisons(db)] == [c.id]


def test_a_settled_comparisons_divergence_is_stored_where_its_runs_differ(db):
    found = {"position": 1, "vanilla_token": 2, "tokenswift_token": 9, "top1": 2, "top2": 9, "gap": 3.1e-06,
             "logit_gap": 0.5}
    same = st.create_comparison(db, "p", model="m")
    _play(db, same, [1, 2, 3], [1, 2, 3])
    assert st.set_comparison_divergence(db, same.id, found).divergence == {}  # identical runs: nothing to store
    c = st.create_comparison(db, "p", model="m")
    st.set_comparison_divergence(db, c.id, found)  # not settled yet: left alone
    assert st.get_comparison(db, c.id).divergence == {}
    assert _play(db, c, [1, 2, 3], [1, 9, 3]).divergence == {}  # settled; the worker adds the divergence after
    with pytest.raises(st.ValidationError, match="not where comparison"):
        st.set_comparison_divergence(db, c.id, {**found, "position": 2})
    with pytest.raises(st.ValidationError, match="JSON"):
        st.set_comparison_divergence(db, c.id, {**found, "gap": float("inf")})
    st.set_comparison_divergence(db, c.id, found)
    assert st.get_comparison(db, c.id).divergence == found
    assert [x.divergence for x in st.list_comparisons(db)] == [found, {}]


def test_comparison_with_failed_run_stays_unsettled(db):
    c = st.create_comparison(db, "p", model="m")
    st.claim_next_run(db, "w")
    st.finish_run(db, c.ar_run_id, "failed", error="CUDA out of memory")
    st.claim_next_run(db, "w")
    st.finish_run(db, c.tokenswift_run_id, "done")
    assert st.get_comparison(db, c.id).tokens_match is None


def test_first_divergence():
    assert st.first_divergence([], []) is None
    assert st.first_divergence([], [1]) == 0
    assert st.first_divergence([1, 2], [1, 3, 4]) == 1


# -- worker state, long runs, corrupt rows ------------------------------------------------------

def test_worker_state(db):
    st.set_worker_state(db, "w1", "loading model", "Loading weights…", model="m", pid=42)
    st.set_worker_state(db, "w1", "ready", model="m", pid=42)
    st.set_worker_state(db, "w0", "stopped")
    states = st.get_worker_states(db)
    assert [(w.worker_id, w.state, w.message) for w in states] == [("w0", "stopped", ""), ("w1", "ready", "")]


def test_long_run(db, chapter):
    run = st.start_chapter_run(db, chapter.id, "generate", method="tokenswift", model="m")
    st.claim_next_run(db, "w")
    chunk, batches, steps_per_batch = "word " * 500, 200, 50  # 500 KB of text, 10K steps
    for b in range(batches):
        first = b * steps_per_batch
        st.append_output(db, run.id, chunk, range(first * 2, (first + steps_per_batch) * 2),
                         [step(i) for i in range(first, first + steps_per_batch)])
    total = batches * steps_per_batch
    ch, run = st.get_chapter(db, chapter.id), st.get_run(db, run.id)
    assert len(ch.text) == len(run.text) == batches * len(chunk) and ch.word_count == batches * 500
    assert st.get_run_token_ids(db, run.id) == list(range(total * 2)) and run.n_tokens == total * 2
    assert len(st.get_steps(db, run.id, after_step=total - 11)) == 10


def test_corrupt_rows(db, chapter, caplog):
    st.set_chapter_text(db, chapter.id, "Precious text.")
    run = st.start_chapter_run(db, chapter.id, "continue", method="ar", model="m", settings={"seed": 1})
    st.claim_next_run(db, "w")
    st.append_output(db, run.id, " More.", [1, 2])
    run_sql(db, "UPDATE runs SET settings = '{not json', token_ids = '[1, 2' WHERE id = :id", id=run.id)
    run_sql(db, "UPDATE projects SET settings = '[1, 2]'")

    with caplog.at_level(logging.WARNING, logger="storage.models"):
        assert st.get_run(db, run.id).settings == {}  # damaged settings read as empty...
        assert st.get_project(db, chapter.project_id).settings == {}
        assert [r.id for r in st.list_runs(db)] == [run.id]  # ...and listings keep working
    assert "corrupt JSON" in caplog.text
    assert run_sql(db, "SELECT settings FROM runs").scalar() == "{not json"  # never overwritten

    with pytest.raises(st.StorageError, match=f"token ids of run {run.id} are damaged"):
        st.get_run_token_ids(db, run.id)
    st.append_output(db, run.id, " Still fine.", [3])  # appending never destroys text
    assert st.get_run(db, run.id).text == " More. Still fine."
    assert st.get_chapter(db, chapter.id).text == "Precious text. More. Still fine."

    with pytest.raises(IntegrityError):  # the schema refuses a NULL chapter text outright
        run_sql(db, "UPDATE chapters SET text = NULL")
    assert st.get_chapter(db, chapter.id).text == "Precious text. More. Still fine."


def test_corrupt_token_ids_do_not_block_finishing(db):
    c = st.create_comparison(db, "p", model="m")
    for run_id in (c.ar_run_id, c.tokenswift_run_id):
        st.claim_next_run(db, "w")
        st.append_output(db, run_id, "t", [1])
    run_sql(db, "UPDATE runs SET token_ids = 'garbage' WHERE id = :id", id=c.ar_run_id)
    st.finish_run(db, c.ar_run_id, "done")
    assert st.finish_run(db, c.tokenswift_run_id, "done").status == "done"  # saved despite the bad list
    assert st.get_comparison(db, c.id).tokens_match is None
    with pytest.raises(st.StorageError, match="damaged"):
        st.settle_comparison(db, c.id)


def test_word_goal(db):
    project = st.create_project(db, "Goal")
    assert project.goal_words is None
    assert st.update_project(db, project.id, goal_words=80_000).goal_words == 80_000
    assert st.update_project(db, project.id, premise="p").goal_words == 80_000  # None keeps it
    assert st.update_project(db, project.id, goal_words=0).goal_words is None  # 0 removes it
    for bad in (-1, 10_000_001, 2.5, "many", True):
        with pytest.raises(st.ValidationError, match="word goal"):
            st.update_project(db, project.id, goal_words=bad)
    assert st.get_project(db, project.id).goal_words is None
