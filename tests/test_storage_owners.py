"""storage: every project, chapter, comparison and run is its writer's; another writer's id is "not found" and
changes nothing; per-writer queue limits and one running run per writer; migrating a single-user database."""
from __future__ import annotations

import pytest

import storage as st

A, B = "key:" + "a" * 64, "hf:bea"
MODEL = "tiny"


@pytest.fixture
def db(any_db):
    """Every test here runs on SQLite and on a real PostgreSQL server."""
    return any_db


@pytest.fixture
def two(db):
    """A's project with a written chapter and a finished run; B's project."""
    pa = st.create_project(db, "Alpha", premise="A's premise", owner=A)
    ca = st.add_chapter(db, pa.id, "One", owner=A)
    st.set_chapter_text(db, ca.id, "A's first text.", owner=A)
    st.set_chapter_text(db, ca.id, "A's text.", owner=A)  # the first becomes a revision
    pb = st.create_project(db, "Beta", owner=B)
    st.add_chapter(db, pb.id, owner=B)
    return pa, ca, pb


def test_listings_show_only_the_writers_rows(db, two):
    pa, ca, pb = two
    assert [p.title for p in st.list_projects(db, A)] == ["Alpha"]
    assert [p.title for p in st.list_projects(db, B)] == ["Beta"]
    assert {p.title for p in st.list_projects(db)} == {"Alpha", "Beta"}  # unscoped: the worker and tools
    assert st.list_projects(db, "key:" + "c" * 64) == []
    assert [c.id for c in st.list_chapters(db, pa.id, owner=A)] == [ca.id]
    assert st.list_chapters(db, pa.id, owner=B) == []


def test_another_writers_ids_are_not_found_and_change_nothing(db, two):
    pa, ca, pb = two
    missing = 10_000
    revision = st.list_revisions(db, ca.id, A)[0].id
    with pytest.raises(st.NotFoundError) as absent:
        st.get_project(db, missing, B)
    refusals = [
        lambda: st.get_project(db, pa.id, B),
        lambda: st.rename_project(db, pa.id, "Stolen", B),
        lambda: st.update_project(db, pa.id, premise="Stolen", owner=B),
        lambda: st.delete_project(db, pa.id, B),
        lambda: st.add_chapter(db, pa.id, "Intruder", owner=B),
        lambda: st.get_chapter(db, ca.id, B),
        lambda: st.update_chapter(db, ca.id, title="Stolen", owner=B),
        lambda: st.set_chapter_text(db, ca.id, "overwritten", owner=B),
        lambda: st.list_revisions(db, ca.id, B),
        lambda: st.get_revision(db, revision, B),
        lambda: st.restore_revision(db, revision, B),
        lambda: st.move_chapter(db, ca.id, 5, B),
        lambda: st.delete_chapter(db, ca.id, B),
        lambda: st.start_chapter_run(db, ca.id, "generate", method="ar", model=MODEL, owner=B),
        lambda: st.latest_run_for_chapter(db, ca.id, B),
        lambda: st.create_comparison(db, "p", model=MODEL, project_id=pa.id, owner=B),
    ]
    for refuse in refusals:
        with pytest.raises(st.NotFoundError) as e:
            refuse()
        # The same words as for an id that does not exist: nothing tells B that A's project is there.
        assert str(e.value).split(" ")[0] in ("Project", "Chapter", "ChapterRevision")
        assert "does not exist" in str(e.value) and str(e.value).count(" ") == str(absent.value).count(" ")
    project, chapter = st.get_project(db, pa.id), st.get_chapter(db, ca.id)
    assert (project.title, project.premise) == ("Alpha", "A's premise")
    assert (chapter.title, chapter.text, chapter.position) == ("One", "A's text.", 0)
    assert [r.text for r in st.list_revisions(db, ca.id, A)] == ["A's first text."]
    assert st.list_runs(db) == [] and st.list_comparisons(db) == []


def test_runs_and_comparisons_belong_to_their_writer(db, two):
    pa, ca, pb = two
    run = st.start_chapter_run(db, ca.id, "generate", method="ar", model=MODEL, owner=A)
    assert run.owner == A  # the chapter's writer
    comparison = st.create_comparison(db, "A prompt", model=MODEL, owner=B)
    assert comparison.owner == B and {r.owner for r in st.list_runs(db, owner=B)} == {B}
    assert [r.id for r in st.list_runs(db, owner=A)] == [run.id]
    for fn in (lambda: st.get_run(db, run.id, B), lambda: st.request_cancel(db, run.id, B),
               lambda: st.get_comparison(db, comparison.id, A)):
        with pytest.raises(st.NotFoundError):
            fn()
    assert st.get_run(db, run.id).status == "queued"  # B's cancel changed nothing
    assert st.list_comparisons(db, owner=A) == []
    assert st.request_cancel(db, run.id, A) == "cancelled"


def test_signing_in_takes_the_browsers_projects_along(db, two):
    pa, ca, pb = two
    st.start_chapter_run(db, ca.id, "generate", method="ar", model=MODEL, owner=A)
    st.create_comparison(db, "A prompt", model=MODEL, owner=A)
    assert st.transfer_projects(db, A, "hf:alice") == 1
    assert [p.id for p in st.list_projects(db, "hf:alice")] == [pa.id] and st.list_projects(db, A) == []
    assert len(st.list_runs(db, owner="hf:alice")) == 3 and len(st.list_comparisons(db, owner="hf:alice")) == 1
    assert st.get_chapter(db, ca.id, "hf:alice").text == "A's text."
    assert [p.id for p in st.list_projects(db, B)] == [pb.id]
    with pytest.raises(st.ValidationError):
        st.transfer_projects(db, A, "")


def test_per_writer_queue_limit(db):
    projects = {w: st.create_project(db, w, owner=w) for w in (A, B)}
    chapters = {w: [st.add_chapter(db, projects[w].id, owner=w) for _ in range(3)] for w in (A, B)}
    for c in chapters[A][:2]:
        st.start_chapter_run(db, c.id, "generate", method="ar", model=MODEL, owner=A, max_queued=2)
    with pytest.raises(st.ValidationError, match="2 run\\(s\\) waiting.*at most 2 per writer"):
        st.start_chapter_run(db, chapters[A][2].id, "generate", method="ar", model=MODEL, owner=A, max_queued=2)
    with pytest.raises(st.ValidationError, match="at most 2"):  # a comparison is two runs
        st.create_comparison(db, "p", model=MODEL, owner=A, max_queued=2)
    assert len(st.list_runs(db, owner=A)) == 2
    # B's queue is B's own; and a started run frees a place in A's.
    st.create_comparison(db, "p", model=MODEL, owner=B, max_queued=2)
    assert st.claim_next_run(db, "w1").owner == A
    st.start_chapter_run(db, chapters[A][2].id, "generate", method="ar", model=MODEL, owner=A, max_queued=2)


def test_a_writer_runs_one_run_at_a_time(db):
    """With several workers, a writer's second run waits while their first runs; other writers' runs go ahead.
    The local writer of a single-user studio may use every worker."""
    runs = {}
    for w in (A, B, st.LOCAL_OWNER):
        project = st.create_project(db, w, owner=w)
        runs[w] = [st.start_chapter_run(db, st.add_chapter(db, project.id).id, "generate", method="ar",
                                        model=MODEL).id for _ in range(2)]
    order = [st.claim_next_run(db, f"w{i}") for i in range(6)]
    claimed = [r.id for r in order if r is not None]
    assert claimed == [runs[A][0], runs[B][0], runs[st.LOCAL_OWNER][0], runs[st.LOCAL_OWNER][1]]
    assert order[4] is None and order[5] is None
    st.finish_run(db, runs[B][0], "done")
    assert st.claim_next_run(db, "w0").id == runs[B][1]
    assert st.claim_next_run(db, "w0") is None  # A's first is still running


def test_bad_owner_values_are_refused(db):
    for owner in ("", "x" * 101, None):
        with pytest.raises(st.ValidationError):
            st.create_project(db, "T", owner=owner)
    assert st.list_projects(db) == []
