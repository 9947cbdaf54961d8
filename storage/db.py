"""Opening the database: engine, SQLite settings, sessions and migrations.

``open_database()`` picks the database (argument, else ``$TOKENSWIFT_DB``, else
``data/studio.db``), configures every SQLite connection (WAL, foreign keys, busy
timeout) and brings the schema to the newest Alembic revision. Several
processes may open the same file at once: migrations run inside one
``BEGIN IMMEDIATE`` transaction, so a second process waits, then finds nothing
to do.

Writing a new migration after changing ``storage/models.py`` (from the repo root)::

    TOKENSWIFT_DB=/tmp/scratch.db python -m alembic -c storage/alembic.ini upgrade head
    TOKENSWIFT_DB=/tmp/scratch.db python -m alembic -c storage/alembic.ini revision --autogenerate -m "what changed"
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

from .errors import StorageError

ENV_VAR = "TOKENSWIFT_DB"
DEFAULT_PATH = Path("data") / "studio.db"
MIGRATIONS_DIR = Path(__file__).parent / "migrations"
BUSY_TIMEOUT_MS = 10_000
_BEGIN = "studio_begin"  # execution option: the BEGIN statement SQLite transactions start with


def resolve_url(url_or_path: str | os.PathLike | None = None) -> URL:
    """A SQLAlchemy URL from a URL or a file path (argument, else $TOKENSWIFT_DB, else data/studio.db).

    For a SQLite file the parent folder is created.
    """
    value = str(url_or_path or os.environ.get(ENV_VAR) or DEFAULT_PATH)
    url = make_url(value) if "://" in value else URL.create("sqlite", database=value)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    return url


def alembic_config() -> Config:
    """A programmatic Alembic config for ``storage/migrations`` (no alembic.ini needed)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    return cfg


def head_revision() -> str | None:
    """The newest migration's revision id."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def _enable_wal(cur: sqlite3.Cursor) -> None:
    # WAL is persistent, so usually this is a no-op read. Switching needs an
    # exclusive lock and, unlike other statements, fails at once with "database is
    # locked" instead of waiting: processes racing to open a new file retry.
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while cur.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
        try:
            cur.execute("PRAGMA journal_mode = WAL")
        except sqlite3.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def on_connect(dbapi_conn, _record) -> None:
        # sqlite3's own transaction handling skips BEGIN for SELECT and DDL; we emit
        # BEGIN ourselves (below) so reads are consistent and DDL is transactional.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")  # first: the next ones may wait for a lock
        if engine.url.database not in (None, "", ":memory:"):
            _enable_wal(cur)  # readers (the UI) never block the writer (the worker)
        cur.execute("PRAGMA synchronous = NORMAL")  # durable enough with WAL, far fewer fsyncs per append
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def on_begin(conn: Connection) -> None:
        # Write transactions use BEGIN IMMEDIATE: they take the write lock up front
        # (waiting up to busy_timeout) instead of failing with SQLITE_BUSY when a
        # read turns into a write while another process writes.
        conn.exec_driver_sql(conn.get_execution_options().get(_BEGIN, "BEGIN"))


class Database:
    """An engine plus session factories. Use ``read()`` for queries, ``write()`` for changes."""

    def __init__(self, url: str | URL) -> None:
        self.url = make_url(url)
        self.engine = create_engine(self.url)
        self.is_sqlite = self.engine.dialect.name == "sqlite"
        writer = self.engine
        if self.is_sqlite:
            _configure_sqlite(self.engine)
            writer = self.engine.execution_options(**{_BEGIN: "BEGIN IMMEDIATE"})
        self._readers = sessionmaker(self.engine, expire_on_commit=False)
        self._writers = sessionmaker(writer, expire_on_commit=False)

    def read(self) -> Session:
        """A session for reading (``with db.read() as s: ...``); it sees one consistent snapshot."""
        return self._readers()

    def write(self) -> AbstractContextManager[Session]:
        """A session inside a write transaction, committed on success (``with db.write() as s:``)."""
        return self._writers.begin()

    def current_revision(self) -> str | None:
        """The schema's migration revision (None for an empty database)."""
        with self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    def upgrade(self, revision: str = "head") -> None:
        """Apply migrations up to ``revision``."""
        self._alembic(command.upgrade, revision)

    def downgrade(self, revision: str) -> None:
        """Revert migrations down to ``revision`` ("base" drops every table)."""
        self._alembic(command.downgrade, revision)

    def _alembic(self, fn: Callable[[Config, str], None], revision: str) -> None:
        cfg = alembic_config()
        with self.migration_connection() as conn:
            cfg.attributes["connection"] = conn
            fn(cfg, revision)

    @contextmanager
    def migration_connection(self) -> Iterator[Connection]:
        """A connection inside one exclusive transaction, for running migrations."""
        with self.engine.connect() as conn:
            raw: Any = conn.connection.driver_connection
            if self.is_sqlite:
                # Batch migrations rebuild tables (copy, drop, rename); with foreign
                # keys on, dropping a parent table would cascade-delete its children.
                # The pragma is ignored inside a transaction, so set it before BEGIN.
                raw.execute("PRAGMA foreign_keys = OFF")
            try:
                with conn.execution_options(**{_BEGIN: "BEGIN IMMEDIATE"}).begin():
                    if self.engine.dialect.name == "postgresql":
                        # Serialize concurrent upgrades; released at commit.
                        conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7171)")
                    yield conn
                    # Foreign keys were off during the migration: refuse to commit dangling references.
                    if self.is_sqlite and (bad := conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()):
                        raise StorageError(f"Migration left rows with broken foreign keys: {bad[:5]}")
            finally:
                if self.is_sqlite:
                    raw.execute("PRAGMA foreign_keys = ON")

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_database(url_or_path: str | os.PathLike | None = None, *, migrate: bool = True) -> Database:
    """Open (creating if needed) the studio database and migrate it to the newest schema.

    ``url_or_path`` is a file path or a SQLAlchemy URL (e.g. ``postgresql+psycopg://...``);
    when omitted, ``$TOKENSWIFT_DB`` or ``data/studio.db`` (relative to the current dir).
    """
    db = Database(resolve_url(url_or_path))
    # Check without a lock first: reopening an up-to-date database must not queue
    # behind a busy worker for the write lock that upgrade() takes.
    if migrate and db.current_revision() != head_revision():
        db.upgrade("head")
    return db
