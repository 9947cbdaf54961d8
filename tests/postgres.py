"""A real PostgreSQL server for the tests: Debian's `postgresql` binaries, a throwaway data directory, a Unix socket
only (no TCP port to collide with), started once per test session and stopped after.

Run as root (CI, containers), the server runs as the `postgres` system user, which PostgreSQL requires. Without the
binaries the PostgreSQL tests are skipped, unless $CI is set (then they fail): `make postgres` installs them.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 60
PORT = 5432  # only names the socket file (.s.PGSQL.5432) inside our own folder


@dataclass(frozen=True)
class PostgresServer:
    socket_dir: Path
    user: str

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{self.user}@/{database}?host={self.socket_dir}&port={PORT}"

    def create_database(self) -> str:
        """A fresh, empty database; returns its SQLAlchemy URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(host=str(self.socket_dir), port=PORT, user=self.user, dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def binaries() -> Path | None:
    """The folder of `initdb` and `postgres` (Debian keeps them out of PATH), or None."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(versions[-1]).parent if versions else None


def _as_server_user(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    return ["runuser", "-u", "postgres", "--", *cmd]


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """initdb into a fresh folder, start the server on a socket in it, yield, stop it (fast shutdown), clean up.

    The folder is made directly under the system's temp dir: pytest's own temp dirs are private to the test user,
    and the server runs as another.
    """
    bin_dir = binaries()
    if bin_dir is None:
        raise FileNotFoundError("PostgreSQL's initdb/postgres are not installed (`make postgres`)")
    folder = Path(tempfile.mkdtemp(prefix="tokenswift-pg-"))
    data, sock, log = folder / "data", folder / "socket", folder / "server.log"
    sock.mkdir()
    user = "postgres" if os.geteuid() == 0 else os.environ.get("USER", "postgres")
    if os.geteuid() == 0:
        shutil.chown(folder, "postgres")
        shutil.chown(sock, "postgres")
    subprocess.run(_as_server_user([str(bin_dir / "initdb"), "-D", str(data), "-U", user, "--auth=trust",
                                    "--no-sync", "-E", "UTF8"]), check=True, capture_output=True)
    server = subprocess.Popen(_as_server_user([str(bin_dir / "postgres"), "-D", str(data), "-k", str(sock),
                                               "-p", str(PORT), "-c", "listen_addresses=", "-c", "fsync=off",
                                               "-c", "max_connections=200"]),
                              stdout=subprocess.DEVNULL, stderr=log.open("w"))
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (sock / f".s.PGSQL.{PORT}").exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield PostgresServer(sock, user)
    finally:
        server.send_signal(signal.SIGINT)  # a "fast" shutdown: SIGTERM's "smart" one waits for every client
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
