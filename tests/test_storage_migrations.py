"""storage.db: choosing the database, SQLite settings, and the Alembic migrations."""

import os
import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

import storage as st
from storage.db import head_revision
from storage.models import Base

ROOT = Path(__file__).resolve().parents[1]
HEAD = head_revision()


def schema_diff(db):
    with db.engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)


def tables(db):
    return set(sa.inspect(db.engine).get_table_names()) - {"alembic_version"}


def test_migrations_match_models(tmp_path):
    with st.open_database(tmp_path / "studio.db") as db:
        assert db.current_revision() == HEAD
        assert tables(db) == set(Base.metadata.tables)
        assert schema_diff(db) == []


def test_reopen_is_a_noop(tmp_path):
    path = tmp_path / "studio.db"
    with st.open_database(path) as db:
        project = st.create_project(db, "Kept")
    with st.open_database(path) as db:
        assert db.current_revision() == HEAD
        assert [p.id for p in st.list_projects(db)] == [project.id]


def test_downgrade_to_base_and_back(tmp_path):
    with st.open_database(tmp_path / "studio.db") as db:
        db.downgrade("base")
        assert db.current_revision() is None and tables(db) == set()
        db.upgrade()
        assert db.current_revision() == HEAD and schema_diff(db) == []
        st.create_project(db, "Works again")


def test_sqlite_pragmas(tmp_path):
    with st.open_database(tmp_path / "studio.db") as db:
        with db.engine.connect() as a, db.engine.connect() as b:  # every pooled connection
            for conn in (a, b):
                pragma = lambda name: conn.exec_driver_sql(f"PRAGMA {name}").scalar()
                assert pragma("journal_mode") == "wal"
                assert pragma("foreign_keys") == 1
                assert pragma("busy_timeout") == 10_000


def test_where_the_database_lives(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TOKENSWIFT_DB", raising=False)
    assert st.resolve_url().database == str(Path("data") / "studio.db")
    assert (tmp_path / "data").is_dir()  # parent folder created

    monkeypatch.setenv("TOKENSWIFT_DB", str(tmp_path / "env" / "x.db"))
    assert st.resolve_url().database == str(tmp_path / "env" / "x.db")
    assert st.resolve_url(tmp_path / "arg.db").database == str(tmp_path / "arg.db")  # argument wins

    url = st.resolve_url("postgresql+psycopg://u:p@host/studio")
    assert (url.get_backend_name(), url.database) == ("postgresql", "studio")
    with st.open_database(f"sqlite:///{tmp_path}/sub/url.db") as db:
        assert db.current_revision() == HEAD


def test_open_without_migrating(tmp_path):
    with st.open_database(tmp_path / "studio.db", migrate=False) as db:
        assert db.current_revision() is None and tables(db) == set()


def test_alembic_command_line(tmp_path):
    path = tmp_path / "cli.db"
    env = {**os.environ, "TOKENSWIFT_DB": str(path)}
    cmd = [sys.executable, "-m", "alembic", "-c", "storage/alembic.ini"]
    subprocess.run([*cmd, "upgrade", "head"], cwd=ROOT, env=env, check=True, capture_output=True)
    out = subprocess.run([*cmd, "current"], cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    assert HEAD in out.stdout
    with st.open_database(path) as db:
        assert schema_diff(db) == []
