"""app.prompting with the default model's real tokenizer: wording, order, budget and trimming."""

from types import SimpleNamespace

import pytest

from app.prompting import TRIM_MARKER, build_chapter_prompt, prompt_budget
from core.generation.text import encode_prompt


@pytest.fixture(scope="module")
def tokenizer():
    from core.runtime.loading import load_tokenizer, resolve

    return load_tokenizer(resolve("smollm2-135m")[0])


def project(kind="novel", premise="A lighthouse keeper finds a message in a bottle."):
    return SimpleNamespace(title="The Keeper", kind=kind, premise=premise)


def chapter(position, text="", title=None, instructions=""):
    return SimpleNamespace(id=position + 10, position=position, title=title or f"Chapter {position + 1}",
                           instructions=instructions, text=text)


def sentences(tag, n):
    return " ".join(f"{tag} sentence number {i} tells of waves and the lamp." for i in range(n))


def build(*args, **kwargs):
    return build_chapter_prompt(*args, **kwargs).text


def n_tokens(tokenizer, prompt):
    return len(encode_prompt(tokenizer, prompt))


def test_generate_prompt_has_premise_instructions_and_earlier_chapters_in_order(tokenizer):
    chapters = [chapter(0, "First text.", "Dawn"), chapter(1, "Second text.", "Storm"),
                chapter(2, "", "The reply", "She writes back."), chapter(3, "Later text.")]
    prompt = build(project(), chapters, chapters[2], tokenizer, 2000)
    assert 'You are writing a novel titled "The Keeper"' in prompt
    assert "Premise: A lighthouse keeper finds a message in a bottle." in prompt
    assert "Instructions for chapter 3: She writes back." in prompt
    assert prompt.index('Chapter 1, "Dawn"') < prompt.index("First text.") < prompt.index("Second text.")
    assert 'Now write chapter 3, "The reply".' in prompt
    assert "Later text." not in prompt  # later chapters are not the story so far
    assert TRIM_MARKER not in prompt


def test_untitled_first_chapter_of_a_report(tokenizer):
    chapters = [chapter(0)]
    prompt = build(project("report", premise=""), chapters, chapters[0], tokenizer, 500)
    assert 'writing a report titled "The Keeper", one section at a time' in prompt
    assert "Now write section 1." in prompt and "Chapter 1" not in prompt
    assert "Premise" not in prompt and "so far" not in prompt


def test_continue_includes_the_chapter_text_so_far(tokenizer):
    chapters = [chapter(0, "Earlier chapter."), chapter(1, "She opened the bottle and")]
    prompt = build(project(), chapters, chapters[1], tokenizer, 1000, mode="continue")
    assert prompt.index("Earlier chapter.") < prompt.index("She opened the bottle and")
    assert "Continue chapter 2 from exactly where it stops" in prompt
    generate = build(project(), chapters, chapters[1], tokenizer, 1000, mode="generate")
    assert "She opened the bottle" not in generate


def test_long_story_is_trimmed_from_the_start_to_fit(tokenizer):
    chapters = [chapter(0, sentences("Alpha", 300)), chapter(1, sentences("Beta", 300)), chapter(2)]
    budget = 600
    prompt = build(project(), chapters, chapters[2], tokenizer, budget)
    assert budget - 40 <= n_tokens(tokenizer, prompt) <= budget  # fills the budget, never exceeds it
    assert TRIM_MARKER in prompt
    assert "Beta sentence number 299 tells of waves and the lamp." in prompt  # the most recent text is kept
    assert "Alpha" not in prompt  # the oldest goes first
    excerpt = prompt.split(TRIM_MARKER)[1]
    assert excerpt.startswith("Beta sentence number")  # starts on a sentence boundary, not mid-word
    assert "Now write chapter 3." in prompt  # the instructions at the end survive


def test_continue_keeps_the_end_of_the_chapter_first(tokenizer):
    chapters = [chapter(0, sentences("Alpha", 200)), chapter(1, sentences("Beta", 400))]
    prompt = build(project(), chapters, chapters[1], tokenizer, 500, mode="continue")
    assert n_tokens(tokenizer, prompt) <= 500
    assert "Beta sentence number 399" in prompt
    assert "Alpha" not in prompt  # the chapter's own text had priority over the earlier chapter


def test_premise_too_long_for_the_budget_is_refused(tokenizer):
    chapters = [chapter(0)]
    with pytest.raises(ValueError, match=r"premise and chapter instructions alone take \d+ tokens"):
        build(project(premise=sentences("Premise", 100)), chapters, chapters[0], tokenizer, 200)


def test_prompt_budget():
    assert prompt_budget(8192, 1024) == 8192 - 1024 - 64
    assert prompt_budget(4096, 4000, margin=0) == 96
