"""storage's story memory on SQLite and PostgreSQL: summaries (the writer's and the model's, streamed by a summary
run that never touches the chapter's text), the lorebook, applying an outline, and a project's JSON snapshot and its
import (all or nothing)."""
from __future__ import annotations

import json

import pytest

import storage as st

MODEL = "tiny"
A, B = "key:" + "a" * 64, "hf:bea"
SETTINGS = {"max_new_tokens": 40, "seed": 1}


@pytest.fixture
def db(any_db):
    return any_db


@pytest.fixture
def book(db):
    project = st.create_project(db, "The Keeper", premise="A keeper.", owner=A)
    first = st.add_chapter(db, project.id, "The bottle", "She finds it.", owner=A)
    second = st.add_chapter(db, project.id, "The reply", owner=A)
    st.set_chapter_text(db, first.id, "Dawn came grey over the rocks.", owner=A)
    return project, first, second


def run_summary(db, run_id, pieces):
    """Play the worker's part: claim the run, stream `pieces`, finish it."""
    claimed = st.claim_next_run(db, "w1")
    assert claimed.id == run_id
    for piece in pieces:
        st.append_output(db, run_id, piece, [1])
    return st.finish_run(db, run_id, "done")


def test_a_summary_run_writes_the_summary_and_leaves_the_chapter_alone(db, book):
    project, first, _ = book
    chapter_run = st.start_chapter_run(db, first.id, "continue", method="ar", model=MODEL, settings=SETTINGS,
                                       owner=A)
    st.claim_next_run(db, "w0")
    st.finish_run(db, chapter_run.id, "done")
    before = st.get_chapter(db, first.id)
    run = st.queue_summary(db, first.id, model=MODEL, settings=SETTINGS, owner=A)
    assert (run.mode, run.summary_of, run.chapter_id, run.project_id, run.owner) == (
        "summary", first.id, None, project.id, A)
    with pytest.raises(st.ValidationError, match="already being written"):
        st.queue_summary(db, first.id, model=MODEL, settings=SETTINGS, owner=A)
    assert st.queue_summary(db, first.id, model=MODEL, settings=SETTINGS, owner=A, auto=True) is None
    run_summary(db, run.id, ["She finds ", "a bottle."])
    after = st.get_chapter(db, first.id)
    assert (after.summary, after.summary_source) == ("She finds a bottle.", "model")
    assert (after.text, after.status, after.word_count) == (before.text, before.status, before.word_count)
    # The summary run is not the chapter's run: Resume, Stop and the status line keep to the chapter's own.
    assert st.latest_run_for_chapter(db, first.id).id == chapter_run.id
    assert st.summary_run(db, first.id).id == run.id
    assert st.list_revisions(db, first.id, A) == []


def test_the_writers_summary_is_kept_from_automatic_ones(db, book):
    project, first, second = book
    st.set_summary(db, first.id, "  My own summary.  ", owner=A)
    chapter = st.get_chapter(db, first.id)
    assert (chapter.summary, chapter.summary_source) == ("My own summary.", "writer")
    assert st.queue_summary(db, first.id, model=MODEL, settings=SETTINGS, owner=A, auto=True) is None
    run = st.queue_summary(db, first.id, model=MODEL, settings=SETTINGS, owner=A)  # asked for: replaces it
    with pytest.raises(st.ValidationError, match="writing this chapter's summary"):
        st.set_summary(db, first.id, "Edited meanwhile.", owner=A)
    run_summary(db, run.id, ["The model's."])
    assert st.get_chapter(db, first.id).summary_source == "model"
    st.set_summary(db, first.id, "", owner=A)
    assert (st.get_chapter(db, first.id).summary, st.get_chapter(db, first.id).summary_source) == ("", "")
    # Nothing to summarize, automatic summaries off, another writer's chapter.
    with pytest.raises(st.ValidationError, match="no text to summarize"):
        st.queue_summary(db, second.id, model=MODEL, settings=SETTINGS, owner=A)
    st.update_project(db, project.id, auto_summary=False, owner=A)
    assert st.queue_summary(db, first.id, model=MODEL, settings=SETTINGS, owner=A, auto=True) is None
    with pytest.raises(st.NotFoundError):
        st.queue_summary(db, first.id, model=MODEL, settings=SETTINGS, owner=B)
    with pytest.raises(st.NotFoundError):
        st.set_summary(db, first.id, "Stolen", owner=B)


def test_summary_runs_count_toward_the_writers_queue_and_go_with_their_chapter(db, book):
    _, first, _ = book
    st.start_chapter_run(db, first.id, "continue", method="ar", model=MODEL, settings=SETTINGS, owner=A,
                         max_queued=1)
    with pytest.raises(st.ValidationError, match="waiting in the queue"):
        st.queue_summary(db, first.id, model=MODEL, settings=SETTINGS, owner=A, max_queued=1)
    run = st.queue_summary(db, first.id, model=MODEL, settings=SETTINGS, owner=A)
    st.delete_chapter(db, first.id, A)
    gone = st.get_run(db, run.id)
    assert gone.status == "cancelled" and gone.summary_of is None


def test_the_lorebook_is_saved_whole_in_order_and_checked(db, book):
    project, *_ = book
    rows = st.set_lore(db, project.id, [
        {"name": "Mara", "keywords": " Mara , keeper,, mara ", "text": "The keeper."},
        {"name": "", "keywords": "", "text": ""},  # a blank table row
        {"name": "Port Ellis", "keywords": "Port  Ellis", "text": ""},
    ], owner=A)
    assert len(rows) == 2
    lore = st.list_lore(db, project.id, A)
    assert [(e.position, e.name, e.keywords, e.text) for e in lore] == [
        (0, "Mara", "Mara, keeper", "The keeper."), (1, "Port Ellis", "Port Ellis", "")]
    for entries, message in (([{"name": "", "keywords": "x", "text": "y"}], "needs a name"),
                             ([{"name": "Mara", "keywords": " , ", "text": "y"}], "at least one keyword"),
                             ([{"name": "Mara", "keywords": "a"}, {"name": "mara", "keywords": "b"}], "named"),
                             ("Mara", "list of at most"),
                             ([{"name": "X", "keywords": "x", "text": "t" * 10_001}], "too long")):
        with pytest.raises(st.ValidationError, match=message):
            st.set_lore(db, project.id, entries, owner=A)
    assert [e.name for e in st.list_lore(db, project.id, A)] == ["Mara", "Port Ellis"]  # refusals change nothing
    with pytest.raises(st.NotFoundError):
        st.set_lore(db, project.id, [], owner=B)
    st.set_lore(db, project.id, [], owner=A)
    assert st.list_lore(db, project.id, A) == []
    with pytest.raises(st.ValidationError, match="lorebook's share"):
        st.update_project(db, project.id, lore_tokens=-1, owner=A)
    assert st.update_project(db, project.id, lore_tokens=123, owner=A).lore_tokens == 123


def test_applying_an_outline_updates_and_adds_chapters_and_keeps_their_text(db, book):
    project, _, second = book
    added, updated = st.apply_outline(db, project.id, [
        ("", "She finds a bottle at dawn."),  # keeps its title
        ("", ""),  # skipped
        ("The storm", "The lamp fails."),
        ("Silence", ""),
    ], owner=A)
    # Rows: [0] updates chapter 1's instructions; [2] and [3] become positions 1 and 2 (blank rows do not count).
    assert (added, updated) == (1, 2)
    chapters = st.list_chapters(db, project.id, with_text=True, owner=A)
    assert [(c.title, c.instructions) for c in chapters] == [
        ("The bottle", "She finds a bottle at dawn."), ("The storm", "The lamp fails."), ("Silence", "")]
    assert chapters[0].text == "Dawn came grey over the rocks." and chapters[1].id == second.id
    assert st.apply_outline(db, project.id, [("The bottle", "She finds a bottle at dawn.")], owner=A) == (0, 0)
    with pytest.raises(st.ValidationError, match="outline is empty"):
        st.apply_outline(db, project.id, [("", " ")], owner=A)
    with pytest.raises(st.NotFoundError):
        st.apply_outline(db, project.id, [("Stolen", "")], owner=B)


def test_a_project_moves_between_studios_as_json(db, book, tmp_path):
    project, first, _ = book
    st.update_project(db, project.id, goal_words=50_000, lore_tokens=250, settings={"seed": 9}, owner=A)
    st.set_chapter_text(db, first.id, "Dawn came grey over the rocks. Then the bottle.", owner=A)  # a revision
    st.set_summary(db, first.id, "The bottle arrives.", owner=A)
    st.set_lore(db, project.id, [{"name": "Mara", "keywords": "Mara", "text": "The keeper."}], owner=A)
    snapshot = st.project_snapshot(db, project.id, A)
    text = json.dumps(snapshot)  # JSON-ready
    with pytest.raises(st.NotFoundError):
        st.project_snapshot(db, project.id, B)

    copy = st.import_project(db, json.loads(text), owner=B)
    assert copy.id != project.id and copy.owner == B
    again = st.project_snapshot(db, copy.id, B)
    for part in ("project", "chapters", "lore"):
        assert again[part] == snapshot[part]
    chapters = st.list_chapters(db, copy.id, with_text=True, owner=B)
    assert [c.word_count for c in chapters] == [c.word_count for c in st.list_chapters(db, project.id, owner=A)]
    assert [r.text for r in st.list_revisions(db, chapters[0].id, B)] == ["Dawn came grey over the rocks."]


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(format="something else"), "not a TokenSwift Studio project"),
    (lambda s: s.update(version=99), "version 99"),
    (lambda s: s["project"].update(title=""), "title cannot be empty"),
    (lambda s: s["project"].update(kind="poem"), "Unknown project kind"),
    (lambda s: s["chapters"][1].update(text=7), "text of chapter 2 must be text"),
    (lambda s: s["chapters"][0]["revisions"].append({"text": "x", "created_at": "yesterday"}), "created_at"),
    (lambda s: s["lore"].append({"name": "Gull Rock", "keywords": ""}), "at least one keyword"),
    (lambda s: s.update(chapters="no"), "chapters must be a list"),
])
def test_a_bad_project_file_is_refused_and_adds_nothing(db, book, change, message):
    project, _, _ = book
    st.set_lore(db, project.id, [{"name": "Mara", "keywords": "Mara", "text": "The keeper."}], owner=A)
    snapshot = st.project_snapshot(db, project.id, A)
    change(snapshot)
    with pytest.raises(st.ValidationError, match=message):
        st.import_project(db, snapshot, owner=B)
    assert st.list_projects(db, B) == []
    with pytest.raises(st.ValidationError, match="JSON object"):
        st.import_project(db, [1, 2], owner=B)


def test_one_outline_at_a_time_per_project(db, book):
    project, *_ = book
    run = st.queue_outline(db, project.id, model=MODEL, settings=SETTINGS, prompt="Plan it.", owner=A)
    assert (run.mode, run.project_id, run.chapter_id, run.owner, run.prompt) == ("outline", project.id, None, A,
                                                                               "Plan it.")
    with pytest.raises(st.ValidationError, match="already being written"):
        st.queue_outline(db, project.id, model=MODEL, settings=SETTINGS, prompt="Again.", owner=A)
    with pytest.raises(st.NotFoundError):
        st.queue_outline(db, project.id, model=MODEL, settings=SETTINGS, prompt="Stolen.", owner=B)
    st.request_cancel(db, run.id, A)
    st.add_chapter(db, project.id, owner=A)
    st.start_chapter_run(db, st.list_chapters(db, project.id, owner=A)[-1].id, "generate", method="ar", model=MODEL,
                         settings=SETTINGS, owner=A)
    with pytest.raises(st.ValidationError, match="waiting in the queue"):
        st.queue_outline(db, project.id, model=MODEL, settings=SETTINGS, prompt="Plan it.", owner=A, max_queued=1)
    assert st.queue_outline(db, project.id, model=MODEL, settings=SETTINGS, prompt="Plan it.", owner=A).id != run.id
