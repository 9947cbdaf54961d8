"""The chapter text's live updates never replace what the writer types (app.live with the page's text digest): the
text goes to the page exactly when the page holds something else than it should, unless that is the writer's own
typing; a stale response that landed last is repaired by the next poll. The chapter list's pick the same way: never
moved while the writer's own pick is on its way."""
from __future__ import annotations

import storage
from app import live
from app.live import LiveCache, PageChapter, View, text_digest


def book(db):
    project = storage.create_project(db, "Typing")
    chapter = storage.add_chapter(db, project.id)
    storage.set_chapter_text(db, chapter.id, "The keeper slept.")
    other = storage.add_chapter(db, project.id)
    storage.set_chapter_text(db, other.id, "Another chapter.")
    return View(project_id=project.id, chapter_id=chapter.id, loaded=True), chapter, other


def test_digests_are_of_utf16_units_and_length():
    assert text_digest("") == "0:811c9dc5"
    assert text_digest("a") == "1:e40c292c"  # FNV-1a 32 of the single unit 0x61
    assert text_digest("🌊").startswith("2:")  # one character, two UTF-16 units, as JavaScript counts them
    assert text_digest("ab") != text_digest("ba")


def test_the_writers_typing_is_never_replaced(db):
    view, chapter, other = book(db)
    cache = LiveCache()
    up = live.poll_write(db, view, cache, now=0.0, shown=text_digest(""))  # a fresh page: an empty box
    assert up.text == ("The keeper slept.", True)
    # The page holds the right text: the value is never sent again (only the box's state, for a while).
    assert live.poll_write(db, view, cache, now=0.5, shown=text_digest("The keeper slept.")).text == (None, True)
    # The writer types within the resend window: nothing is sent over it.
    typed = text_digest("The keeper slept. Then")
    for now in (0.6, 1.0, 1.5, 3.0):
        assert live.poll_write(db, view, cache, now=now, shown=typed).text is None
    # A stale response landed last (the page shows an older text this session sent): the next poll repairs it.
    storage.set_chapter_text(db, chapter.id, "The keeper woke.")
    assert live.poll_write(db, view, cache, now=4.0, shown=text_digest("The keeper slept.")).text == (
        "The keeper woke.", True)
    assert live.poll_write(db, view, cache, now=4.2, shown=text_digest("The keeper slept.")).text == (
        "The keeper woke.", True)
    assert live.poll_write(db, view, cache, now=4.4, shown=text_digest("The keeper woke.")).text is None
    # The writer saves what they typed, then restores a revision: the restored text replaces the saved one.
    storage.set_chapter_text(db, chapter.id, "The keeper woke. Then")
    assert live.poll_write(db, view, cache, now=5.0, shown=text_digest("The keeper woke. Then")).text is None
    storage.restore_revision(db, storage.list_revisions(db, chapter.id)[0].id)
    assert live.poll_write(db, view, cache, now=5.5, shown=text_digest("The keeper woke. Then")).text == (
        "The keeper woke.", True)
    # Another chapter opened: its text is sent whatever the box held.
    view.chapter_id = other.id
    assert live.poll_write(db, view, cache, now=6.0, shown=typed).text == ("Another chapter.", True)
    # A run starts writing: the box becomes read-only and follows the run.
    run = storage.start_chapter_run(db, other.id, "continue", method="ar", model="tiny", settings={"seed": 1})
    storage.claim_next_run(db, "w")
    storage.append_output(db, run.id, " More.", [1])
    up = live.poll_write(db, view, cache, now=7.0, shown=text_digest("Another chapter. typing"))
    assert up.text == ("Another chapter. More.", False)


def test_an_api_caller_without_a_digest_gets_changes_and_resends(db):
    view, chapter, _ = book(db)
    cache = LiveCache()
    assert live.poll_write(db, view, cache, now=0.0).text == ("The keeper slept.", True)
    assert live.poll_write(db, view, cache, now=5.0).text is None
    storage.set_chapter_text(db, chapter.id, "Changed.")
    assert live.poll_write(db, view, cache, now=6.0).text == ("Changed.", True)


def test_the_writers_pick_is_never_moved_while_it_is_on_its_way(db):
    view, chapter, other = book(db)
    cache = LiveCache()
    # A fresh page: nothing picked yet; the list and its pick are sent.
    up = live.poll_write(db, view, cache, now=0.0, page=PageChapter(None, pending=False))
    assert [c for _, c in up.chapters] == [chapter.id, other.id] and up.select and up.selected == chapter.id
    # The page shows the server's pick: the list is resent for a while, never the pick, which would undo a click
    # made while the response was on its way.
    up = live.poll_write(db, view, cache, now=0.5, page=PageChapter(chapter.id, pending=False))
    assert up.chapters is not None and not up.select
    # The writer picked the other chapter; the server has not opened it yet: the page's pick stays.
    assert not live.poll_write(db, view, cache, now=1.0, page=PageChapter(other.id, pending=True)).select
    # Answered (the page's pick is no longer pending) and opened: nothing to move.
    view.chapter_id = other.id
    up = live.poll_write(db, view, cache, now=1.5, page=PageChapter(other.id, pending=False))
    assert up.chapters is not None and not up.select
    # An older response landed last and shows the first chapter picked: the next poll puts the server's back.
    up = live.poll_write(db, view, cache, now=5.0, page=PageChapter(chapter.id, pending=False))
    assert up.chapters is None and up.select and up.selected == other.id
    # The open chapter deleted elsewhere: the page's pick is cleared.
    storage.delete_chapter(db, other.id)
    up = live.poll_write(db, view, cache, now=6.0, page=PageChapter(other.id, pending=False))
    assert [c for _, c in up.chapters] == [chapter.id] and up.select and up.selected is None


def test_an_api_caller_gets_the_pick_with_the_list(db):
    view, chapter, other = book(db)
    cache = LiveCache()
    up = live.poll_write(db, view, cache, now=0.0)
    assert up.chapters is not None and up.select and up.selected == chapter.id
    assert not live.poll_write(db, view, cache, now=5.0).select
    view.chapter_id = other.id
    up = live.poll_write(db, view, cache, now=6.0)
    assert up.chapters is not None and up.select and up.selected == other.id
