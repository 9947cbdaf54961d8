"""A shared studio: who a visitor is (app.identity), the hosting policy (app.hosting), and the UI's handlers
scoping every read and write to the session's writer (no browser: tests/test_browser.py has two real ones)."""
from __future__ import annotations

import types

import gradio as gr
import pytest

import storage
from app import identity
from app.hosting import SHARED_MAX_QUEUED, SHARED_MAX_TOKENS, Hosting, hosting_from, space_database
from app.live import LiveCache, View
from app.ui import Handlers, StudioContext

MODEL = "tiny"


# -- identity -----------------------------------------------------------------------------------------------------

def test_a_browser_key_names_a_writer_by_its_hash_only():
    key = identity.new_key()
    owner = identity.key_owner(key)
    assert len(key) == 43 and owner.startswith("key:") and key not in owner
    assert identity.key_owner(key) == owner and identity.key_owner(identity.new_key()) != owner
    for bad in ("", "short", key + "x", key[:-1] + "!", None, 42):
        with pytest.raises(identity.IdentityError, match="not valid"):
            identity.key_owner(bad)


def test_resolve_makes_a_key_on_the_first_visit_and_prefers_a_sign_in():
    owner, key = identity.resolve("")
    assert owner == identity.key_owner(key)
    assert identity.resolve(key) == (owner, key)
    alice = types.SimpleNamespace(username="alice")
    assert identity.resolve(key, alice) == ("hf:alice", key)  # the key is kept: its projects can be claimed
    with pytest.raises(identity.IdentityError):
        identity.resolve("forged-key")
    with pytest.raises(identity.IdentityError):
        identity.profile_owner(types.SimpleNamespace(username=""))


# -- hosting ------------------------------------------------------------------------------------------------------

def test_multi_user_is_on_where_the_studio_is_shared(tmp_path):
    laptop = hosting_from({}, host=None, multi_user=None, db=None)
    assert laptop == Hosting()  # nothing changes for `make run`
    assert hosting_from({}, host="127.0.0.1", multi_user=None, db=None).multi_user is False
    lan = hosting_from({}, host="0.0.0.0", multi_user=None, db=None)
    assert lan.multi_user and (lan.max_queued, lan.max_tokens) == (SHARED_MAX_QUEUED, SHARED_MAX_TOKENS)
    space = hosting_from({"SPACE_ID": "me/studio", "OAUTH_CLIENT_ID": "x"}, host=None, multi_user=None, db=None,
                         volume=tmp_path / "missing")
    assert space.multi_user and space.oauth and "lost when it restarts" in space.storage_warning
    assert hosting_from({"TOKENSWIFT_MULTI_USER": "1"}, host=None, multi_user=None, db=None).multi_user
    assert not hosting_from({"SPACE_ID": "s"}, host=None, multi_user=False, db=None).multi_user
    limits = hosting_from({"TOKENSWIFT_MAX_QUEUED": "5", "TOKENSWIFT_MAX_TOKENS": "0"}, host="0.0.0.0",
                          multi_user=None, db=None)
    assert (limits.max_queued, limits.max_tokens) == (5, None)
    for env in ({"TOKENSWIFT_MAX_TOKENS": "lots"}, {"TOKENSWIFT_MAX_QUEUED": "-1"}, {"TOKENSWIFT_MULTI_USER": "?"}):
        with pytest.raises(SystemExit, match="TOKENSWIFT_"):
            hosting_from(env, host=None, multi_user=None, db=None)


def test_a_space_keeps_its_database_on_the_persistent_volume(tmp_path):
    assert space_database({"SPACE_ID": "me/studio"}, tmp_path) == str(tmp_path / "studio.db")
    assert space_database({}, tmp_path) is None
    assert space_database({"SPACE_ID": "me/studio"}, tmp_path / "missing") is None
    with_volume = hosting_from({"SPACE_ID": "s"}, host=None, multi_user=None, db=None, volume=tmp_path)
    assert with_volume.storage_warning is None


# -- the handlers, per writer --------------------------------------------------------------------------------------

def handlers(db, **hosting) -> Handlers:
    h = Handlers(StudioContext(db=db, model=MODEL, hosting=Hosting(multi_user=True, **hosting)))
    with gr.Blocks():
        from app import settings_panel

        h.write_panel = settings_panel.build("write")
        h.compare_panel = settings_panel.build("compare", include_method=False)
    return h


def visit(h: Handlers, key: str = "", profile=None) -> tuple[View, str, list]:
    view = View()
    out = h.load(view, {}, key, profile)
    stored = out[-3]
    return view, (key if isinstance(stored, dict) else stored), out


def test_each_writer_sees_and_touches_only_their_own(db):
    h = handlers(db)
    a, a_key, _ = visit(h)
    b, b_key, _ = visit(h)
    assert a_key != b_key and a.owner != b.owner
    h.create_project(a, "Alpha", "novel", "A's premise")
    h.create_project(b, "Beta", "novel", "")
    alpha = a.project_id
    h.queue_run("generate", a, a.project_id, a.chapter_id, None, None, None, max_new_tokens=64)
    run = storage.list_runs(db)[0]
    h.start_comparison(a, "A's prompt", max_new_tokens=32)

    again, _, out = visit(h, a_key)  # the same browser, later: its projects, and only those
    assert [pid for _, pid in out[0]["choices"]] == [alpha]
    _, _, b_out = visit(h, b_key)
    assert [pid for _, pid in b_out[0]["choices"]] == [b.project_id]
    assert h.comparison_picker(b)[0]["choices"] == []
    table, picker = h.history(b, True)
    assert table["value"] == [] and picker["choices"] == []

    foreign = [lambda: h.open_project(b, alpha), lambda: h.open_chapter(b, a.chapter_id),
               lambda: h.open_comparison(b, a.compare_id), lambda: h.run_details(b, run.id)]
    for call in foreign:
        with pytest.raises(gr.Error, match="does not exist"):
            call()
    assert b.project_id != alpha  # nothing was opened
    # Hidden owner ids are no way in either: b's view never holds a's ids, and forging a view's ids is refused.
    b.project_id, b.chapter_id = alpha, a.chapter_id
    for call in (lambda: h.save_chapter(b, LiveCache(), alpha, a.chapter_id, "stolen", "x", "y", None),
                 lambda: h.delete_project(b), lambda: h.export(b, "markdown"),
                 lambda: h.queue_run("generate", b, alpha, a.chapter_id, None, None, None, max_new_tokens=8)):
        with pytest.raises(gr.Error, match="does not exist"):
            call()
    assert storage.get_project(db, alpha).premise == "A's premise" and len(storage.list_runs(db)) == 3


def test_a_session_without_a_writer_and_a_malformed_key_are_refused(db):
    h = handlers(db)
    a, _, _ = visit(h)
    h.create_project(a, "Alpha", "novel", "")
    stranger = View()  # an API caller that skipped /load
    with pytest.raises(gr.Error, match="reload the page"):
        h.open_project(stranger, a.project_id)
    with pytest.raises(gr.Error, match="reload the page"):
        h.create_project(stranger, "Mine", "novel", "")
    with pytest.raises(gr.Error, match="not valid"):
        h.load(View(), {}, "not-a-key")
    with pytest.raises(gr.Error, match="not a valid project id"):
        h.open_project(a, "1 OR 1=1")
    assert [p.title for p in storage.list_projects(db)] == ["Alpha"]


def test_limits_of_a_shared_studio(db):
    h = handlers(db, max_queued=1, max_tokens=100)
    a, _, _ = visit(h)
    h.create_project(a, "Alpha", "novel", "")
    with pytest.raises(gr.Error, match="limited to 100 per run"):
        h.queue_run("generate", a, a.project_id, a.chapter_id, None, None, None, max_new_tokens=101)
    h.queue_run("generate", a, a.project_id, a.chapter_id, None, None, None, max_new_tokens=100)
    h.add_chapter(a)
    with pytest.raises(gr.Error, match="at most 1 per writer"):
        h.queue_run("generate", a, a.project_id, a.chapter_id, None, None, None, max_new_tokens=100)
    b, _, _ = visit(h)  # another writer's queue is their own
    h.create_project(b, "Beta", "novel", "")
    h.queue_run("generate", b, b.project_id, b.chapter_id, None, None, None, max_new_tokens=100)


def test_signing_in_offers_and_claims_the_browsers_projects(db):
    h = handlers(db, oauth=True)
    a, key, _ = visit(h)
    h.create_project(a, "Before sign-in", "novel", "")
    alice = types.SimpleNamespace(username="alice")
    signed, _, out = visit(h, key, alice)
    assert signed.owner == "hf:alice" and "alice" in out[-2]
    assert out[-1]["visible"] and "Keep the 1 project" in out[-1]["value"]
    assert out[0]["choices"] == []  # not hers until she keeps them
    out = h.claim(signed, key, alice)
    assert [label for label, _ in out[0]["choices"]] == ["Before sign-in (novel)"] and not out[-1]["visible"]
    assert storage.list_projects(db, a.owner) == []
    with pytest.raises(gr.Error, match="Sign in first"):
        h.claim(a, key, None)
    # Without an OAuth set-up, a profile (which only an OAuth set-up can make) is not trusted.
    plain = handlers(db)
    view, _, _ = visit(plain, key, alice)
    assert view.owner == a.owner


def test_single_user_studio_is_unchanged(db):
    h = Handlers(StudioContext(db=db, model=MODEL))
    old = storage.create_project(db, "From before")  # the local writer's, like every row of a laptop's database
    view = View()
    out = h.load(view, {"project_id": old.id})
    assert view.owner is None and view.project_id == old.id
    assert out[-3] is not None and out[-2] == "" and not out[-1]["visible"]


def test_the_page_builds_for_every_hosting(db, monkeypatch):
    from app.ui import build_ui

    # What a Space with `hf_oauth: true` sets (Gradio mocks the sign-in elsewhere, with the machine's HF login);
    # gradio.oauth reads the OAuth variables when it is imported.
    import gradio.oauth

    monkeypatch.setenv("SYSTEM", "spaces")
    monkeypatch.setenv("SPACE_ID", "me/studio")
    for name, value in (("OAUTH_CLIENT_ID", "id"), ("OAUTH_CLIENT_SECRET", "secret"),
                        ("OAUTH_SCOPES", "openid profile"), ("OPENID_PROVIDER_URL", "https://huggingface.co")):
        monkeypatch.setattr(gradio.oauth, name, value)

    for hosting in (Hosting(), Hosting(multi_user=True),
                    Hosting(multi_user=True, oauth=True, storage_warning="Text is <lost> on restart.")):
        demo = build_ui(StudioContext(db=db, model=MODEL, hosting=hosting))
        assert "/claim" in demo.get_api_info()["named_endpoints"]
        blocks = list(demo.blocks.values())
        assert any(isinstance(b, gr.LoginButton) for b in blocks) == hosting.oauth
        warnings = [b.value for b in blocks if isinstance(b, gr.HTML) and "storage-warning" in str(b.value)]
        assert warnings == (["<div class=\"storage-warning\" id=\"storage-warning\">Text is &lt;lost&gt; on "
                             "restart.</div>"] if hosting.storage_warning else [])


def test_revisions_are_listed_shown_diffed_and_restored(db):
    """Undo through revisions, per writer: the list, a revision's text and its diff against the current text, and a
    restore that keeps the replaced text as a revision."""
    h = handlers(db)
    a, _, _ = visit(h)
    b, _, _ = visit(h)
    h.create_project(a, "Alpha", "novel", "")
    chapter = a.chapter_id
    storage.set_chapter_text(db, chapter, "The storm came.\nThe keeper slept.")
    storage.set_chapter_text(db, chapter, "The storm came.\nThe keeper woke <early>.\nA ship!")
    picker, _, note = h.revisions(a)
    (label, first), = picker["choices"]
    assert label.startswith(f"#{first} · ") and "hand edit · 6 words" in label and note == ""
    shown, diff = h.show_revision(a, first)
    assert shown["value"] == "The storm came.\nThe keeper slept." and shown["visible"]
    assert "<del>The keeper slept.</del>" in diff and "<ins>The keeper woke &lt;early&gt;.</ins>" in diff
    assert "+6 words" in diff and "−3 words" in diff
    picker, _, _ = h.restore_revision(a, first)
    assert storage.get_chapter(db, chapter).text == "The storm came.\nThe keeper slept."
    assert [value for _, value in picker["choices"]][1] == first and len(picker["choices"]) == 2
    assert "same as the current text" in h.show_revision(a, first)[1]
    h.create_project(b, "Beta", "novel", "")
    for call in (lambda: h.show_revision(b, first), lambda: h.restore_revision(b, first)):
        with pytest.raises(gr.Error, match="does not exist"):
            call()
    h.add_chapter(a)  # another chapter open: a revision of the first is not shown as if it were this one's
    with pytest.raises(gr.Error, match="another chapter"):
        h.show_revision(a, first)
    assert h.revisions(a)[0]["choices"] == [] and "appear here" in h.revisions(a)[2]
