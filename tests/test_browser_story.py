"""Writing a short novel in Chromium on the real default model (its committed heads, TokenSwift): an outline proposed
and applied, three chapters written, each followed by the model's summary; the third chapter's prompt line; a
reload that shows it all again; a hand edit undone through the revisions; the project exported as a JSON file that
carries the summaries and revisions.

Needs /usr/bin/chromium (`make browser`); without it the test is skipped, unless $CI is set.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_browser import (  # noqa: F401  (browser: a fixture)
    TIMEOUT_MS, browser, expect, open_accordion, shot, wait_loaded)
from test_browser_writers import open_options

import storage
from app.live import DIGEST_JS, RESEND_S, text_digest
from conftest import studio_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def studio(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    # The default model as the studio ships it: its committed heads (the later --heads wins over the fixture's).
    with studio_server(tmp_path_factory.mktemp("story"), Path("smollm2-135m"), args=("--heads", "default")) as s:
        yield s


def chapter_texts(page) -> list[str]:
    return page.locator("#chapter-list label").all_inner_texts()


def open_chapter(page, number: int) -> None:
    """Pick chapter `number` and wait until the server has answered the pick (ui.PICK_JS / PICKED_JS count them): a
    button pressed before that acts on the chapter open before, or is refused as the page having switched."""
    page.locator("#chapter-list label").nth(number - 1).click()
    page.wait_for_function("(window.tsPicks || 0) === (window.tsPicked || 0)", timeout=TIMEOUT_MS)
    expect(page.locator("#chapter-list input").nth(number - 1)).to_be_checked()


def set_number(page, selector: str, value: str) -> None:
    """Type into a number field until it holds `value` a moment later: an accordion opened for the first time mounts
    its fields as it opens, and a value typed into the first mount is lost."""
    field = page.locator(selector)
    for _ in range(10):
        field.fill(value)
        field.press("Tab")
        time.sleep(0.3)
        if field.input_value() == value:
            return
    raise AssertionError(f"{selector} does not keep {value!r}")


def test_a_short_novel_with_summaries_reload_restore_and_export(browser, studio, tmp_path):  # noqa: F811
    context = browser.new_context(viewport={"width": 1500, "height": 1000}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(studio.url)
        wait_loaded(page)
        page.locator("#new-title input, #new-title textarea").first.fill("The Keeper")
        page.locator("#new-premise textarea").fill("A lighthouse keeper on a remote island finds a message in a "
                                                   "bottle from her missing brother, and sets out to find him.")
        page.locator("#create-project").click()
        page.locator("#chapter-list").get_by_text("1. Chapter 1").wait_for()

        # The outline: proposed by the model, shown in the table, applied to the chapters.
        page.get_by_role("tab", name="Story bible").click()
        page.locator("#outline-n input").fill("3")
        page.locator("#propose-outline").click()
        expect(page.locator("#outline-status")).to_contain_text("outline proposed by run", timeout=TIMEOUT_MS)
        shot(page, "story-00-outline")
        first_title = page.locator("#outline-table [data-testid=cell-0-0]").inner_text().strip()
        assert first_title
        page.locator("#apply-outline").click()
        page.get_by_text("Outline applied").first.wait_for()
        page.get_by_role("tab", name="Write").click()
        expect(page.locator("#chapter-list label").first).to_contain_text(first_title[:20], timeout=TIMEOUT_MS)
        while len(chapter_texts(page)) < 3:  # a short plan from the small model: add the rest by hand
            n = len(chapter_texts(page))
            page.locator("#add-chapter").click()
            expect(page.locator("#chapter-list label")).to_have_count(n + 1, timeout=TIMEOUT_MS)
        shot(page, "story-01-outline")

        # Three chapters, each summarized by the model when its run ends.
        open_accordion(page, "write-settings", "Generation settings")
        set_number(page, "#write-max_new_tokens input", "40")
        open_accordion(page, "summary-box", "Summary (story so far)")
        summary = page.locator("#chapter-summary textarea")
        for number in (1, 2, 3):
            open_chapter(page, number)
            expect(page.locator("#run-status")).to_contain_text("Not written yet", timeout=TIMEOUT_MS)
            page.locator("#generate:not([disabled])").click()
            page.locator("#run-status .badge-done").wait_for()
            expect(page.locator("#summary-note")).to_contain_text("Written by the model", timeout=TIMEOUT_MS)
            assert summary.input_value().strip()
        status = page.locator("#run-status").inner_text()
        assert "prompt" in status and "tokens" in status and "chapters 1–2 whole" in status
        shot(page, "story-02-three-chapters")

        # A reload shows the same: the open chapter's summary, and every summary in the Story bible.
        third_summary = summary.input_value()
        page.reload()
        wait_loaded(page)
        open_accordion(page, "summary-box", "Summary (story so far)")
        expect(page.locator("#chapter-summary textarea")).to_have_value(third_summary, timeout=TIMEOUT_MS)
        page.get_by_role("tab", name="Story bible").click()
        expect(page.locator("#summaries tbody tr")).to_have_count(3, timeout=TIMEOUT_MS)
        expect(page.locator("#summaries")).not_to_contain_text("no summary")
        page.get_by_role("tab", name="Write").click()

        # A hand edit, undone through the revisions.
        text = page.locator("#chapter-text textarea")
        expect(text).not_to_have_value("", timeout=TIMEOUT_MS)  # the reloaded page's first poll brings the text
        written = text.input_value()
        # The page's digest of its text is the server's (app.live.DIGEST_JS and text_digest), surrogates included.
        sample = written[:200] + " «é» 🌊\n"
        assert page.evaluate(DIGEST_JS, sample) == text_digest(sample)
        # Typing a second after the chapter opened, while the poll still resends what changed: never replaced.
        # (A poll already on its way when the first key is pressed can still land after it: a window of one round
        # trip, not of RESEND_S.)
        # Two picks in quick succession, the second before the first is answered: the last one stays, on the page
        # and on the server (polls never move a pick on its way, nor does an overtaken pick open after a newer one).
        page.locator("#chapter-list label").nth(1).click()
        open_chapter(page, 3)
        expect(text).to_have_value(written, timeout=TIMEOUT_MS)
        time.sleep(1.2)
        text.fill("The keeper burned the letter.")
        time.sleep(RESEND_S + 1.5)  # several polls, the resend window included
        assert text.input_value() == "The keeper burned the letter."
        page.locator("#save-chapter:not([disabled])").click()
        page.get_by_text("Saved.", exact=True).first.wait_for()
        page.locator("#revisions").get_by_text("Revisions", exact=True).first.click()
        options = open_options(page, "#revision-pick")
        assert "hand edit" in options[0].inner_text()
        options[0].click()
        page.locator("#restore-revision").click()
        expect(text).to_have_value(written, timeout=TIMEOUT_MS)
        shot(page, "story-03-restored")

        # The project file: chapters, summaries, revisions.
        page.get_by_role("tab", name="History & export").click()
        page.locator("#export-format").get_by_text("Project file (JSON", exact=False).click()
        with page.expect_download() as download:
            page.locator("#export").click()
            page.locator("#export-file a").first.click()
        path = tmp_path / download.value.suggested_filename
        download.value.save_as(path)
        data = json.loads(path.read_text(encoding="utf-8"))
        chapters = data["chapters"]
        assert path.name == "the-keeper.json" and len(chapters) >= 3
        assert all(c["summary"].strip() and c["summary_source"] == "model" for c in chapters[:3])
        assert chapters[2]["text"] == written
        assert [r["text"] for r in chapters[2]["revisions"]][-2:] == [written, "The keeper burned the letter."]
    finally:
        context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
    with storage.open_database(studio.db_path) as db:
        runs = storage.list_runs(db)
        assert sorted(r.mode for r in runs) == ["generate"] * 3 + ["outline"] + ["summary"] * 3
        assert all(r.status == "done" and r.method == "tokenswift" for r in runs)
        assert [r.settings["max_new_tokens"] for r in runs if r.mode == "generate"] == [40] * 3
