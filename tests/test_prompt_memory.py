"""app.prompting's story memory with the default model's real tokenizer: summaries of the chapters that do not fit,
lorebook entries, the exact budget, what is kept in which order, and the report of it; outline parsing."""

from types import SimpleNamespace

import pytest

from app import views
from app.prompting import (
    SUMMARY_SHARE,
    TRIM_MARKER,
    applicable_lore,
    build_chapter_prompt,
    outline_prompt,
    parse_outline,
    summary_prompt,
)
from core.generation.text import encode_prompt


@pytest.fixture(scope="module")
def tokenizer():
    from core.runtime.loading import load_tokenizer, resolve

    return load_tokenizer(resolve("smollm2-135m")[0])


def project(lore_tokens=200):
    return SimpleNamespace(title="The Keeper", kind="novel", premise="A lighthouse keeper finds a message.",
                           lore_tokens=lore_tokens)


def text(tag, n):
    return " ".join(f"{tag} sentence {i} tells of the sea." for i in range(n))


def novel(n=8, sentences=60, summarized=None, last_instructions=""):
    """`n` written chapters ("C0" ... texts, "S0" ... summaries for those in `summarized`) and an empty last one."""
    summarized = range(n) if summarized is None else summarized
    chapters = [SimpleNamespace(id=100 + i, position=i, title=f"Chapter {i + 1}", instructions="",
                                text=text(f"C{i}", sentences),
                                summary=f"S{i}: the keeper meets ghost number {i}." if i in summarized else "")
                for i in range(n)]
    chapters.append(SimpleNamespace(id=100 + n, position=n, title="The end", instructions=last_instructions, text="",
                                    summary=""))
    return chapters


def lore_entry(name, keywords, body):
    return SimpleNamespace(name=name, keywords=keywords, text=body)


def count(tokenizer, prompt):
    return len(encode_prompt(tokenizer, prompt))


@pytest.mark.parametrize("budget", [300, 700, 1500, 3000])
def test_summaries_stand_in_for_chapters_that_do_not_fit_within_the_exact_budget(tokenizer, budget):
    chapters = novel()
    built = build_chapter_prompt(project(), chapters, chapters[-1], tokenizer, budget)
    prompt, r = built.text, built.report
    assert r.total == count(tokenizer, prompt) <= budget
    assert r.total >= budget - 40  # the room is used, not left idle
    # Every earlier chapter is in whole, or by its summary and possibly its end, or reported left out.
    for c in chapters[:-1]:
        number = c.position + 1
        summary_in, whole_in = f"S{c.position}:" in prompt, c.text in prompt
        assert summary_in == (number in r.summaries)
        assert whole_in == (number in r.whole)
        assert (number in r.summaries_left_out) == (not summary_in and not whole_in)
        assert not (summary_in and whole_in)  # a chapter in whole needs no summary
    # Whole chapters are the most recent ones; the chapter just before them contributes its end.
    assert r.whole == list(range(9 - len(r.whole), 9))
    if r.tail_chapter is not None:
        assert r.tail_chapter == 8 - len(r.whole)
        tail = chapters[r.tail_chapter - 1].text
        assert tail[-60:] in prompt and tail not in prompt and TRIM_MARKER in prompt
        assert r.tail_chapter in r.summaries
    # Left-out summaries are the oldest ones; the summaries take at most their share.
    if r.summaries_left_out:
        assert max(r.summaries_left_out) < min(r.summaries)
    assert r.summary_tokens <= SUMMARY_SHARE * budget
    # Order: premise, summaries, the story so far (oldest first), the instructions.
    marks = [prompt.index("Premise:")]
    marks += [prompt.index(f"S{n - 1}:") for n in r.summaries]
    if r.tail_chapter is not None:
        marks.append(prompt.index(TRIM_MARKER))
    marks += [prompt.index(chapters[n - 1].text) for n in r.whole]
    marks.append(prompt.index('Now write chapter 9, "The end".'))
    assert marks == sorted(marks)


def test_a_tight_budget_keeps_the_newest_summaries_and_the_end_of_the_last_chapter(tokenizer):
    chapters = novel()
    r = build_chapter_prompt(project(), chapters, chapters[-1], tokenizer, 300).report
    assert r.whole == [] and r.tail_chapter == 8
    assert r.summaries == list(range(9 - len(r.summaries), 9)) and r.summaries_left_out == list(
        range(1, 9 - len(r.summaries)))
    assert 0 < len(r.summaries) < 8


def test_a_roomy_budget_takes_everything_whole(tokenizer):
    chapters = novel(n=3, sentences=10)
    built = build_chapter_prompt(project(), chapters, chapters[-1], tokenizer, 5000)
    r = built.report
    assert r.whole == [1, 2, 3] and r.summaries == [] and r.tail_chapter is None and r.summaries_left_out == []
    assert "Summaries of the earlier" not in built.text


def test_chapters_without_a_summary_are_reported(tokenizer):
    chapters = novel(summarized={0, 1})
    r = build_chapter_prompt(project(), chapters, chapters[-1], tokenizer, 1000).report
    assert r.summaries == [1, 2]
    # Chapters 3.. that are not in whole have no summary: their text is lost in part (the one whose end is in) or
    # in full, and the writer is told.
    assert r.unsummarized == [n for n in range(3, 9) if n not in r.whole]
    assert len(r.unsummarized) >= 2


def test_lorebook_entries_come_in_by_keyword_within_their_share(tokenizer):
    chapters = novel(n=3, sentences=5, last_instructions="Mara climbs to the LAMP room.")
    chapters[2].text += " The harbour of Port Ellis is quiet."
    entries = [lore_entry("Mara", "Mara, keeper", "The keeper, fifty, stubborn, afraid of nothing but silence."),
               lore_entry("Port Ellis", "Port Ellis", "A fishing town of grey roofs."),
               lore_entry("The lamp", "lamp", "A Fresnel lens from 1890 " + "that turns " * 40),
               lore_entry("Captain", "captain, Maraschino", "Never appears in this chapter.")]
    assert [e.name for e in applicable_lore(entries, "mara and the lamp")] == ["Mara", "The lamp"]
    assert applicable_lore(entries, "a maraschino cherry") == [entries[3]]  # whole words, any case
    built = build_chapter_prompt(project(lore_tokens=60), chapters, chapters[-1], tokenizer, 2000, lore=entries)
    prompt, r = built.text, built.report
    # Mara (instructions) and Port Ellis (recent text) fit the share; the long lamp entry applies but does not.
    assert r.lore == ["Mara", "Port Ellis"] and r.lore_left_out == ["The lamp"]
    assert 0 < r.lore_tokens <= 60
    assert "- Mara: The keeper, fifty" in prompt and "A fishing town" in prompt
    assert "Fresnel" not in prompt and "Never appears" not in prompt
    assert prompt.index("Premise:") < prompt.index("- Mara:") < prompt.index("Story so far:")
    roomy = build_chapter_prompt(project(lore_tokens=400), chapters, chapters[-1], tokenizer, 2000, lore=entries)
    assert roomy.report.lore == ["Mara", "Port Ellis", "The lamp"]
    none = build_chapter_prompt(project(lore_tokens=0), chapters, chapters[-1], tokenizer, 2000, lore=entries)
    assert none.report.lore == [] and "Notes on the world" not in none.text


def test_keywords_only_in_old_chapters_do_not_bring_lore_in(tokenizer):
    chapters = novel(n=4, sentences=5)
    chapters[0].text += " The lighthouse at Gull Rock burned."
    entries = [lore_entry("Gull Rock", "Gull Rock", "An old ruin.")]
    r = build_chapter_prompt(project(), chapters, chapters[-1], tokenizer, 3000, lore=entries).report
    assert r.lore == []  # chapter 1 is not the recent text of chapter 5


def test_continuing_keeps_the_chapters_own_text_first(tokenizer):
    chapters = novel(n=3, sentences=80)
    chapters[-1].text = text("Own", 30)
    built = build_chapter_prompt(project(), chapters, chapters[-1], tokenizer, 900, mode="continue")
    r = built.report
    assert r.total == count(tokenizer, built.text) <= 900
    assert r.own_tokens > 0 and chapters[-1].text in built.text
    assert built.text.index("Summaries of the earlier") < built.text.index("as written so far")


def test_the_report_reads_as_one_line():
    info = {"budget": 7104, "total": 5830, "own_tokens": 0, "lore": ["Mara"], "lore_left_out": ["The lamp"],
            "lore_tokens": 40, "summaries": [1, 2, 3, 4], "summaries_left_out": [], "unsummarized": [5],
            "summary_tokens": 200, "whole": [7, 8], "tail_chapter": 6, "tail_tokens": 5200, "text_tokens": 5300}
    line = views.prompt_line(info)
    assert "prompt 5,830 of 7,104 tokens: 330 premise/lore (1 lore), 4 summaries, chapters 7–8 whole, last 5,200 " \
           "tokens of chapter 6 · left out: chapter 5 (no summary); lore The lamp" in line
    assert views.prompt_line({}) == "" and views.prompt_line({"total": "x"}) == ""


def test_summary_and_outline_prompts(tokenizer):
    chapters = novel(n=1, sentences=400)
    prompt = summary_prompt(project(), chapters[0], tokenizer, 800)
    assert count(tokenizer, prompt) <= 800
    assert "C0 sentence 399 tells of the sea." in prompt and "Summarize chapter 1 in one paragraph" in prompt
    with pytest.raises(ValueError, match="no text to summarize"):
        summary_prompt(project(), chapters[1], tokenizer, 800)
    plan = outline_prompt(project(), 5)
    assert "the 5 chapters of a novel" in plan and "A lighthouse keeper finds a message." in plan


def test_parse_outline_reads_numbered_lines():
    raw = """Here is the plan:

Chapter 1: The Bottle - Mara finds a bottle on the rocks.
**Chapter 2: "Ink"** – She reads the letter;
it is dated 1890.
3. The Reply: Mara writes back.
Chapter 4. Silence
"""
    assert parse_outline(raw) == [
        ("The Bottle", "Mara finds a bottle on the rocks."),
        ("Ink", "She reads the letter; it is dated 1890."),
        ("The Reply", "Mara writes back."),
        ("Silence", ""),
    ]
    assert parse_outline("no numbers here") == []
