"""Several workers (threads, and 'spawn' processes) sharing one SQLite file."""

import multiprocessing as mp
import os
import threading
import time
from collections import Counter

import pytest

import storage as st

N_RUNS = 50


def claim_all(path: str, worker: str, n_threads: int, start_at: float) -> list[tuple[str, int]]:
    """Threads that claim, write and finish runs until the queue is empty; returns (worker, run_id) claims."""
    claims: list[tuple[str, int]] = []
    with st.open_database(path) as db:
        def loop(name: str) -> None:
            time.sleep(max(0.0, start_at - time.time()))  # start together for maximal contention
            while (run := st.claim_next_run(db, name)) is not None:
                claims.append((name, run.id))  # list.append is atomic under the GIL
                st.append_output(db, run.id, f"by {name}", [run.id], [{"step": 0, "new_tokens": 1,
                                                                       "step_ms": 1.0, "tokens_so_far": 1}])
                st.finish_run(db, run.id, "done", decode_s=0.01)

        threads = [threading.Thread(target=loop, args=(f"{worker}-t{i}",)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return claims


def open_and_report(path: str, start_at: float) -> str:
    time.sleep(max(0.0, start_at - time.time()))
    with st.open_database(path) as db:
        st.create_project(db, "from a racing process")
        with db.engine.connect() as conn:
            return conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()


def warm(delay: float) -> int:
    time.sleep(delay)
    return os.getpid()


@pytest.fixture(scope="module")
def pool():
    with mp.get_context("spawn").Pool(3) as pool:
        pool.map(warm, [0.2] * 3)  # every process started and imported this module (and storage)
        yield pool


def queue_runs(path) -> list[int]:
    with st.open_database(path) as db:
        return [st.enqueue_run(db, mode="generate", method="ar", model="m").id for _ in range(N_RUNS)]


def check_claims(path, run_ids, claims) -> None:
    counts = Counter(run_id for _, run_id in claims)
    assert sorted(counts) == run_ids and set(counts.values()) == {1}, "a run was claimed twice or never"
    with st.open_database(path) as db:
        for worker, run_id in claims:
            run = st.get_run(db, run_id)
            assert (run.status, run.worker_id, run.text) == ("done", worker, f"by {worker}")
        assert st.claim_next_run(db, "late") is None


def test_threads_claim_each_run_once(tmp_path):
    path = str(tmp_path / "studio.db")
    run_ids = queue_runs(path)
    claims = claim_all(path, "main", n_threads=4, start_at=time.time())
    check_claims(path, run_ids, claims)
    for name in {name for name, _ in claims}:  # handed out oldest first
        mine = [run_id for n, run_id in claims if n == name]
        assert mine == sorted(mine)


def test_processes_claim_each_run_once(tmp_path, pool):
    path = str(tmp_path / "studio.db")
    run_ids = queue_runs(path)
    start_at = time.time() + 0.3
    results = pool.starmap(claim_all, [(path, f"p{i}", 2, start_at) for i in range(3)])
    check_claims(path, run_ids, [c for claims in results for c in claims])
    assert sum(1 for claims in results if claims) >= 2, "expected the work to be shared"


def test_concurrent_first_open(tmp_path, pool):
    for attempt in range(3):  # several fresh files: each time three processes race to create the schema
        path = str(tmp_path / f"race{attempt}.db")
        start_at = time.time() + 0.2
        versions = pool.starmap(open_and_report, [(path, start_at)] * 3)
        with st.open_database(path) as db:
            assert len(st.list_projects(db)) == 3
            assert versions == [versions[0]] * 3
