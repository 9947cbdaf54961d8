"""Chapter prompts: premise, lorebook, summaries of the chapters that do not fit, the text just before, instructions.

Owns the wording the model sees for chapter, summary and outline runs, and the token budget arithmetic. A prompt is
the user message; the chat template is applied when it is encoded (core.generation.text.encode_prompt), and the
prompt's tokens are counted that way, so the budget is exact. A chapter prompt is, in order: the premise (the
writer's Memory), the lorebook entries whose keywords appear in the recent text or the chapter's instructions
(within the project's lore share), the summaries of the earlier chapters that do not fit whole, as much of the
immediately preceding text as fits (whole chapters, then the end of the one before them), and the chapter's
instructions (its Author's Note); when continuing, the chapter's own text comes first of all. What each part took
and what was left out is reported with the prompt (``PromptReport``), to be shown under the chapter.

No torch here: a tokenizer (anything with ``__call__`` / ``decode`` and, optionally, a chat template) is enough.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from core.generation.text import encode_prompt
from storage.story import keywords_of

PROMPT_MARGIN = 64  # tokens kept free besides the prompt and the output (TokenSwift's verification block, slack)
TRIM_MARKER = "[… earlier text left out …] "
MIN_TEXT_TOKENS = 32  # below this, a trimmed excerpt is more confusing than helpful: leave it out
LORE_SCAN_CHARS = 4000  # "the recent text" that brings a lorebook entry in: about the last thousand tokens
SUMMARY_SHARE = 0.5  # summaries may take at most this part of the room left for the story so far
SUMMARY_TOKENS = 200  # a summary run's length
SUMMARY_WORDS = 120
OUTLINE_TOKENS = 900  # an outline run's length

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


class LoreLike(Protocol):
    name: str
    keywords: str
    text: str


@dataclass
class PromptReport:
    """What went into a chapter prompt (token counts are of each part alone; ``total`` of the whole prompt)."""

    budget: int
    total: int = 0
    own_tokens: int = 0  # the chapter's own text (when continuing)
    lore: list[str] = field(default_factory=list)  # entries put in, by name
    lore_left_out: list[str] = field(default_factory=list)  # entries that applied but did not fit the share
    lore_tokens: int = 0
    summaries: list[int] = field(default_factory=list)  # chapter numbers (1-based)
    summaries_left_out: list[int] = field(default_factory=list)  # summaries that did not fit
    unsummarized: list[int] = field(default_factory=list)  # earlier chapters left out that have no summary
    summary_tokens: int = 0
    whole: list[int] = field(default_factory=list)  # earlier chapters put in whole
    tail_chapter: int | None = None  # the earlier chapter whose end is put in
    tail_tokens: int = 0
    text_tokens: int = 0  # earlier text in all (whole chapters and the tail, headings included)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ChapterPrompt:
    text: str
    report: PromptReport


def prompt_budget(context: int, max_new_tokens: int, margin: int = PROMPT_MARGIN) -> int:
    """Tokens the prompt (chat template included) may take: context - max_new_tokens - margin."""
    return context - max_new_tokens - margin


def applicable_lore(lore: Sequence[LoreLike], scan: str) -> list[LoreLike]:
    """The entries (in their order) with a keyword in `scan`: whole words or phrases, any case."""
    found = []
    for entry in lore:
        words = keywords_of(entry.keywords)
        if any(re.search(rf"(?<!\w){re.escape(w)}(?!\w)", scan, re.IGNORECASE) for w in words):
            found.append(entry)
    return found


def build_chapter_prompt(project: ProjectLike, chapters: Sequence[ChapterLike], chapter: ChapterLike, tokenizer: Any,
                         max_prompt_tokens: int, mode: str = "generate", lore: Sequence[LoreLike] = (),
                         lore_tokens: int | None = None) -> ChapterPrompt:
    """The prompt for writing (mode "generate"/"regenerate") or continuing ("continue"/"resume") `chapter`.

    `chapters` are the project's chapters with their text and summary (any order; those before `chapter` by
    position are the story so far). The result, encoded with the chat template, takes at most `max_prompt_tokens`
    tokens. Priority: the chapter's own text (when continuing), then lorebook entries up to `lore_tokens` (default:
    the project's ``lore_tokens``), then the summaries (at most SUMMARY_SHARE of what is left; the oldest go first)
    of the earlier chapters that do not fit whole, then the immediately preceding text. Raises ValueError when the
    premise and instructions alone do not fit.
    """
    continuing = mode in ("continue", "resume")
    work, part, so_far_label = WORDING.get(project.kind, WORDING["other"])
    number = chapter.position + 1
    preceding = sorted((c for c in chapters if c.position < chapter.position and c.id != chapter.id),
                       key=lambda c: c.position)
    own = chapter.text.strip() if continuing else ""

    def render(lore_part: list[str], summary_part: list[str], story_part: list[str], own_part: str) -> str:
        lines = [f'You are writing a {work} titled "{project.title.strip()}", one {part} at a time.']
        if project.premise.strip():
            lines.append(f"Premise: {project.premise.strip()}")
        if lore_part:
            lines.append("Notes on the world of the story:\n" + "\n".join(lore_part))
        if summary_part:
            lines.append(f"Summaries of the earlier {part}s:\n" + "\n".join(summary_part))
        if story_part:
            lines.append(f"{so_far_label}:\n\n" + "\n\n".join(story_part))
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

    fixed = count(render([], [], [], ""))
    if fixed > max_prompt_tokens:
        raise ValueError(f"the premise and {part} instructions alone take {fixed} tokens, but only "
                         f"{max(max_prompt_tokens, 0)} fit next to the requested output; shorten them or lower "
                         f"max new tokens")
    recent = "\n".join(c.text for c in preceding[-2:]) + "\n" + own
    applicable = applicable_lore(lore, chapter.instructions + "\n" + recent[-LORE_SCAN_CHARS:])
    share = getattr(project, "lore_tokens", 0) if lore_tokens is None else lore_tokens
    blocks = [f"{_heading(part, c)}\n\n{c.text.strip()}" for c in preceding]
    block_tokens = [_n_tokens(tokenizer, b) + 2 if c.text.strip() else 0 for b, c in zip(blocks, preceding)]
    lines = [f"- {_label(part, c)[:1].upper()}{_label(part, c)[1:]}: {' '.join(c.summary.split())}"
             if getattr(c, "summary", "").strip() else "" for c in preceding]
    line_tokens = [_n_tokens(tokenizer, line) + 1 if line else 0 for line in lines]
    slack = 0  # the joins between parts cost a few tokens more than the parts alone: found by counting, below
    while True:
        report = PromptReport(budget=max_prompt_tokens)
        room = max_prompt_tokens - fixed - slack
        own_part = _tail(tokenizer, own, room)
        report.own_tokens = _n_tokens(tokenizer, own_part)
        room -= report.own_tokens
        # Lorebook: whole entries in the writer's order, within the share.
        lore_part: list[str] = []
        for entry in applicable:
            line = f"- {entry.name.strip()}: {' '.join(entry.text.split())}"
            cost = _n_tokens(tokenizer, line + "\n")
            if report.lore_tokens + cost <= min(share, room):
                lore_part.append(line)
                report.lore.append(entry.name)
                report.lore_tokens += cost
            else:
                report.lore_left_out.append(entry.name)
        room -= report.lore_tokens
        # The story so far: whole chapters from the most recent back, the summaries of those before them, and the
        # end of the chapter just before the whole ones.
        start, first, cost = _select(block_tokens, line_tokens, room)  # preceding[start:] go in whole
        summaries = [i for i in range(first, start) if lines[i]]
        story = [blocks[i] for i in range(start, len(preceding)) if preceding[i].text.strip()]
        tail = ""
        if start > 0 and preceding[start - 1].text.strip():
            heading = _heading(part, preceding[start - 1])
            tail = _tail(tokenizer, preceding[start - 1].text.strip(), room - cost - _n_tokens(tokenizer, heading) - 4)
            if tail:
                story.insert(0, f"{heading}\n\n{tail}")
        prompt = render(lore_part, [lines[i] for i in summaries], story, own_part)
        over = count(prompt) - max_prompt_tokens
        if over <= 0:
            break
        slack += over + 8
    report.total = count(prompt)
    report.summaries = [preceding[i].position + 1 for i in summaries]
    report.summary_tokens = sum(line_tokens[i] for i in summaries)
    kept = set(summaries) | set(range(start, len(preceding)))
    report.summaries_left_out = [preceding[i].position + 1 for i in range(len(preceding))
                                 if lines[i] and i not in kept]
    report.unsummarized = [preceding[i].position + 1 for i in range(start) if not lines[i]
                           and preceding[i].text.strip()]
    report.whole = [preceding[i].position + 1 for i in range(start, len(preceding)) if preceding[i].text.strip()]
    if tail:
        report.tail_chapter = preceding[start - 1].position + 1
        report.tail_tokens = _n_tokens(tokenizer, tail)
    report.text_tokens = sum(_n_tokens(tokenizer, b) for b in story)
    return ChapterPrompt(prompt, report)


def _select(block_tokens: list[int], line_tokens: list[int], room: int) -> tuple[int, int, int]:
    """(start, first, cost): the earlier chapters [start:] go in whole and the summaries of [first:start], the
    newest summaries kept within SUMMARY_SHARE of `room`, with `start` as small as `room` allows."""
    share = int(max(room, 0) * SUMMARY_SHARE)
    best = (len(block_tokens), len(block_tokens), 0)
    whole = 0  # tokens of the chapters [start:]
    for start in range(len(block_tokens), -1, -1):
        whole += block_tokens[start] if start < len(block_tokens) else 0
        first, total = start, 0
        while first > 0 and total + line_tokens[first - 1] <= share:
            first -= 1
            total += line_tokens[first]
        cost = whole + total
        if cost > room:
            break
        best = (start, first, cost)
    return best


def summary_prompt(project: ProjectLike, chapter: ChapterLike, tokenizer: Any, max_prompt_tokens: int) -> str:
    """The prompt of a summary run: the chapter's text (its end, if all of it does not fit) and what to write."""
    work, part, _ = WORDING.get(project.kind, WORDING["other"])
    label = _label(part, chapter)

    def render(text: str) -> str:
        return (f'Here is {label} of the {work} "{project.title.strip()}".\n\n{text}\n\n'
                f"Summarize {label} in one paragraph of at most {SUMMARY_WORDS} words: who appears, what happens, "
                "what changes, and what is left open. Write only the summary.")

    fixed = len(encode_prompt(tokenizer, render("")))
    text = _tail(tokenizer, chapter.text.strip(), max_prompt_tokens - fixed - 8)
    if not text:
        raise ValueError(f"{label} has no text to summarize (or none fits the model's context)")
    return render(text)


def outline_prompt(project: ProjectLike, n_chapters: int) -> str:
    """The prompt of an outline run: a numbered list of `n_chapters` parts from the premise (the form small models
    follow most often), each a title and a sentence or two of what happens."""
    work, part, _ = WORDING.get(project.kind, WORDING["other"])
    premise = project.premise.strip() or "(no premise yet: invent one that suits the title)"
    return (f'Write a numbered list of the {n_chapters} {part}s of a {work} titled "{project.title.strip()}".\n'
            f"Premise: {premise}\n\n"
            f"Each item is the {part}'s title, a colon, and one or two sentences of what happens in it, like this "
            f"item of another {work}'s list:\n"
            "1. The Key: Ana receives the key to her grandmother's bakery and opens it for the first time.")


OUTLINE_LINE = re.compile(r"^\s*(?:[#*\s]*)(?:chapter|section|part)?\s*(\d+)\s*[:.)\-–]\s*(.+)$", re.IGNORECASE)


def parse_outline(text: str) -> list[tuple[str, str]]:
    """(title, instructions) rows from an outline run's text: numbered lines, "Title - what happens" each; a line
    without a number continues the previous row's instructions. Titles lose their quotes and emphasis marks."""
    rows: list[list[str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        m = OUTLINE_LINE.match(line)
        if m is None:
            if rows:
                rows[-1][1] = f"{rows[-1][1]} {line}".strip()
            continue
        body = m.group(2).strip()
        title, _, rest = _split(body)
        rows.append([title, rest])
    return [(t.strip(' "*_'), d.strip()) for t, d in rows]


def _split(body: str) -> tuple[str, str, str]:
    m = re.search(r"\s[-–—]\s|:\s|\.\s", body)
    if m is None:
        return body, "", ""
    return body[:m.start()], m.group(), body[m.end():]


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
