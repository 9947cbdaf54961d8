"""The story's memory in the UI handlers (app.story_ui) on a real SQLite file: the summary box and its live poll, the
prompt line, the Story bible tab (lorebook, outline proposal and apply, switching projects), and a project file
exported and imported. Runs are played by hand as a worker would (no model)."""
from __future__ import annotations

import json
from pathlib import Path

import gradio as gr
import pytest

import storage
from app import live
from app.live import LiveCache, View
from app.story_ui import StoryHandlers
from app.ui import Handlers, StudioContext

MODEL = "tiny"


@pytest.fixture
def h(db):
    handlers = Handlers(StudioContext(db=db, model=MODEL))
    with gr.Blocks():
        from app import settings_panel

        handlers.write_panel = settings_panel.build("write")
    return handlers


@pytest.fixture
def story(h):
    return StoryHandlers(h)


def open_book(h, view, title="Novel"):
    h.create_project(view, title, "novel", "A premise.")
    storage.set_chapter_text(h.db, view.chapter_id, "Mara climbed the stairs.")
    return view.project_id, view.chapter_id


def play(db, run_id, text):
    """A worker's part: claim `run_id`, write `text`, finish it."""
    assert storage.claim_next_run(db, "fake").id == run_id
    storage.append_output(db, run_id, text, [1, 2])
    storage.finish_run(db, run_id, "done")


def test_the_summary_box_follows_the_summary_run_and_keeps_the_writers_summary(h, story, db):
    view, cache = View(), LiveCache()
    _, chapter_id = open_book(h, view)
    up = live.poll_write(db, view, cache)
    assert up.summary == ("", True) and "No summary yet" in up.summary_note
    story.summarize(view, chapter_id)
    run = storage.summary_run(db, chapter_id)
    up = live.poll_write(db, view, cache, now=100.0)
    assert up.summary == ("", False) and "the model is writing this summary" in up.summary_note
    with pytest.raises(gr.Error, match="already being written"):
        story.summarize(view, chapter_id)
    play(db, run.id, "Mara climbs.")
    up = live.poll_write(db, view, cache, now=200.0)
    assert up.summary == ("Mara climbs.", True) and "Written by the model" in up.summary_note
    assert live.poll_write(db, view, cache, now=300.0).summary is None  # unchanged: never resent over typing
    story.save_summary(view, chapter_id, "My own words.")
    up = live.poll_write(db, view, cache, now=400.0)
    assert up.summary == ("My own words.", True) and "Your own summary" in up.summary_note
    with pytest.raises(gr.Error, match="switched project or chapter"):
        story.save_summary(view, chapter_id + 1, "Into another chapter.")
    h.add_chapter(view)
    with pytest.raises(gr.Error, match="no text to summarize"):
        story.summarize(view, view.chapter_id)


def test_the_status_line_says_what_went_into_the_prompt(h, db):
    view, cache = View(), LiveCache()
    _, chapter_id = open_book(h, view)
    run = storage.start_chapter_run(db, chapter_id, "continue", method="ar", model=MODEL, settings={"seed": 1})
    storage.claim_next_run(db, "fake")
    info = {"budget": 7000, "total": 900, "own_tokens": 10, "lore": ["Mara"], "lore_left_out": [], "lore_tokens": 9,
            "summaries": [], "summaries_left_out": [], "unsummarized": [], "summary_tokens": 0, "whole": [],
            "tail_chapter": None, "tail_tokens": 0, "text_tokens": 0}
    storage.set_run_prompt(db, run.id, "the prompt", info)
    status = live.poll_write(db, view, cache).status_html
    assert "prompt 900 of 7,000 tokens: 890 premise/lore (1 lore), 10 of this chapter" in status


def test_the_story_bible_saves_the_lorebook_and_refuses_a_stale_tab(h, story, db):
    view = View()
    project_id, _ = open_book(h, view)
    auto, share, lore, overview, _, owner = story.bible(view)
    assert auto["value"] is True and share["value"] == 400 and lore["value"] == [["", "", ""]] and owner == project_id
    assert "Mara climbed" not in overview and "no summary" in overview
    out = story.save_lore(view, owner, False, 250.0, [["Mara", "Mara, keeper", "The keeper."], ["", "", ""]])
    assert out[0]["value"] is False and out[1]["value"] == 250 and out[2]["value"] == [["Mara", "Mara, keeper",
                                                                                         "The keeper."]]
    with pytest.raises(gr.Error, match="needs at least one keyword"):
        story.save_lore(view, owner, True, 250, [["Mara", "", "The keeper."]])
    assert [e.name for e in storage.list_lore(db, project_id)] == ["Mara"]
    h.create_project(view, "Second", "novel", "")  # the page moved on while the tab showed the first project
    with pytest.raises(gr.Error, match="switched project"):
        story.save_lore(view, owner, True, 250, [["Intruder", "x", ""]])
    assert storage.list_lore(db, view.project_id) == [] and len(storage.list_lore(db, project_id)) == 1


def test_an_outline_is_proposed_shown_once_and_applied(h, story, db):
    view, cache = View(), LiveCache()
    project_id, chapter_id = open_book(h, view)
    _, table, *rest = story.refresh_outline(view, cache)
    assert table["value"] == [["", ""]] and rest[-1] == project_id  # the tab filled for this project
    status = story.propose_outline(view, project_id, 3)
    run = storage.latest_outline_run(db, project_id)
    assert "proposing an outline" in status and run.settings["max_new_tokens"] > 0
    play(db, run.id, "1. The Stairs: Mara climbs.\n2. The Lamp: It fails.\n3. Dawn: A ship.")
    status, table, *rest = story.refresh_outline(view, cache)
    assert "outline proposed by run" in status
    assert table["value"] == [["The Stairs", "Mara climbs."], ["The Lamp", "It fails."], ["Dawn", "A ship."]]
    assert story.refresh_outline(view, cache)[1] == gr.skip()  # shown once: the writer's edits stay
    story.apply_outline(view, project_id, [["The Stairs", "Mara climbs."], ["The Lamp", "It fails."], ["", ""]])
    chapters = storage.list_chapters(db, project_id, with_text=True)
    assert [(c.title, c.instructions) for c in chapters] == [("The Stairs", "Mara climbs."), ("The Lamp", "It fails.")]
    assert chapters[0].id == chapter_id and chapters[0].text == "Mara climbed the stairs."
    with pytest.raises(gr.Error, match="from 1 to"):
        story.propose_outline(view, project_id, 0)


def test_a_tab_not_loaded_yet_proposes_for_the_open_project_and_saves_nothing(h, story, db):
    """Right after the Story bible tab is opened its hidden project field is still unset (0): an outline proposed
    then is the open project's, while a save, which would write the tab's empty tables, is refused as loading."""
    view = View()
    project_id, _ = open_book(h, view)
    story.save_lore(view, project_id, True, 250, [["Mara", "Mara, keeper", "The keeper."]])
    assert "proposing an outline" in story.propose_outline(view, 0, 3)
    assert storage.latest_outline_run(db, project_id) is not None
    for owner in (0, None):
        with pytest.raises(gr.Error, match="still loading"):
            story.save_lore(view, owner, True, 250, [["", "", ""]])
        with pytest.raises(gr.Error, match="still loading"):
            story.apply_outline(view, owner, [["", ""]])
    assert [e.name for e in storage.list_lore(db, project_id)] == ["Mara"]
    h.create_project(view, "Second", "novel", "")
    with pytest.raises(gr.Error, match="switched project"):
        story.propose_outline(view, project_id, 3)  # a tab showing another project still refuses


def test_a_project_file_round_trips_through_export_and_import(h, story, db, tmp_path):
    view = View()
    project_id, chapter_id = open_book(h, view, "The <Keeper>")
    storage.set_summary(db, chapter_id, "She climbs.")
    storage.set_lore(db, project_id, [{"name": "Mara", "keywords": "Mara", "text": "The keeper."}])
    exported = h.export(view, "json")["value"]
    assert exported.endswith("the-keeper.json")
    data = json.loads(Path(exported).read_text(encoding="utf-8"))
    assert data["chapters"][0]["summary"] == "She climbs." and data["lore"][0]["name"] == "Mara"

    outputs = story.import_project(view, exported)
    assert view.project_id != project_id and outputs[1]["value"] == "The <Keeper>"
    assert storage.list_chapters(db, view.project_id, with_text=True)[0].text == "Mara climbed the stairs."
    assert [e.name for e in storage.list_lore(db, view.project_id)] == ["Mara"]

    bad = tmp_path / "bad.json"
    for content, message in (("{not json", "not a JSON project file"), ('{"format": "x"}', "not a TokenSwift")):
        bad.write_text(content)
        before = len(storage.list_projects(db))
        with pytest.raises(gr.Error, match=message):
            story.import_project(view, str(bad))
        assert len(storage.list_projects(db)) == before
    with pytest.raises(gr.Error, match="Choose a project file"):
        story.import_project(view, None)
