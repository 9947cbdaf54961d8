"""storage.db: choosing the database, SQLite settings, and the Alembic migrations."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
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


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    """Where a fresh database is made: a SQLite file, or a new database on the real PostgreSQL server."""
    return tmp_path / "studio.db" if request.param == "sqlite" else request.getfixturevalue("postgres").create_database()


def test_migrations_match_models(url):
    with st.open_database(url) as db:
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


def test_downgrade_to_base_and_back(url):
    with st.open_database(url) as db:
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


def test_a_single_user_database_upgrades_with_its_projects_intact(url):
    """A database made before ownership (schema 0001) keeps every project, chapter, run and comparison, all the
    local writer's: a laptop's studio looks as before."""
    with st.open_database(url) as db:
        db.downgrade("0001")
        with db.engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO projects (id, title, kind, premise, settings, created_at, updated_at) "
                                 "VALUES (7, 'Old novel', 'novel', 'p', '{}', '2026-01-01', '2026-01-01')")
            conn.exec_driver_sql("INSERT INTO chapters (id, project_id, position, title, instructions, text, "
                                 "word_count, status, created_at, updated_at) VALUES (3, 7, 0, 'One', '', "
                                 "'Old text.', 2, 'draft', '2026-01-01', '2026-01-01')")
            conn.exec_driver_sql("INSERT INTO comparisons (id, prompt, settings, created_at) "
                                 "VALUES (5, 'p', '{}', '2026-01-01')")
            conn.exec_driver_sql("INSERT INTO runs (id, project_id, chapter_id, mode, method, model, settings, status, "
                                 "cancel_requested, queued_at, n_tokens, text, token_ids) VALUES (9, 7, 3, 'generate', "
                                 "'ar', 'm', '{}', 'done', FALSE, '2026-01-01', 2, 'Old text.', '[1,2]')")
    with st.open_database(url) as db:
        assert db.current_revision() == HEAD and schema_diff(db) == []
        assert [p.title for p in st.list_projects(db, st.LOCAL_OWNER)] == ["Old novel"]
        assert st.get_chapter(db, 3, st.LOCAL_OWNER).text == "Old text."
        assert [r.id for r in st.list_runs(db, owner=st.LOCAL_OWNER)] == [9]
        assert st.get_run_token_ids(db, 9) == [1, 2]
        assert [c.id for c in st.list_comparisons(db, owner=st.LOCAL_OWNER)] == [5]
        assert st.list_projects(db, "hf:someone") == []


def test_comparisons_made_before_divergences_were_stored_upgrade_and_downgrade(url):
    """Schema 0005 adds where a comparison's runs differ (comparisons.divergence): an older comparison reads with
    none, gets one stored, and keeps its verdict when the column goes again."""
    found = {"position": 4, "vanilla_token": 7, "tokenswift_token": 8, "top1": 7, "top2": None, "gap": None,
             "logit_gap": 1.5}
    with st.open_database(url) as db:
        db.downgrade("0004")
        assert "divergence" not in {c["name"] for c in sa.inspect(db.engine).get_columns("comparisons")}
        with db.engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO comparisons (id, prompt, settings, ar_run_id, tokenswift_run_id, "
                                 "tokens_match, first_divergence, created_at) "
                                 "VALUES (5, 'p', '{}', 1, 2, FALSE, 4, '2026-01-01')")
    with st.open_database(url) as db:
        assert db.current_revision() == HEAD and schema_diff(db) == []
        old = st.get_comparison(db, 5)
        assert (old.tokens_match, old.first_divergence, old.divergence) == (False, 4, {})
        assert st.set_comparison_divergence(db, 5, found).divergence == found
        assert st.get_comparison(db, 5).divergence == found
        db.downgrade("0004")
        assert "divergence" not in {c["name"] for c in sa.inspect(db.engine).get_columns("comparisons")}
        with db.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT tokens_match, first_divergence FROM comparisons").all() == [(False, 4)]
        db.upgrade()
        assert st.get_comparison(db, 5).divergence == {}
