"""app.worker in-process on a real SQLite file and a real PostgreSQL server, with the tiny random checkpoint (one
short test on the real model).

Covers: persisted text / token ids / step metrics and their consistency, batched flushes, cancel, stop → interrupted
→ resume (exact), ZeroGPU-style chunks (exact), bad runs failing with readable messages while the worker goes on,
a failed model load, worker states and notices, and flagging abandoned runs at start.
"""
from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
import sqlalchemy as sa

import storage as st
from app.jobs import queue_chapter_run, queue_comparison, resume_chain, validate_settings
from app.worker import NO_HEADS_NOTICE, RunFailed, Worker, generation_config
from storage.models import utcnow


@pytest.fixture
def db(any_db):
    """Every test here runs on SQLite and on a real PostgreSQL server."""
    return any_db


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir, one_thread):
    from core.engine import Engine

    return Engine.load(str(tiny_model_dir), heads=None, device="cpu")


@pytest.fixture
def book(db):
    project = st.create_project(db, "The Keeper", premise="A lighthouse keeper finds a message in a bottle.")
    # The runs these tests count and compare are the chapter runs; summaries are tested in test_story_worker.py.
    st.update_project(db, project.id, auto_summary=False)
    first = st.add_chapter(db, project.id, "The bottle", "She finds it at dawn.")
    second = st.add_chapter(db, project.id, "The reply", "She writes back.")
    return project, first, second


def worker(db, engine, **kwargs) -> Worker:
    return Worker(db, engine=engine, worker_id=kwargs.pop("worker_id", "w1"), **kwargs)


def decode(engine, ids):
    return engine.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def reference_ids(engine, prompt: str, settings: dict, method: str) -> list[int]:
    """The output of one uninterrupted generation, straight from the engine."""
    from core.generation.text import encode_prompt

    config = generation_config(validate_settings(settings, engine.max_context), method)
    return engine.generate(encode_prompt(engine.tokenizer, prompt), config).run().token_ids


def chain_ids(db, run) -> list[int]:
    return [t for r in resume_chain(db, run) + [run] for t in st.get_run_token_ids(db, r.id)]


def wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


def drain(w: Worker, **kwargs) -> int:
    n = 0
    while w.process_one(**kwargs):
        n += 1
    return n


def assert_text_of(text: str, decoded: str) -> None:
    """`text` is `decoded`, less a last character the ids leave unfinished (held back for a resume to complete)."""
    held = decoded[len(text):]
    assert decoded.startswith(text) and (not held or held.endswith("\ufffd")), (text[-40:], held)


def assert_consistent(db, engine, run_id):
    """Text, token ids, counters and step rows of a run agree with each other."""
    run = st.get_run(db, run_id)
    ids = st.get_run_token_ids(db, run_id)
    steps = st.get_steps(db, run_id)
    assert run.n_tokens == len(ids) == sum(s.new_tokens for s in steps) == steps[-1].tokens_so_far
    assert [s.step for s in steps] == list(range(len(steps)))
    chain = resume_chain(db, run)  # a resume run's own first ids may finish a character its parent began
    assert_text_of("".join(r.text for r in chain) + run.text, decode(engine, chain_ids(db, run)))
    assert all(0.0 <= s.repetition <= 1.0 and s.step_ms > 0 and s.tokens_per_s > 0 for s in steps)
    return run, ids, steps


def test_generate_persists_consistent_output(db, book, tiny_engine):
    project, first, second = book
    st.set_chapter_text(db, first.id, "Dawn came grey over the rocks.")
    settings = {"max_new_tokens": 80, "method": "tokenswift", "seed": 5}
    run = queue_chapter_run(db, second.id, "generate", settings, model=tiny_engine.loaded.name)
    w = worker(db, tiny_engine)
    assert drain(w) == 1
    run, ids, steps = assert_consistent(db, tiny_engine, run.id)
    assert run.status == "done" and run.error is None and run.worker_id == "w1"
    assert 0 < run.n_tokens <= 80 and run.tokens_per_s > 0 and run.mean_accepted >= 1.0 and run.prefill_s > 0
    chapter = st.get_chapter(db, second.id)
    assert chapter.text == run.text and chapter.status == "done"
    # The prompt the worker built is stored, and regenerating from it gives the very same tokens.
    assert "A lighthouse keeper finds a message in a bottle." in run.prompt
    assert "Dawn came grey over the rocks." in run.prompt and "She writes back." in run.prompt
    assert reference_ids(tiny_engine, run.prompt, settings, "ar") == ids
    state = st.get_worker_states(db)[0]
    assert (state.worker_id, state.state, state.model) == ("w1", "ready", tiny_engine.loaded.name)
    assert "Idle." in state.message


def test_flushes_are_batched(db, book, tiny_engine, monkeypatch):
    calls = []
    real = st.append_output
    monkeypatch.setattr(st, "append_output", lambda *a, **k: (calls.append(len(a[3]) if len(a) > 3 else 0),
                                                                real(*a, **k))[1])
    run = queue_chapter_run(db, book[1].id, "generate", {"max_new_tokens": 300, "method": "ar", "ignore_eos": True},
                            model=tiny_engine.loaded.name)
    drain(worker(db, tiny_engine, flush_s=0.25))
    run, ids, steps = assert_consistent(db, tiny_engine, run.id)
    assert len(steps) == 300
    assert calls[0] == 1  # the first step goes out at once
    assert 2 <= len(calls) <= 300 / 4, calls  # then in batches, never per token


def test_state_row_stays_fresh_during_a_run(db, book, tiny_engine, monkeypatch):
    """While a run is generated the worker keeps rewriting its state row (same state, new timestamp): a worker
    killed mid-run is then recognisable by a stale row (the UI says "not responding")."""
    import app.worker as worker_module

    monkeypatch.setattr(worker_module, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(worker_module, "STATE_REFRESH_S", 0.1)
    seen = []  # (state, message, updated_at) of the row, read while the run writes
    real = st.append_output

    def slow_append(db_, run_id, *a, **k):
        out = real(db_, run_id, *a, **k)
        if a:  # a flush of the main loop (the heartbeat thread appends nothing)
            row = {s.worker_id: s for s in st.get_worker_states(db_)}["w1"]
            seen.append((row.state, row.message, row.updated_at))
            time.sleep(0.03)  # a slow model: the run lasts about two seconds
        return out

    monkeypatch.setattr(st, "append_output", slow_append)
    run = queue_chapter_run(db, book[1].id, "generate", {"max_new_tokens": 60, "method": "ar", "ignore_eos": True},
                            model=tiny_engine.loaded.name)
    w = worker(db, tiny_engine, flush_s=0.0)
    assert drain(w) == 1
    assert st.get_run(db, run.id).status == "done"
    assert len(seen) >= 30
    assert all(state == "ready" and f"Generating run {run.id}" in message for state, message, _ in seen)
    stamps = [t for _, _, t in seen]
    assert stamps == sorted(stamps) and len(set(stamps)) >= 5, stamps  # refreshed again and again mid-run
    assert (stamps[-1] - stamps[0]).total_seconds() >= 1.0


def test_state_row_stays_fresh_while_the_model_loads(db, tiny_engine, monkeypatch):
    import app.worker as worker_module
    from core.engine import Engine

    monkeypatch.setattr(worker_module, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(worker_module, "STATE_REFRESH_S", 0.1)
    writes = []
    real = st.set_worker_state
    monkeypatch.setattr(st, "set_worker_state", lambda db_, wid, state, message="", **kw: (
        writes.append(state), real(db_, wid, state, message, **kw))[1])
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: (time.sleep(0.8), tiny_engine)[1]))
    w = Worker(db, model=tiny_engine.loaded.name, heads=None, worker_id="slow-load")
    assert w.ensure_engine() is tiny_engine
    assert writes[0] == "loading model" and writes[-1] == "ready"
    assert writes.count("loading model") >= 3  # refreshed during the slow load


def test_comparison_runs_match(db, tiny_engine):
    comparison = queue_comparison(db, "Tell me about the sea.", {"max_new_tokens": 40, "seed": 3},
                                  model=tiny_engine.loaded.name)
    assert drain(worker(db, tiny_engine)) == 2
    comparison = st.get_comparison(db, comparison.id)
    for run_id in (comparison.ar_run_id, comparison.tokenswift_run_id):
        run, _, _ = assert_consistent(db, tiny_engine, run_id)
        assert run.status == "done" and run.prompt == "Tell me about the sea."
    assert comparison.tokens_match is True and comparison.first_divergence is None and comparison.divergence == {}


def _diverging_comparison(db, engine, settings):
    """A comparison whose TokenSwift run is queued with another seed than its vanilla run, so its ids differ."""
    comparison = queue_comparison(db, "Tell me about the sea.", settings, model=engine.loaded.name)
    ts = st.get_run(db, comparison.tokenswift_run_id)
    with db.write() as s:
        s.execute(sa.update(st.Run).where(st.Run.id == ts.id).values(settings={**ts.settings, "seed": 4}))
    return comparison


def test_comparison_runs_that_differ_get_the_gap_where_they_do(db, tiny_engine):
    """The vanilla run's stored token 17 is changed after it finished, before the TokenSwift run is generated and
    the comparison settled: the worker's finalisation finds the runs differ there and stores vanilla decoding's draw
    at 17, recomputed from the vanilla run's prompt, settings and the ids before 17: TokenSwift's token."""
    from app import views
    from core.generation.agreement import format_gap
    from core.generation.divergence import explain_divergence
    from core.generation.text import encode_prompt

    settings = {"max_new_tokens": 40, "seed": 3, "ignore_eos": True}
    comparison = queue_comparison(db, "Tell me about the sea.", settings, model=tiny_engine.loaded.name)
    w = worker(db, tiny_engine)
    assert w.process_one()  # the vanilla run
    ar_ids = st.get_run_token_ids(db, comparison.ar_run_id)
    ar_ids[17] = (ar_ids[17] + 1) % tiny_engine.model.cfg.vocab_size
    with db.write() as s:
        s.execute(sa.update(st.Run).where(st.Run.id == comparison.ar_run_id).values(token_ids=json.dumps(ar_ids)))
    assert st.get_comparison(db, comparison.id).tokens_match is None
    assert w.process_one() and not w.process_one()  # the TokenSwift run, then the comparison is settled
    comparison = st.get_comparison(db, comparison.id)
    ar, ts = st.get_run(db, comparison.ar_run_id), st.get_run(db, comparison.tokenswift_run_id)
    ts_ids = st.get_run_token_ids(db, ts.id)
    assert ar.status == ts.status == "done" and len(ts_ids) == 40 and ts_ids[:17] == ar_ids[:17]
    assert comparison.tokens_match is False and comparison.first_divergence == 17
    config = generation_config(validate_settings(settings, tiny_engine.max_context), "ar")
    found = explain_divergence(tiny_engine, encode_prompt(tiny_engine.tokenizer, "Tell me about the sea."), config,
                               ar_ids, ts_ids)
    assert comparison.divergence == found.to_dict()
    assert (found.position, found.vanilla_token, found.tokenswift_token, found.top1) == (17, ar_ids[17], ts_ids[17],
                                                                                       ts_ids[17])
    html = views.compare_summary(comparison, ar, ts)
    assert f"first differ at token 17 · top-2 gap {format_gap(found.gap)}</div>" in html
    assert views.comparisons_table([comparison], {ar.id: ar, ts.id: ts})[0][-1] == (
        f"no (token 17, gap {format_gap(found.gap)})")


def test_a_gap_that_cannot_be_computed_leaves_the_comparison_settled(db, tiny_engine, monkeypatch, caplog):
    from app import views
    from core.generation import divergence

    def broken(*args, **kwargs):
        raise RuntimeError("no memory for the prefill")

    monkeypatch.setattr(divergence, "explain_divergence", broken)
    comparison = _diverging_comparison(db, tiny_engine, {"max_new_tokens": 40, "seed": 3})
    w = worker(db, tiny_engine)
    assert drain(w) == 2
    comparison = st.get_comparison(db, comparison.id)
    ar, ts = st.get_run(db, comparison.ar_run_id), st.get_run(db, comparison.tokenswift_run_id)
    assert ar.status == ts.status == "done" and comparison.tokens_match is False and comparison.divergence == {}
    assert "where its runs differ could not be recomputed" in caplog.text and "no memory for the prefill" in caplog.text
    html = views.compare_summary(comparison, ar, ts)
    assert f"first differ at token {comparison.first_divergence}</div>" in html and "gap" not in html
    assert w.state[1].startswith("Idle.")


def test_cancel_mid_run_keeps_the_text(db, book, tiny_engine):
    run = queue_chapter_run(db, book[1].id, "generate", {"max_new_tokens": 3000, "ignore_eos": True},
                            model=tiny_engine.loaded.name)
    w = worker(db, tiny_engine).start()
    try:
        wait_for(lambda: st.get_run(db, run.id).n_tokens >= 20, what="output")
        assert st.request_cancel(db, run.id) == "running"
        wait_for(lambda: st.get_run(db, run.id).status == "cancelled", timeout=10, what="cancel")
    finally:
        assert w.stop(timeout=10)
    run, ids, _ = assert_consistent(db, tiny_engine, run.id)
    assert 20 <= len(ids) < 3000
    chapter = st.get_chapter(db, book[1].id)
    assert chapter.text == run.text and chapter.status == "draft"
    assert st.get_worker_states(db)[0].state == "stopped"


def test_stop_interrupts_and_resume_continues_exactly(db, book, tiny_engine):
    settings = {"max_new_tokens": 400, "ignore_eos": True, "seed": 11, "method": "tokenswift"}
    first = queue_chapter_run(db, book[1].id, "generate", settings, model=tiny_engine.loaded.name)
    w = worker(db, tiny_engine, flush_s=0.1).start()
    wait_for(lambda: st.get_run(db, first.id).n_tokens >= 30, what="output")
    assert w.stop(timeout=10)
    first = st.get_run(db, first.id)
    assert first.status == "interrupted" and "resume" in first.error
    assert_consistent(db, tiny_engine, first.id)
    assert st.get_chapter(db, book[1].id).status == "draft"

    resumed = queue_chapter_run(db, book[1].id, "resume", None, model=tiny_engine.loaded.name)
    assert drain(worker(db, tiny_engine, worker_id="w2")) == 1
    resumed, own, _ = assert_consistent(db, tiny_engine, resumed.id)
    assert resumed.status == "done" and len(own) == 400 - first.n_tokens
    ids = chain_ids(db, resumed)
    assert ids == reference_ids(tiny_engine, first.prompt, settings, "ar")
    assert st.get_chapter(db, book[1].id).text == first.text + resumed.text == decode(tiny_engine, ids)


class CutMidCharacter:
    """The engine, but a first (not resumed) generation is stopped at its first step that leaves a character
    unfinished: byte-level tokens split one character over several ids."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt_ids, config, cancel=None, resume_ids=()):
        def cut() -> bool:
            unfinished = not resume_ids and gen.stream.holding
            return unfinished or cancel()

        gen = self.engine.generate(prompt_ids, config, cancel=cut, resume_ids=resume_ids)
        return gen


def test_stop_inside_a_character_then_resume_writes_it_whole(db, book, tiny_engine):
    settings = {"max_new_tokens": 400, "ignore_eos": True, "seed": 11}
    first = queue_chapter_run(db, book[1].id, "generate", settings, model=tiny_engine.loaded.name)
    assert drain(worker(db, CutMidCharacter(tiny_engine))) == 1
    first, ids, _ = assert_consistent(db, tiny_engine, first.id)
    assert first.status == "cancelled" and decode(tiny_engine, ids).endswith("\ufffd")
    assert "\ufffd" not in first.text[-1:]  # the unfinished character's bytes are ids only, not text

    resumed = queue_chapter_run(db, book[1].id, "resume", None, model=tiny_engine.loaded.name)
    assert drain(worker(db, tiny_engine, worker_id="w2")) == 1
    resumed, _, _ = assert_consistent(db, tiny_engine, resumed.id)
    ids = chain_ids(db, resumed)
    assert ids == reference_ids(tiny_engine, first.prompt, settings, "ar")
    assert st.get_chapter(db, book[1].id).text == first.text + resumed.text == decode(tiny_engine, ids)


def test_time_budget_chunks_add_up_to_the_uninterrupted_run(db, book, tiny_engine):
    settings = {"max_new_tokens": 150, "ignore_eos": True, "seed": 2}
    run = queue_chapter_run(db, book[1].id, "generate", settings, model=tiny_engine.loaded.name)
    w = worker(db, tiny_engine)
    chunks = 0
    while w.process_one(time_budget_s=0.03):
        chunks += 1
        if st.get_run(db, run.id).status == "running":  # paused between chunks, still owned by this worker
            assert st.get_run(db, run.id).worker_id == "w1"
    assert chunks >= 3
    run, ids, steps = assert_consistent(db, tiny_engine, run.id)
    assert run.status == "done" and len(ids) == 150
    assert ids == reference_ids(tiny_engine, run.prompt, settings, "ar")
    assert st.get_chapter(db, book[1].id).text == run.text
    assert run.decode_s == pytest.approx(sum(s.step_ms for s in steps) / 1000)


def test_cancel_between_chunks(db, book, tiny_engine):
    run = queue_chapter_run(db, book[1].id, "generate", {"max_new_tokens": 500, "ignore_eos": True},
                            model=tiny_engine.loaded.name)
    w = worker(db, tiny_engine)
    assert w.process_one(time_budget_s=0.05)
    written = st.get_run(db, run.id).n_tokens
    st.request_cancel(db, run.id)
    assert w.process_one(time_budget_s=0.05)
    run = st.get_run(db, run.id)
    assert run.status == "cancelled" and run.n_tokens == written
    assert not w.process_one()


def test_bad_runs_fail_readably_and_the_worker_goes_on(db, tiny_engine):
    model = tiny_engine.loaded.name
    good = validate_settings({"max_new_tokens": 10})
    bad_value = st.enqueue_run(db, mode="compare", method="ar", model=model, prompt="Hi",
                               settings={**good, "temperature": "hot"})
    corrupt = st.enqueue_run(db, mode="compare", method="ar", model=model, prompt="Hi", settings=good)
    with db.engine.begin() as conn:
        conn.execute(sa.text("UPDATE runs SET settings = '{not json' WHERE id = :id"), {"id": corrupt.id})
    other_model = st.enqueue_run(db, mode="compare", method="ar", model="some/other-model", prompt="Hi",
                                 settings=good)
    too_long = st.enqueue_run(db, mode="compare", method="ar", model=model, prompt="word " * 2000,
                              settings={**good, "max_new_tokens": 3000})
    no_prompt = st.enqueue_run(db, mode="compare", method="ar", model=model, settings=good)
    fine = st.enqueue_run(db, mode="compare", method="tokenswift", model=model, prompt="Hi", settings=good)

    assert drain(worker(db, tiny_engine)) == 6
    errors = {r.id: (r.status, r.error) for r in (st.get_run(db, x.id) for x in
                                                  (bad_value, corrupt, other_model, too_long, no_prompt, fine))}
    assert errors[bad_value.id] == ("failed", "Bad settings: Temperature must be a number, got 'hot'.")
    assert errors[corrupt.id][0] == "failed" and "missing or damaged" in errors[corrupt.id][1]
    assert errors[other_model.id][0] == "failed" and "asks for model 'some/other-model'" in errors[other_model.id][1]
    assert errors[too_long.id][0] == "failed" and "exceed the model's context of 4,096" in errors[too_long.id][1]
    assert errors[no_prompt.id][0] == "failed" and "no prompt" in errors[no_prompt.id][1]
    assert errors[fine.id] == ("done", None)
    assert not any("Traceback" in (e or "") for _, e in errors.values())


class _FailingAfter:
    """Wraps a Generation: yields `n` steps, then raises `error` (a model fault in the middle of a run)."""

    def __init__(self, gen, n, error):
        self.gen, self.n, self.error = gen, n, error

    def __iter__(self):
        for i, step in enumerate(self.gen):
            yield step
            if i + 1 == self.n:
                raise self.error

    def __getattr__(self, name):
        return getattr(self.gen, name)


@pytest.mark.parametrize("error, message", [
    (RuntimeError("boom\nsecond line"), "Model error (RuntimeError): boom."),
    (MemoryError(), "Out of memory while generating."),
])
def test_a_run_that_raises_is_failed_and_the_worker_continues(db, book, tiny_engine, monkeypatch, error, message):
    real = tiny_engine.generate
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        gen = real(*args, **kwargs)
        return _FailingAfter(gen, 6, error) if len(calls) == 1 else gen

    monkeypatch.setattr(tiny_engine, "generate", flaky)
    model = tiny_engine.loaded.name
    broken = queue_chapter_run(db, book[1].id, "generate", {"max_new_tokens": 50, "method": "ar",
                                                             "ignore_eos": True}, model=model)
    after = queue_chapter_run(db, book[2].id, "generate", {"max_new_tokens": 20}, model=model)
    assert drain(worker(db, tiny_engine)) == 2
    broken = st.get_run(db, broken.id)
    assert broken.status == "failed" and broken.error.startswith(message)
    assert broken.n_tokens == 6 and st.get_chapter(db, book[1].id).text == broken.text  # kept, resumable
    assert st.get_run(db, after.id).status == "done"


def test_failed_model_load_sets_failed_state(db, book):
    run = queue_chapter_run(db, book[1].id, "generate", {}, model="no-such-model-xyz")
    w = Worker(db, model="no-such-model-xyz", worker_id="bad").start()
    wait_for(lambda: not w._thread.is_alive(), timeout=30, what="the worker to give up")
    state = {s.worker_id: s for s in st.get_worker_states(db)}["bad"]
    assert state.state == "failed"
    assert "no-such-model-xyz" in state.message and "matches nothing" in state.message
    assert "Traceback" not in state.message
    assert st.get_run(db, run.id).status == "queued"  # left for a worker that can run it
    with pytest.raises(RunFailed, match="no-such-model-xyz"):
        w.process_one()


def test_states_and_notices(db, tiny_model_dir, tiny_engine, monkeypatch):
    states = []
    real = st.set_worker_state
    monkeypatch.setattr(st, "set_worker_state", lambda db, wid, state, message="", **kw: (
        states.append((state, message)), real(db, wid, state, message, **kw))[1])
    queue_comparison(db, "Hello", {"max_new_tokens": 5}, model=str(tiny_model_dir))
    w = Worker(db, model=str(tiny_model_dir), heads=None, device="cpu", worker_id="fresh")
    assert drain(w) == 2  # loads the model lazily on the first call
    assert states[0] == ("loading model", f"Loading {tiny_model_dir}…")
    assert states[1][0] == "ready" and NO_HEADS_NOTICE[1:] in states[1][1]  # told before the first run
    assert any("Generating run" in m for _, m in states)
    assert w.engine.notices == [NO_HEADS_NOTICE]  # core's own notice is the same text: shown once


def test_start_flags_own_and_stale_runs_interrupted(db, book, tiny_engine):
    model = tiny_engine.loaded.name
    runs = [queue_chapter_run(db, c.id, "generate", {}, model=model) for c in book[1:]]
    runs.append(st.enqueue_run(db, mode="compare", method="ar", model=model, prompt="x", settings={"seed": 1}))
    runs.append(st.enqueue_run(db, mode="compare", method="ar", model=model, prompt="x", settings={"seed": 1}))
    mine, stale, alive = (st.claim_next_run(db, wid) for wid in ("w1", "dead", "alive"))
    st.append_output(db, mine.id, "Some text", [1, 2])
    with db.engine.begin() as conn:
        conn.execute(sa.text("UPDATE runs SET heartbeat_at = :t WHERE id = :id"),
                     {"t": utcnow() - timedelta(minutes=5), "id": stale.id})
    w = worker(db, tiny_engine, worker_id="w1")
    w._startup()
    assert [st.get_run(db, r.id).status for r in (mine, stale, alive)] == ["interrupted", "interrupted", "running"]
    assert st.get_run(db, mine.id).text == "Some text" == st.get_chapter(db, book[1].id).text
    assert st.get_chapter(db, book[1].id).status == "draft"


def test_real_model_writes_a_chapter(db, book, smol_engine):
    """The default model, briefly: the built prompt fits, the text is real words and matches its token ids."""
    project, first, second = book
    st.set_chapter_text(db, first.id, "The lamp had burned for forty years without fail.")
    run = queue_chapter_run(db, second.id, "generate", {"max_new_tokens": 24, "method": "tokenswift"},
                            model="smollm2-135m")
    assert drain(worker(db, smol_engine)) == 1
    run, ids, _ = assert_consistent(db, smol_engine, run.id)
    assert run.status == "done", run.error
    assert sum(ch.isalpha() for ch in run.text) > len(run.text) / 2
    assert st.get_chapter(db, second.id).text == run.text


def test_compile_reports_its_own_state(db, tiny_engine, monkeypatch):
    from core.engine import Engine

    states = []
    real = st.set_worker_state
    monkeypatch.setattr(st, "set_worker_state", lambda db, wid, state, message="", **kw: (
        states.append((state, message)), real(db, wid, state, message, **kw))[1])
    seen = {}
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: (seen.update(k), tiny_engine)[1]))
    monkeypatch.setattr(tiny_engine, "warm_up", lambda progress=None: (progress("the 1-token graph"), 0.0)[1])
    w = Worker(db, model=tiny_engine.loaded.name, heads=None, compile=True, worker_id="c")
    assert w.ensure_engine() is tiny_engine and seen["compile"] is True
    assert [s for s, _ in states] == ["loading model", "compiling", "compiling", "ready"]
    assert states[2][1] == "Compiling: the 1-token graph…"


@pytest.fixture
def without_kernels():
    """Our CPU kernels switched off (TOKENSWIFT_KERNELS=off): models run on PyTorch's operators, as where the kernels
    cannot be built; there compiled graphs are what makes them fast."""
    import os

    from core.runtime.kernels import cpu

    before = os.environ.get("TOKENSWIFT_KERNELS")
    os.environ["TOKENSWIFT_KERNELS"] = "off"
    cpu.kernel.cache_clear()
    yield
    if before is None:
        del os.environ["TOKENSWIFT_KERNELS"]
    else:
        os.environ["TOKENSWIFT_KERNELS"] = before
    cpu.kernel.cache_clear()


def test_auto_compile_compiles_nothing_for_a_model_on_the_cpu_kernels(db, book, tiny_model_dir, one_thread):
    run = queue_chapter_run(db, book[1].id, "generate", {"max_new_tokens": 8, "ignore_eos": True},
                            model=str(tiny_model_dir))
    w = Worker(db, model=str(tiny_model_dir), heads=None, device="cpu", compile=None, worker_id="n", poll_s=0.05)
    assert w.ensure_engine().model.native and w._compiling is None
    w.start()
    try:
        wait_for(lambda: st.get_run(db, run.id).status == "done", timeout=120, what="the run")
    finally:
        assert w.stop(timeout=60)
    assert w.engine.runner is None and "compil" not in st.get_worker_states(db)[0].message


def test_auto_compile_starts_eagerly_and_swaps_in_graphs_built_while_idle(db, book, tiny_model_dir, one_thread,
                                                                         without_kernels, monkeypatch):
    """compile=None on a CPU model on PyTorch's operators: the first run starts right after loading, eagerly; the
    graphs compile one at a time while the queue is empty (the worker stays "ready" and says so); runs after the
    swap use them."""
    seen = []  # (state, message, whether the worker's engine is compiled): read when the state is written
    real = st.set_worker_state

    def spy(db, wid, state, message="", **kw):
        seen.append((state, message, w.engine is not None and w.engine.runner is not None))
        return real(db, wid, state, message, **kw)

    monkeypatch.setattr(st, "set_worker_state", spy)
    model = str(tiny_model_dir)
    settings = {"max_new_tokens": 12, "method": "tokenswift", "seed": 3, "ignore_eos": True}
    first = queue_chapter_run(db, book[1].id, "generate", settings, model=model)
    w = Worker(db, model=model, heads=None, device="cpu", compile=None, worker_id="auto", poll_s=0.05).start()
    try:
        wait_for(lambda: w.engine is not None and w.engine.runner is not None, timeout=600, what="the swap")
        second = queue_chapter_run(db, book[1].id, "regenerate", settings, model=model)
        wait_for(lambda: st.get_run(db, second.id).status == "done", timeout=120, what="the second run")
    finally:
        assert w.stop(timeout=120)
    assert st.get_run(db, first.id).status == "done" and st.get_run(db, second.id).n_tokens == 12
    messages = [m.split(" Note: ")[0] for _, m, _ in seen]
    generating = {r.id: next(i for i, m in enumerate(messages) if m.startswith(f"Generating run {r.id}"))
                  for r in (first, second)}
    compiling = [i for i, m in enumerate(messages) if "for faster runs" in m]
    assert all(seen[i][0] == "ready" for i in compiling)  # the worker takes runs all along
    assert generating[first.id] < compiling[0] and not seen[generating[first.id]][2]  # at once, eagerly
    # (a step longer than STATE_REFRESH_S has its line written again by the heartbeat)
    steps = list(dict.fromkeys(messages[i] for i in compiling))
    # a CPU's gated trees take 1-4 nodes: a graph for each size
    assert steps == ["Idle. Preparing compiled graphs for faster runs…",
                     *(f"Idle. Compiling the {n}-token graph for faster runs…" for n in (1, 2, 3, 4))]
    assert compiling[-1] < generating[second.id] and seen[generating[second.id]][2]  # compiled
    assert w.engine.runner.ready == {1, 2, 3, 4}
    assert st.get_worker_states(db)[0].message.startswith("Stopped.")


def test_a_failed_background_compile_leaves_the_worker_eager_and_says_why(db, book, tiny_model_dir, one_thread,
                                                                        without_kernels, tmp_path):
    import shutil

    model = str(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    w = Worker(db, model=model, heads=None, device="cpu", compile=None, worker_id="x", poll_s=0.05)
    eager = w.ensure_engine()
    assert eager.runner is None
    shutil.rmtree(model)  # the compiled engine's copy of the model cannot load
    run = queue_chapter_run(db, book[1].id, "generate", {"max_new_tokens": 8, "ignore_eos": True}, model=model)
    w.start()
    try:
        wait_for(lambda: st.get_run(db, run.id).status == "done", timeout=120, what="the run")
        wait_for(lambda: "did not compile" in st.get_worker_states(db)[0].message, what="the notice")
    finally:
        assert w.stop(timeout=60)
    assert w.engine is eager and eager.runner is None
    assert eager.notices[-1].startswith("the model's graphs did not compile (") and "eagerly" in eager.notices[-1]


def test_no_background_compile_without_memory_for_a_second_copy(db, tiny_model_dir, one_thread, without_kernels,
                                                                monkeypatch):
    import psutil

    w = Worker(db, model=str(tiny_model_dir), heads=None, device="cpu", compile=None, worker_id="m", poll_s=0.05)
    eager = w.ensure_engine()
    available = psutil.virtual_memory().available
    # as if all but 1 MB of this machine's memory were taken: the tiny model needs a few MB more than that
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Mem", (), {"available": 2**20})())
    w.start()
    try:
        wait_for(lambda: "did not compile" in st.get_worker_states(db)[0].message, what="the notice")
    finally:
        assert w.stop(timeout=60)
    assert w.engine is eager and eager.runner is None and available > 2**30
    assert "compiling needs ~" in eager.notices[-1] and "GiB free beside the loaded model" in eager.notices[-1]


def test_importing_the_worker_is_light():
    import subprocess
    import sys

    code = ("import sys, app.worker; bad = [m for m in ('gradio', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
