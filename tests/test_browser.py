"""The studio in a real browser: Playwright driving Debian's headless Chromium against `app.py` (tiny model).

Create a project with a premise, Generate, watch the text grow and the charts draw, Stop, reload the page and find
the same text; then run a short Compare and see both texts, the speedup and the losslessness verdict. Screenshots
go to artifacts/browser/ (gitignored) for a human to look at.

Needs /usr/bin/chromium (`make browser`); without it the tests are skipped, unless $CI is set (then they fail).
"""
from __future__ import annotations

import os
import re
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

expect = pytest.importorskip("playwright.sync_api").expect

from app.studio_process import stop_server
from conftest import studio_server

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "artifacts" / "browser"
TIMEOUT_MS = 90_000

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser() -> Iterator:
    if not os.path.exists(CHROMIUM):
        message = f"{CHROMIUM} is missing: install it with `make browser` (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu",
                                                               "--disable-background-networking"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    SHOTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.js_errors = errors
    # a test that takes the server away names when and what its absence alone causes: (index of the first error
    # after it left, the message's prefix); those are set aside at the end, whenever the page reports them
    page.server_away = None
    page.goto(server.url)
    wait_loaded(page)
    yield page
    context.close()
    if page.server_away is not None:
        seen, absent = page.server_away
        errors[seen:] = [e for e in errors[seen:] if not e.startswith(absent)]
    assert not errors, f"JavaScript errors on the page: {errors}"


def wait_loaded(page) -> None:
    """Until the page-load handler has answered (ui.LOADED_JS): it opens what the browser had open, and closes the
    new-project form once projects exist, so nothing is done on the page before it."""
    page.wait_for_function("window.tsLoaded === true")


def shot(page, name: str) -> None:
    """A screenshot of the page for the artifacts (evidence, not an assertion). A full-page capture re-lays the page
    out and once waited out the whole timeout on a page that had just reconnected to a restarted server (its text
    and badges already checked): then the viewport alone, and a warning if even that cannot be taken."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    path = str(SHOTS / f"{name}.png")
    try:
        page.screenshot(path=path, full_page=True, timeout=30_000)
    except PlaywrightTimeout:
        try:
            page.screenshot(path=path, timeout=30_000)
        except PlaywrightTimeout:
            warnings.warn(f"screenshot {name} timed out twice", stacklevel=2)


def text_of(page) -> str:
    return page.locator("#chapter-text textarea").input_value()


def wait_text(page, predicate, what: str, timeout_s: float = TIMEOUT_MS / 1000) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        value = text_of(page)
        if predicate(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; text is {value[:80]!r}")
        time.sleep(0.25)


def wait_chart(page, elem_id: str, lines: int = 1) -> None:
    """Wait until Plotly drew at least `lines` line traces with two or more points in chart `elem_id`.

    (A flat line has a zero-height box, which Playwright calls hidden, so visibility cannot be the test.)
    """
    page.wait_for_function(
        """([sel, n]) => [...document.querySelectorAll(sel)].filter(p => (p.getAttribute('d') || '').includes('L'))
                                                             .length >= n""",
        arg=[f"#{elem_id} .js-plotly-plot .scatterlayer .trace path.js-line", lines])


def open_accordion(page, elem_id: str, label: str) -> None:
    page.locator(f"#{elem_id}").get_by_text(label, exact=True).first.click()


def box(page, selector: str) -> dict:
    b = page.locator(selector).first.bounding_box()
    assert b is not None, f"{selector} is not laid out"
    return b


def check_write_layout(page) -> None:
    """The Write tab reads top to bottom: instructions, buttons, status, the chapter text (with its counts and Save
    edits), then the generation settings, collapsed; the live charts sit beside the text."""
    expect(page.locator("#write-max_new_tokens")).to_be_hidden()  # settings collapsed by default
    order = ["#instructions", "#generate", "#run-status", "#chapter-text", "#counts", "#write-settings"]
    tops = [box(page, sel)["y"] for sel in order]
    assert tops == sorted(tops), dict(zip(order, tops))
    text, chart = box(page, "#chapter-text"), box(page, "#write-accepted")
    assert chart["x"] >= text["x"] + text["width"] - 1  # to the right of the text…
    assert chart["y"] < text["y"] + text["height"]  # …and beside it, not below it
    save = box(page, "#save-chapter")
    assert text["y"] + text["height"] <= save["y"] < tops[-1]  # Save edits between the text and the settings


def test_write_generate_stop_reload(page, server):
    shot(page, "01-start")
    # A fresh database: the new-project form is open.
    page.locator("#new-title input, #new-title textarea").first.fill("The <Lighthouse> Keeper")
    page.locator("#new-premise textarea").fill("A keeper on a remote island finds letters from a <b>stranger</b>.")
    page.locator("#create-project").click()
    page.locator("#chapter-list").get_by_text("1. Chapter 1").wait_for()
    # The premise appears in the Write tab, as text (never as markup), and can be typed over.
    premise = page.locator("#premise textarea")
    assert "<b>stranger</b>" in premise.input_value()
    premise.fill("A keeper on a remote island finds letters from a <b>stranger</b>. Storms, secrets, the sea.")
    page.locator("#instructions textarea").fill("The first letter arrives.")

    check_write_layout(page)
    open_accordion(page, "write-settings", "Generation settings")
    page.locator("#write-max_new_tokens input").fill("3000")
    page.locator("#write-ignore_eos input[type=checkbox]").check()
    shot(page, "02-project-created")

    page.locator("#generate").click()
    first = wait_text(page, lambda t: len(t) > 40, "generated text")
    page.locator("#run-status .badge-running").wait_for()
    grown = wait_text(page, lambda t: len(t) > len(first) + 40, "the text to grow")
    assert grown.startswith(first[:30])
    # The live charts draw lines (Plotly renders SVG paths inside .js-plotly-plot).
    for chart in ("write-accepted", "write-throughput", "write-repetition"):
        wait_chart(page, chart)
    counts = page.locator("#counts").inner_text()
    assert re.search(r"\d+ words", counts) and "tokens" in counts
    shot(page, "03-generating")

    page.locator("#stop").click()
    page.locator("#run-status .badge-cancelled").wait_for()
    page.locator("#generate:not([disabled])").wait_for()
    time.sleep(1.5)  # one more poll: the final text
    stopped = text_of(page)
    assert len(stopped) >= len(grown)
    shot(page, "04-stopped")

    page.reload()
    wait_loaded(page)
    wait_text(page, lambda t: t == stopped, "the same text after a reload", timeout_s=30)
    assert page.locator("#premise textarea").input_value().endswith("Storms, secrets, the sea.")
    assert page.locator("#instructions textarea").input_value() == "The first letter arrives."
    page.locator("#run-status .badge-cancelled").wait_for()
    wait_chart(page, "write-throughput")
    # The title was rendered as text in the picker, not as a tag.
    assert "The <Lighthouse> Keeper" in page.locator("#project-picker input").input_value()
    shot(page, "05-reloaded")


def test_compare(page):
    page.get_by_role("tab", name="Compare").click()
    page.locator("#compare-prompt textarea").fill("Write a short story about a lighthouse in winter.")
    page.locator("#compare-max_new_tokens input").fill("48")
    page.locator("#compare-ignore_eos input[type=checkbox]").check()
    page.locator("#run-compare").click()
    summary = page.locator("#compare-summary")
    summary.get_by_text("✓ yes").wait_for()  # both runs done and their token ids are identical
    speedup = summary.locator(".tile.accent .tile-value").inner_text()
    assert re.fullmatch(r"\d+\.\d\d×", speedup.strip()), speedup
    ar = page.locator("#compare-ar textarea").input_value()
    ts = page.locator("#compare-ts textarea").input_value()
    assert ar and ar == ts  # lossless: the same text
    assert "tok/s" in summary.inner_text()
    wait_chart(page, "compare-throughput", lines=2)  # both runs overlaid
    expect(page.locator("#compare-table")).to_contain_text("yes")  # listed among past comparisons
    shot(page, "06-compare")


def test_history_and_export(page, tmp_path):
    # A new browser context: nothing remembered, so pick the project first.
    page.locator("#project-picker input").click()
    page.get_by_role("option", name=re.compile("Lighthouse")).click()
    page.locator("#chapter-list").get_by_text("1. Chapter 1").wait_for()
    page.get_by_role("tab", name="History & export").click()
    expect(page.locator("#runs-table")).to_contain_text("TokenSwift")
    with page.expect_download() as download:
        page.locator("#export").click()
        page.locator("#export-file a").first.click()
    path = tmp_path / download.value.suggested_filename
    download.value.save_as(path)
    text = path.read_text(encoding="utf-8")
    assert path.suffix == ".md" and text.startswith("# The \\<Lighthouse\\> Keeper")
    shot(page, "07-history")


def test_quick_clicks_through_the_chapters_open_the_last_one(page):
    """A writer clicking one chapter and at once another: every click counts, in order, and the page and the server
    end on the chapter clicked last (two clicks used to run at once, and the earlier could finish last, leaving the
    server on the earlier chapter while the list showed the later one)."""
    new_title = page.locator("#new-title input, #new-title textarea").first
    if not new_title.is_visible():  # the form closes once a project exists
        open_accordion(page, "new-project", "New project")
    new_title.fill("Quick clicks")
    page.locator("#create-project").click()
    chapters = page.locator("#chapter-list label")
    chapters.get_by_text("1. Chapter 1").wait_for()
    for n in (2, 3):
        page.locator("#add-chapter").click()
        expect(chapters).to_have_count(n, timeout=TIMEOUT_MS)
    title = page.locator("#chapter-title textarea, #chapter-title input").first
    for clicks in ((2, 3), (1, 2, 3, 1), (3, 2), (2, 1, 3)):
        for n in clicks:
            chapters.nth(n - 1).click()
        expect(title).to_have_value(f"Chapter {clicks[-1]}", timeout=TIMEOUT_MS)
        time.sleep(2.5)  # two polls: the server's own idea of the open chapter has come back
        assert title.input_value() == f"Chapter {clicks[-1]}"
        expect(chapters.nth(clicks[-1] - 1).locator("input")).to_be_checked()


def test_server_restart_under_an_open_page(page, server, tiny_model_dir, tmp_path):
    """The server goes away and comes back (same port, same database): the open page shows the same text again
    without a reload. (Stops the module's server: keep this test last.)"""
    page.locator("#project-picker input").click()
    page.get_by_role("option", name=re.compile("Lighthouse")).click()
    before = wait_text(page, lambda t: len(t) > 40, "the chapter text")
    port = int(server.url.rstrip("/").rsplit(":", 1)[1])
    # while no server is there, the page may fetch one of Gradio's component modules, and fails: that, and only
    # that, is the server's absence (any other error still fails the test at teardown). The failure may be reported
    # after the restart (it once failed CI so), and the server goes away again when the test ends.
    absent = f"Failed to fetch dynamically imported module: {server.url.rstrip('/')}/assets/"
    page.server_away = (len(page.js_errors), absent)
    stop_server(server)
    with studio_server(tmp_path, tiny_model_dir, db_path=server.db_path, port=port):
        wait_text(page, lambda t: t == before, "the text after the restart", timeout_s=60)
        page.locator("#run-status .badge-cancelled").wait_for()
        shot(page, "08-after-restart")
