"""`python -m app.worker` as real processes on one SQLite file: SIGKILL mid-run → restart → interrupted → exact
resume; two workers sharing a queue; a model that cannot load."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_worker import assert_text_of, chain_ids

import storage as st
from app.jobs import queue_chapter_run, validate_settings
from app.worker import Worker, generation_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir, one_thread):
    from core.engine import Engine

    return Engine.load(str(tiny_model_dir), heads=None, device="cpu")


def start_worker(db_path: Path | str, model: str, worker_id: str, log: Path, heads: str = "none",
                 extra: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "app.worker", "--db", str(db_path), "--model", model, "--heads", heads, "--no-compile",
           "--device", "cpu", "--worker-id", worker_id, "--threads", "1", "--poll-s", "0.1", "--log-level", "INFO",
           *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def uninterrupted(engine, prompt: str, settings: dict):
    """What one vanilla run writes for `prompt` with `settings`, never stopped: the reference for a resumed chain."""
    from core.generation.text import encode_prompt

    config = generation_config(validate_settings(settings, engine.max_context), "ar")
    return engine.generate(encode_prompt(engine.tokenizer, prompt), config).run()


def wait_for(predicate, timeout: float, what: str, procs=(), logs=()):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        for p, log in zip(procs, logs):
            if p.poll() is not None:
                raise AssertionError(f"worker exited ({p.returncode}) while waiting for {what}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(log.read_text() for log in logs))
        time.sleep(0.05)
    return value


def test_sigkill_then_restart_marks_interrupted_and_resume_is_exact(tmp_path, tiny_model_dir, tiny_engine):
    db_path, log = tmp_path / "studio.db", tmp_path / "worker.log"
    model = str(tiny_model_dir)
    db = st.open_database(db_path)
    project = st.create_project(db, "Killed", premise="A storm knocks out the power.")
    chapter = st.add_chapter(db, project.id, "Dark")
    settings = {"max_new_tokens": 800, "ignore_eos": True, "seed": 4, "method": "tokenswift"}
    first = queue_chapter_run(db, chapter.id, "generate", settings, model=model)

    proc = start_worker(db_path, model, "w-kill", log)
    try:
        wait_for(lambda: st.get_run(db, first.id).n_tokens >= 100, 90, "output", [proc], [log])
    finally:
        proc.kill()  # SIGKILL: no chance to clean up
        proc.wait(10)
    killed = st.get_run(db, first.id)
    assert killed.status == "running" and killed.n_tokens < 800

    # A restarted worker with the same id flags the run it was killed with; the text up to the last flush stays.
    worker = Worker(db, engine=tiny_engine, worker_id="w-kill")
    assert worker.process_one() is False
    interrupted = st.get_run(db, first.id)
    assert interrupted.status == "interrupted"
    assert interrupted.text == killed.text == st.get_chapter(db, chapter.id).text
    ids = st.get_run_token_ids(db, first.id)
    assert len(ids) == interrupted.n_tokens >= 100
    assert_text_of(interrupted.text,
                   tiny_engine.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    resumed = queue_chapter_run(db, chapter.id, "resume", None, model=model)
    assert worker.process_one() is True
    resumed = st.get_run(db, resumed.id)
    assert resumed.status == "done", resumed.error
    reference = uninterrupted(tiny_engine, interrupted.prompt, settings)
    assert chain_ids(db, resumed) == reference.token_ids  # exactly the uninterrupted run, across processes and methods
    assert st.get_chapter(db, chapter.id).text == interrupted.text + resumed.text == reference.text
    db.close()


@pytest.mark.slow
def test_the_real_model_killed_mid_chapter_then_resumed_writes_the_uninterrupted_text(tmp_path, smol_engine):
    """The default model as shipped (its GGUF's blocks) with its committed heads, TokenSwift, the studio settings: a
    worker process killed mid-run (SIGKILL), a restarted worker resumes it (its prefill rebuilds the cache from the
    ids so far), and every id of the chapter equals an uninterrupted vanilla run's."""
    from core.engine import Engine
    from core.tokenswift.heads import load_heads

    db_path, log = tmp_path / "studio.db", tmp_path / "worker.log"
    model = "smollm2-135m"
    db = st.open_database(db_path)
    project = st.create_project(db, "Keeper", premise="A lighthouse keeper finds a message in a bottle.")
    chapter = st.add_chapter(db, project.id, "The bottle")
    settings = {"max_new_tokens": 1024, "ignore_eos": True, "seed": 21, "method": "tokenswift"}
    first = queue_chapter_run(db, chapter.id, "generate", settings, model=model)
    proc = start_worker(db_path, model, "w-real", log, heads="default")
    try:
        wait_for(lambda: st.get_run(db, first.id).n_tokens >= 300, 300, "output", [proc], [log])
    finally:
        proc.kill()
        proc.wait(10)
    assert st.get_run(db, first.id).n_tokens < 1024
    heads = load_heads(smol_engine.loaded.default_heads_path(), smol_engine.model, model)
    worker = Worker(db, engine=Engine(smol_engine.loaded, heads), worker_id="w-real")
    assert worker.process_one() is False  # flags the killed run as interrupted
    interrupted = st.get_run(db, first.id)
    assert interrupted.status == "interrupted"
    resumed = queue_chapter_run(db, chapter.id, "resume", None, model=model)
    assert worker.process_one() is True
    resumed = st.get_run(db, resumed.id)
    assert resumed.status == "done", resumed.error
    all_ids = chain_ids(db, resumed)
    reference = uninterrupted(smol_engine, interrupted.prompt, settings)
    assert len(all_ids) == 1024 and all_ids == reference.token_ids
    assert st.get_chapter(db, chapter.id).text == reference.text
    db.close()


def test_two_worker_processes_share_one_queue(tmp_path, tiny_model_dir):
    db_path = tmp_path / "studio.db"
    model = str(tiny_model_dir)
    db = st.open_database(db_path)
    ids = ("wA", "wB")
    logs = [tmp_path / f"{w}.log" for w in ids]
    procs = [start_worker(db_path, model, w, log) for w, log in zip(ids, logs)]
    try:
        wait_for(lambda: sum(s.state == "ready" for s in st.get_worker_states(db)) == 2, 90, "both workers ready",
                 procs, logs)
        project = st.create_project(db, "Shared")
        runs = []
        for i in range(6):
            chapter = st.add_chapter(db, project.id, f"Part {i}")
            runs.append(queue_chapter_run(db, chapter.id, "generate",
                                          {"max_new_tokens": 40, "seed": i, "method": ("ar", "tokenswift")[i % 2]},
                                          model=model))
        wait_for(lambda: all(st.get_run(db, r.id).status == "done" for r in runs), 90, "all runs done", procs, logs)
        for r in runs:
            run = st.get_run(db, r.id)
            token_ids = st.get_run_token_ids(db, r.id)
            steps = st.get_steps(db, r.id)
            assert run.worker_id in ids
            assert run.n_tokens == len(token_ids) == sum(s.new_tokens for s in steps) == steps[-1].tokens_so_far
            assert st.get_chapter(db, run.chapter_id).text == run.text  # written once, not twice
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        codes = [p.wait(20) for p in procs]
    assert codes == [0, 0]
    assert {s.worker_id: s.state for s in st.get_worker_states(db)} == {"wA": "stopped", "wB": "stopped"}
    db.close()


def test_cli_reports_a_model_that_cannot_load(tmp_path):
    db_path, log = tmp_path / "studio.db", tmp_path / "worker.log"
    proc = start_worker(db_path, "no-such-model-xyz", "w-bad", log)
    assert proc.wait(60) == 2
    assert "error: Could not load model no-such-model-xyz" in log.read_text()
    with st.open_database(db_path) as db:
        (state,) = st.get_worker_states(db)
    assert state.state == "failed" and "matches nothing" in state.message
