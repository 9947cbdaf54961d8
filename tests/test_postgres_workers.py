"""Scale-out on a real PostgreSQL server: three `python -m app.worker` processes drain one queue, each run claimed
exactly once; one worker is killed (SIGKILL) mid-run, another finds its run stale, and a resume on another worker
writes exactly the uninterrupted text; the UI (`app.py --no-worker`) serves the same database."""
from __future__ import annotations

import signal

import pytest
from test_worker import chain_ids
from test_worker_process import start_worker, uninterrupted, wait_for

import storage as st
from app.jobs import queue_chapter_run
from conftest import studio_server

pytestmark = pytest.mark.slow

N_RUNS = 30
STALE_AFTER_S = 12  # the workers' --stale-after-s: a killed worker's run is found within this plus a sweep


def test_three_workers_drain_the_queue_and_survive_a_sigkill(tmp_path, postgres, tiny_model_dir, one_thread):
    from core.engine import Engine

    url, model = postgres.create_database(), str(tiny_model_dir)
    db = st.open_database(url)
    project = st.create_project(db, "Shared queue", premise="Ships pass in the night.")
    long_settings = {"max_new_tokens": 900, "ignore_eos": True, "seed": 5, "method": "tokenswift"}
    long_chapter = st.add_chapter(db, project.id, "The long one")
    long_run = queue_chapter_run(db, long_chapter.id, "generate", long_settings, model=model)  # first in the queue
    runs = [long_run]
    for i in range(N_RUNS - 1):
        chapter = st.add_chapter(db, project.id, f"Part {i}")
        runs.append(queue_chapter_run(db, chapter.id, "generate", {"max_new_tokens": 24, "seed": i,
                                                                   "method": ("ar", "tokenswift")[i % 2]},
                                      model=model))
    names = ("pg-a", "pg-b", "pg-c")
    logs = [tmp_path / f"{n}.log" for n in names]
    procs = {n: start_worker(url, model, n, log, extra=("--stale-after-s", str(STALE_AFTER_S)))
             for n, log in zip(names, logs)}
    try:
        wait_for(lambda: st.get_run(db, long_run.id).n_tokens >= 100, 120, "the long run's output",
                 procs.values(), logs)
        victim = st.get_run(db, long_run.id).worker_id
        procs[victim].kill()  # SIGKILL: no chance to save anything
        procs[victim].wait(10)
        killed = st.get_run(db, long_run.id)
        assert killed.status == "running" and killed.n_tokens < 900
        survivors = {n: p for n, p in procs.items() if n != victim}
        survivor_logs = [tmp_path / f"{n}.log" for n in survivors]
        # The others drain the rest, and then find the killed worker's run stale and mark it interrupted.
        wait_for(lambda: all(st.get_run(db, r.id).status == "done" for r in runs[1:]), 240, "the queue drained",
                 survivors.values(), survivor_logs)
        wait_for(lambda: st.get_run(db, long_run.id).status == "interrupted", 4 * STALE_AFTER_S,
                 "the killed run marked interrupted", survivors.values(), survivor_logs)
        assert st.get_chapter(db, long_chapter.id).text == killed.text  # nothing written lost, nothing doubled
        resumed = queue_chapter_run(db, long_chapter.id, "resume", None, model=model)
        wait_for(lambda: st.get_run(db, resumed.id).status == "done", 120, "the resumed run",
                 survivors.values(), survivor_logs)
        resumed = st.get_run(db, resumed.id)
        assert resumed.worker_id in survivors

        # The UI alone, against the same PostgreSQL database and these workers.
        from gradio_client import Client

        with studio_server(tmp_path, tiny_model_dir, db_path=url, args=("--no-worker",)) as ui:
            client = Client(ui.url, verbose=False)
            client.predict(remembered={}, api_name="/load")
            out = client.predict("From the UI", "novel", "A premise.", api_name="/create_project")
            ui_project = out[0]["value"]
            client.predict(ui_project, 0, "A premise.", "Chapter 1", "", max_new_tokens=16, method="ar",
                           api_name="/generate")
            wait_for(lambda: (r := st.list_runs(db, project_id=ui_project)) and r[0].status == "done", 90,
                     "the UI's run done by a worker", survivors.values(), survivor_logs)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.wait(30)

    for r in runs[1:]:
        run, ids, steps = st.get_run(db, r.id), st.get_run_token_ids(db, r.id), st.get_steps(db, r.id)
        assert run.worker_id in names
        assert run.n_tokens == len(ids) == sum(s.new_tokens for s in steps) == steps[-1].tokens_so_far
        assert st.get_chapter(db, run.chapter_id).text == run.text  # claimed once, written once
    assert len({st.get_run(db, r.id).worker_id for r in runs}) >= 2  # the queue was shared
    reference = uninterrupted(Engine.load(model, heads=None, device="cpu"), killed.prompt, long_settings)
    assert chain_ids(db, resumed) == reference.token_ids  # exactly the uninterrupted run, across processes
    assert st.get_chapter(db, long_chapter.id).text == reference.text
    db.close()
