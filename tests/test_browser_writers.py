"""Two writers on one shared studio (`app.py --multi-user`), in two real Chromium contexts and through the API:
each sees only their own projects, also after reloads, and another writer's ids are refused.

Needs /usr/bin/chromium (`make browser`); without it the browser test is skipped, unless $CI is set.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import storage
from conftest import studio_server
from test_browser import SHOTS, TIMEOUT_MS, browser, expect, open_accordion, shot  # noqa: F401  (browser: a fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator:
    with studio_server(tmp_path_factory.mktemp("shared"), tiny_model_dir, args=("--multi-user",)) as s:
        yield s


# Every message the page shows, kept as it appears: an error's message leaves the page after a few seconds.
RECORD_TOASTS_JS = """
window.__toasts = [];
new MutationObserver(() => {
  for (const t of document.querySelectorAll('.toast-body')) {
    if (t.__seen) continue;
    t.__seen = true;
    window.__toasts.push(`${(performance.now() / 1000).toFixed(1)} s: ${t.innerText}`);
  }
}).observe(document, {childList: true, subtree: true});
"""
CREATE_FN_JS = "(window.gradio_config?.dependencies || []).findIndex(d => d.api_name === 'create_project')"


def watch(page, server) -> None:
    """Keep what the page asked of the queue (all but the 1 s poll, fn 0) and its errors, for a failure's report."""
    page.server, page.traffic = server, []

    def answered(response) -> None:
        if "/queue/join" in response.url:
            fn = response.request.post_data_json.get("fn_index")
            if fn != 0:
                page.traffic.append(f"{response.status} fn {fn}")

    page.on("response", answered)
    page.on("pageerror", lambda e: page.traffic.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: "/queue/data" not in r.url and page.traffic.append(
        f"failed: {r.method} {r.url} {r.failure}"))


def writer(chromium, server, name: str):
    context = chromium.new_context(viewport={"width": 1400, "height": 900})
    context.add_init_script(RECORD_TOASTS_JS)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    watch(page, server)
    page.goto(server.url)
    # The page-load handler has run (it knows the writer, and has opened the new-project form for a new one).
    expect(page.locator("#identity")).to_contain_text("private to this browser", timeout=TIMEOUT_MS)
    return context, page


def create(page, title: str) -> None:
    field = page.locator("#new-title input, #new-title textarea").first
    if not field.is_visible():  # the form closes once a project exists
        open_accordion(page, "new-project", "New project")
    field.fill(title)
    page.locator("#create-project").click()
    try:
        expect(page.locator("#project-picker input")).to_have_value(f"{title} (novel)", timeout=TIMEOUT_MS)
    except AssertionError as failed:  # what the page showed and asked, for a failure seen in CI and not reproduced
        SHOTS.mkdir(parents=True, exist_ok=True)
        shot(page, "create-failed")
        raise AssertionError(
            f"{failed}\ntitle field: {field.input_value()!r}; messages shown: {page.evaluate('window.__toasts')}; "
            f"queue requests (create_project is fn {page.evaluate(CREATE_FN_JS)}): {page.traffic[-20:]}; "
            f"screenshot: {SHOTS / 'create-failed.png'}\nserver log:\n{page.server.log()}") from None


def open_options(page, picker: str) -> list:
    """Open a dropdown and return its options, once the handler that fills it has answered."""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while True:
        page.locator(f"{picker} input").click()
        options = page.locator("ul[role=listbox] li[role=option]")
        try:
            options.first.wait_for(timeout=2000)
            return options.all()
        except Exception:
            if time.monotonic() > deadline:
                raise
            page.keyboard.press("Escape")


def projects_offered(page) -> list[str]:
    names = [o.inner_text() for o in open_options(page, "#project-picker")]
    page.keyboard.press("Escape")
    return [n.replace("✓", "").strip() for n in names]


def test_two_writers_see_only_their_own_projects(browser, shared):  # noqa: F811
    SHOTS.mkdir(parents=True, exist_ok=True)
    (ca, a), (cb, b) = writer(browser, shared, "a"), writer(browser, shared, "b")
    try:
        create(a, "Alpha's novel")
        create(b, "Beta's report")
        create(a, "Alpha's second")
        for page in (a, b):
            page.reload()
            expect(page.locator("#identity")).to_contain_text("private to this browser", timeout=TIMEOUT_MS)
        assert sorted(projects_offered(a)) == ["Alpha's novel (novel)", "Alpha's second (novel)"]
        assert projects_offered(b) == ["Beta's report (novel)"]
        # What each browser had open comes back after the reload, and it is its own.
        assert a.locator("#project-picker input").input_value() == "Alpha's second (novel)"
        assert b.locator("#project-picker input").input_value() == "Beta's report (novel)"
        shot(b, "writers-b")
        # A third browser is a third writer: nothing to see.
        cc, c = writer(browser, shared, "c")
        c.locator("#new-project").get_by_text("Title").first.wait_for()  # the new-project form is open
        assert c.locator("#project-picker input").input_value() == ""
        cc.close()
    finally:
        ca.close()
        cb.close()
    with storage.open_database(shared.db_path) as db:
        owners = {p.title: p.owner for p in storage.list_projects(db)}
    assert owners["Alpha's novel"] == owners["Alpha's second"] != owners["Beta's report"]
    assert all(o.startswith("key:") for o in owners.values())


def test_api_callers_get_their_own_writer_and_nothing_else(shared):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    with storage.open_database(shared.db_path) as db:
        before = {p.id: (p.title, p.owner) for p in storage.list_projects(db)}
        project = storage.create_project(db, "Someone's", owner="key:" + "0" * 64)
        chapter = storage.add_chapter(db, project.id)
    api = Client(shared.url, verbose=False)
    with pytest.raises(AppError, match="reload the page"):  # no /load: no writer
        api.predict("Mine", "novel", "", api_name="/create_project")
    with pytest.raises(AppError, match="not valid"):
        api.predict(remembered={}, key="forged", api_name="/load")
    out = api.predict(remembered={"project_id": project.id, "chapter_id": chapter.id}, key="", api_name="/load")
    assert out[0]["value"] is None and out[0]["choices"] == []  # remembered foreign ids open nothing
    # Ids go in through pickers: Gradio refuses a value its session was never offered, and the handlers look any id
    # up as this writer's (tests/test_multi_user.py); either way nothing of the other writer comes back.
    for call in (lambda: api.predict(project.id, api_name="/open_project"),
                 lambda: api.predict(project.id, api_name="/run_details")):
        with pytest.raises(AppError, match="not in the list of choices|does not exist") as refused:
            call()
        assert "Someone's" not in str(refused.value)
    api.predict("Mine", "novel", "", api_name="/create_project")
    with storage.open_database(shared.db_path) as db:
        after = {p.id: (p.title, p.owner) for p in storage.list_projects(db)}
        assert storage.get_project(db, project.id).title == "Someone's"
    mine = [owner for title, owner in after.values() if title == "Mine"]
    assert len(mine) == 1 and mine[0] not in {owner for _, owner in before.values()}


def test_a_hand_edit_is_undone_through_revisions(browser, shared):  # noqa: F811
    context, page = writer(browser, shared, "editor")
    try:
        create(page, "Edited novel")
        text = page.locator("#chapter-text textarea")
        save = page.locator("#save-chapter:not([disabled])")
        # Typed at once, right after the page's text changed: the live poll never replaces the writer's typing.
        text.fill("The storm came.\nThe keeper slept.")
        save.click()
        page.get_by_text("Saved.", exact=True).first.wait_for()
        text.fill("The storm came.\nThe keeper woke early.")
        save.click()
        expect(page.get_by_text("Saved.", exact=True)).to_have_count(2, timeout=TIMEOUT_MS)
        expect(text).to_have_value("The storm came.\nThe keeper woke early.", timeout=TIMEOUT_MS)
        page.locator("#revisions").get_by_text("Revisions", exact=True).first.click()
        option = open_options(page, "#revision-pick")[0]
        assert "hand edit · 6 words" in option.inner_text()
        option.click()
        diff = page.locator("#revision-diff")
        expect(diff.locator("del")).to_contain_text(["The keeper slept."])
        expect(diff.locator("ins").last).to_have_text("The keeper woke early.")
        shot(page, "revision-diff")
        page.locator("#restore-revision").click()
        expect(text).to_have_value("The storm came.\nThe keeper slept.", timeout=TIMEOUT_MS)
        page.reload()
        expect(page.locator("#chapter-text textarea")).to_have_value("The storm came.\nThe keeper slept.",
                                                                   timeout=TIMEOUT_MS)
    finally:
        context.close()
    with storage.open_database(shared.db_path) as db:
        project, = [p for p in storage.list_projects(db) if p.title == "Edited novel"]
        chapter, = storage.list_chapters(db, project.id)
        assert [r.text for r in storage.list_revisions(db, chapter.id)] == [
            "The storm came.\nThe keeper woke early.", "The storm came.\nThe keeper slept."]
