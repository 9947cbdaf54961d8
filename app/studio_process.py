"""`app.py` as a child process: started on a free port and a given database, waited on until its page answers and
its worker is ready, stopped gracefully. Used by the page benchmark (app/page_bench.py) and the browser and API
tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import storage

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180  # imports + migrations + loading a model, on a busy 2-core machine


@dataclass
class StudioServer:
    url: str
    db_path: Path | str  # a SQLite file or a SQLAlchemy URL
    log_path: Path
    proc: subprocess.Popen

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_ready(db_path: Path | str) -> bool:
    """Whether a worker on this database (a file or a URL) says it is ready (False while the file or its tables do
    not exist)."""
    if isinstance(db_path, Path) and not db_path.exists():
        return False
    with storage.open_database(db_path, migrate=False) as db:
        try:
            return any(s.state == "ready" for s in storage.get_worker_states(db))
        except Exception:  # tables not created yet
            return False


@contextmanager
def studio_server(db_path: Path | str, log_path: Path, *, port: int | None = None, args: tuple[str, ...] = (),
                  env: Mapping[str, str] | None = None,
                  start_timeout_s: float = START_TIMEOUT_S) -> Iterator[StudioServer]:
    """Run `python app.py --port P --db DB *args` until the page answers and the worker is ready; stop it (SIGTERM)
    after. Its output goes to `log_path`; a server that exits or does not become ready raises with the log's end."""
    port = port or free_port()
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1", **(env or {})}
    env.pop("GRADIO_SERVER_PORT", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port), "--db", str(db_path), *args],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = StudioServer(f"http://127.0.0.1:{port}/", db_path, log_path, proc)
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"app.py exited with {proc.returncode}:\n{server.log()}")
            try:
                with urllib.request.urlopen(server.url, timeout=5) as r:
                    if r.status == 200 and worker_ready(db_path):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"app.py did not become ready in {start_timeout_s:g} s:\n{server.log()}")
            time.sleep(0.5)
        yield server
    finally:
        stop_server(server)


def stop_server(server: StudioServer, timeout: float = 40) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)  # graceful: the worker saves its run as interrupted
        try:
            server.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)
