"""Chapter prompts: premise + chapter instructions + as much of the text before it as the model's context allows.

Owns the wording the model sees for chapter runs and the token budget arithmetic. The prompt is the user message;
the chat template is applied when it is encoded (core.generation.text.encode_prompt), and the prompt's tokens are
counted that way, so the budget is exact. When the earlier text does not fit, the oldest part goes: the model needs the
last scenes far more than the first ones, and the premise and instructions carry the long-range plan.

No torch here: a tokenizer (anything with ``__call__`` / ``decode`` and, optionally, a chat template) is enough.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from core.generation.text import encode_prompt

PROMPT_MARGIN = 64  # tokens kept free besides the prompt and the output (TokenSwift's verification block, slack)
TRIM_MARKER = "[… earlier text left out …] "
MIN_TEXT_TOKENS = 32  # below this, a trimmed excerpt is more confusing than helpful: leave it out

# How each kind of project names itself and its parts.
WORDING = {
    "novel": ("novel", "chapter", "Story so far"),
    "report": ("report", "section", "Report so far"),
    "other": ("document", "part", "Text so far"),
}


class ProjectLike(Protocol):
    title: str
    kind: str
    premise: str


class ChapterLike(Protocol):
    id: int
    position: int
    title: str
    instructions: str
    text: str


def prompt_budget(context: int, max_new_tokens: int, margin: int = PROMPT_MARGIN) -> int:
    """Tokens the prompt (chat template included) may take: context - max_new_tokens - margin."""
    return context - max_new_tokens - margin


def build_chapter_prompt(project: ProjectLike, chapters: Sequence[ChapterLike], chapter: ChapterLike, tokenizer: Any,
                         max_prompt_tokens: int, mode: str = "generate") -> str:
    """The prompt for writing (mode "generate"/"regenerate") or continuing ("continue"/"resume") `chapter`.

    `chapters` are the project's chapters with their text (any order; those before `chapter` by position are the
    story so far). The result, encoded with the chat template, takes at most `max_prompt_tokens` tokens: the
    chapter's own text (when continuing) is kept first, then as much of the preceding text as fits, older text
    trimmed from the start with a short marker. Raises ValueError when the premise and instructions alone do not fit.
    """
    continuing = mode in ("continue", "resume")
    work, part, so_far_label = WORDING.get(project.kind, WORDING["other"])
    number = chapter.position + 1
    preceding = sorted((c for c in chapters if c.position < chapter.position and c.id != chapter.id),
                       key=lambda c: c.position)
    story = "\n\n".join(f"{_heading(part, c)}\n\n{c.text.strip()}" for c in preceding if c.text.strip())
    own = chapter.text.strip() if continuing else ""

    def render(story_part: str, own_part: str) -> str:
        lines = [f'You are writing a {work} titled "{project.title.strip()}", one {part} at a time.']
        if project.premise.strip():
            lines.append(f"Premise: {project.premise.strip()}")
        if story_part:
            lines.append(f"{so_far_label}:\n\n{story_part}")
        label = _label(part, chapter)
        if chapter.instructions.strip():
            lines.append(f"Instructions for {part} {number}: {chapter.instructions.strip()}")
        if continuing and own_part:
            lines.append(f"{label}, as written so far:\n\n{own_part}")
            lines.append(f"Continue {part} {number} from exactly where it stops. Do not repeat what is already "
                         f"written; write only the new text, in the same style.")
        else:
            follow = ", continuing naturally from what came before" if story_part else ""
            lines.append(f"Now write {label}. Write only the text of the {part}, in full prose{follow}.")
        return "\n\n".join(lines)

    def count(text: str) -> int:
        return len(encode_prompt(tokenizer, text))

    fixed = count(render("", ""))
    if fixed > max_prompt_tokens:
        raise ValueError(f"the premise and {part} instructions alone take {fixed} tokens, but only "
                         f"{max(max_prompt_tokens, 0)} fit next to the requested output; shorten them or lower "
                         f"max new tokens")
    # The headings and labels cost a few tokens beyond the bare texts; the loop below corrects the estimate.
    room = max_prompt_tokens - fixed
    for _ in range(8):
        own_part = _tail(tokenizer, own, room)
        story_part = _tail(tokenizer, story, room - _n_tokens(tokenizer, own_part)) if story else ""
        prompt = render(story_part, own_part)
        over = count(prompt) - max_prompt_tokens
        if over <= 0:
            return prompt
        room -= over + 8
    return render("", _tail(tokenizer, own, room))


def _heading(part: str, c: ChapterLike) -> str:
    label = _label(part, c)
    return f"## {label[:1].upper()}{label[1:]}"


def _label(part: str, c: ChapterLike) -> str:
    number = c.position + 1
    title = c.title.strip()
    # add_chapter names untitled chapters "Chapter N": repeating that as a title reads badly.
    if not title or title.lower() in (f"{part} {number}", f"chapter {number}"):
        return f"{part} {number}"
    return f'{part} {number}, "{title}"'


def _n_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else 0


def _tail(tokenizer: Any, text: str, max_tokens: int) -> str:
    """The end of `text` within `max_tokens` tokens, starting at a word boundary, with a marker if cut."""
    if not text or max_tokens <= 0:
        return ""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if len(ids) <= max_tokens:
        return text
    keep = max_tokens - _n_tokens(tokenizer, TRIM_MARKER) - 4  # the word-boundary snap may add a token or two
    if keep < MIN_TEXT_TOKENS:
        return ""
    start = enc["offset_mapping"][len(ids) - keep][0]
    # Start at the next paragraph or sentence or word boundary so the excerpt opens on whole words.
    for sep in ("\n", ". ", " "):
        cut = text.find(sep, start, start + 200)
        if cut >= 0:
            start = cut + len(sep)
            break
    return TRIM_MARKER + text[start:].lstrip()
