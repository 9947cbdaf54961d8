"""Queueing generation work: settings validation, chapter runs, resume chains and comparisons.

What the UI calls to put work in the database; the worker (app/worker.py) picks it up. Light on purpose: no torch
(the UI process may run without the model), only storage. The numbers below mirror core's: `LIMITS` is the range
the studio accepts, a subset of what core.sampling / core.decoding accept (tests/test_jobs.py checks every bound
against core), and the worker validates once more with core's own classes before generating.

Stored run settings are the normalized dict of `validate_settings` plus, for a resume run, ``resume_of``: the id
of the run it continues. A resume run's own output is only the new part; `resume_chain` walks back to the first
run so the worker can feed every earlier token id to the engine.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import storage as st
from app.prompting import OUTLINE_TOKENS, SUMMARY_TOKENS, outline_prompt
from storage.queries import CHAPTER_MODES

DEFAULT_CONTEXT = 8192  # smollm2-135m, the default model
PROMPT_RESERVE = 512  # tokens max_new_tokens must leave for the prompt (template, premise, instructions, story)
MAX_SEED = 2**63 - 1  # core.generation.sampling.MAX_SEED
RESUMABLE = ("interrupted", "cancelled", "failed")
INTERNAL_KEYS = ("resume_of",)  # stored by queue_chapter_run, not user settings
MAX_CHAIN = 1000
MAX_OUTLINE_CHAPTERS = 60

# The studio preset (core.generation.sampling.PRESETS["studio"]) plus the run's length, method and seed.
DEFAULT_SETTINGS: dict[str, Any] = {
    "max_new_tokens": 1024,
    "method": "tokenswift",
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 0,
    "min_p": 0.0,
    "penalty": 1.1,
    "penalty_window": 1024,
    "seed": 0,
    "ignore_eos": False,  # "write to full length": off, the model may end the chapter itself
}

# Inclusive (min, max) of each numeric setting, for sliders and validation. max_new_tokens' maximum is for the
# default model's context; validate_settings takes the real context when it is known.
LIMITS: dict[str, tuple[float, float]] = {
    "max_new_tokens": (1, DEFAULT_CONTEXT - PROMPT_RESERVE),
    "temperature": (0.0, 2.0),
    "top_p": (0.01, 1.0),
    "top_k": (0, 1000),
    "min_p": (0.0, 0.5),
    "penalty": (1.0, 2.0),
    "penalty_window": (1, 16384),
    "seed": (0, MAX_SEED),
}
INT_SETTINGS = ("max_new_tokens", "top_k", "penalty_window", "seed")
METHODS = ("ar", "tokenswift")
LABELS = {
    "max_new_tokens": "Max new tokens", "method": "Method", "temperature": "Temperature", "top_p": "Top-p",
    "top_k": "Top-k", "min_p": "Min-p", "penalty": "Penalty θ", "penalty_window": "Penalty window",
    "seed": "Seed", "ignore_eos": "Write to full length (ignore_eos)",
}
HINTS = {"temperature": " (0 = greedy)", "top_k": " (0 = off)", "min_p": " (0 = off)", "penalty": " (1 = off)",
         "top_p": " (1 = off)"}


def _number(name: str, value: Any) -> float | int:
    label = LABELS[name]
    if isinstance(value, bool):  # bool is an int subclass: True must not pass as 1
        raise ValueError(f"{label} must be a number, got {value!r}.")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(f"{label} must be a number, got {value!r}.") from None
    if not isinstance(value, (int, float)):
        raise ValueError(f"{label} must be a number, got {type(value).__name__}.")
    if not math.isfinite(value):
        raise ValueError(f"{label} must be a finite number, got {value!r}.")
    if name in INT_SETTINGS:
        # Sliders and JSON hand over 1024.0 for an integer: accept whole floats, refuse 0.5.
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{label} must be a whole number, got {value!r}.")
        return int(value)
    return float(value)


def validate_settings(raw: Mapping[str, Any] | None, context: int | None = None,
                      max_tokens: int | None = None) -> dict[str, Any]:
    """A complete, normalized settings dict (defaults filled in) from the UI's values.

    Missing or None values take DEFAULT_SETTINGS'. Raises ValueError naming the field for an unknown key, a wrong
    type or a value out of LIMITS, when max_new_tokens does not leave PROMPT_RESERVE tokens of the model's
    `context` (default: the default model's 8192) for the prompt, and when it passes a shared studio's cap
    `max_tokens` (app.hosting).
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"Settings must be a mapping of names to values, got {type(raw).__name__}.")
    unknown = sorted(str(k) for k in raw if k not in DEFAULT_SETTINGS)
    if unknown:
        raise ValueError(f"Unknown setting(s): {', '.join(unknown)}; known: {', '.join(DEFAULT_SETTINGS)}.")
    out = dict(DEFAULT_SETTINGS)
    for name, value in raw.items():
        if value is None:
            continue
        if name == "method":
            if value not in METHODS:
                raise ValueError(f"Method must be one of {', '.join(METHODS)}, got {value!r}.")
            out[name] = value
        elif name == "ignore_eos":
            if not isinstance(value, bool):
                raise ValueError(f"{LABELS[name]} must be true or false, got {value!r}.")
            out[name] = value
        else:
            out[name] = _number(name, value)
    for name, (low, high) in LIMITS.items():
        if name == "max_new_tokens":
            continue
        if not low <= out[name] <= high:
            raise ValueError(f"{LABELS[name]} must be between {_fmt(low)} and {_fmt(high)}{HINTS.get(name, '')}, "
                             f"got {_fmt(out[name])}.")
    ctx = DEFAULT_CONTEXT if context is None else int(context)
    high = ctx - PROMPT_RESERVE
    if not 1 <= out["max_new_tokens"] <= high:
        raise ValueError(f"Max new tokens must be between 1 and {high:,} (the model's context is {ctx:,} tokens and "
                         f"{PROMPT_RESERVE} are kept for the prompt), got {out['max_new_tokens']:,}.")
    if max_tokens is not None and out["max_new_tokens"] > max_tokens:
        raise ValueError(f"Max new tokens is limited to {max_tokens:,} per run on this shared studio, got "
                         f"{out['max_new_tokens']:,}. Write longer chapters with Continue.")
    return out


def _fmt(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else f"{x}"


def user_settings(stored: Mapping[str, Any]) -> dict[str, Any]:
    """A run's stored settings without the worker's bookkeeping keys (``resume_of``)."""
    return {k: v for k, v in stored.items() if k not in INTERNAL_KEYS}


def resume_chain(db: st.Database, run: st.Run) -> list[st.Run]:
    """The runs `run` resumes, oldest first (empty unless it is a resume run).

    Their token ids, concatenated, are what the engine must be given as `resume_ids`. Raises ValueError for a
    broken chain (a missing run or a cycle).
    """
    chain: list[st.Run] = []
    seen = {run.id}
    current = run
    while (parent_id := current.settings.get("resume_of")) is not None:
        if not isinstance(parent_id, int) or parent_id in seen or len(chain) >= MAX_CHAIN:
            raise ValueError(f"Run {run.id} resumes an invalid run reference ({parent_id!r}).")
        try:
            current = st.get_run(db, parent_id)
        except st.NotFoundError:
            raise ValueError(f"Run {run.id} resumes run {parent_id}, which no longer exists.") from None
        seen.add(parent_id)
        chain.append(current)
    chain.reverse()
    return chain


def queue_chapter_run(db: st.Database, chapter_id: int, mode: str, settings: Mapping[str, Any] | None, *,
                      model: str, heads: str | None = None, context: int | None = None, owner: str | None = None,
                      max_queued: int | None = None, max_tokens: int | None = None) -> st.Run:
    """Queue a chapter run ("generate", "continue", "regenerate" or "resume") and return it.

    Settings are validated before anything is written. "resume" continues the chapter's latest run, which must
    have ended interrupted, cancelled or failed after writing something: it reuses that run's prompt, method and
    sampling settings (anything else would not continue it exactly); only ``max_new_tokens`` may be taken from
    `settings`, to let a run go further than first planned. The resumed run's id is stored as ``resume_of``.
    ``owner`` scopes the chapter to its writer; ``max_queued`` and ``max_tokens`` are a shared studio's limits.
    Raises ValueError (storage's ValidationError included) with a readable message.
    """
    limits = {"owner": owner, "max_queued": max_queued}
    if mode not in CHAPTER_MODES:
        raise ValueError(f"Unknown chapter mode {mode!r}; expected one of: {', '.join(CHAPTER_MODES)}.")
    if mode != "resume":
        normalized = validate_settings(settings, context, max_tokens)
        return st.start_chapter_run(db, chapter_id, mode, method=normalized["method"], model=model,
                                    settings=normalized, heads=heads, **limits)

    latest = st.latest_run_for_chapter(db, chapter_id, owner=owner)
    if latest is None:
        raise ValueError("Nothing to resume: this chapter has no run yet.")
    if latest.status not in RESUMABLE:
        raise ValueError(f"Nothing to resume: this chapter's latest run is {latest.status}; only an interrupted, "
                         "stopped or failed run can be resumed.")
    if latest.model != model:
        raise ValueError(f"The run to resume was written by model {latest.model!r}; resuming it with {model!r} "
                         "would not continue it. Use Continue instead.")
    chain = resume_chain(db, latest) + [latest]
    written = sum(r.n_tokens for r in chain)
    if written == 0:
        raise ValueError("Nothing to resume: the last run wrote no text. Generate the chapter again instead.")
    if not chain[0].prompt:
        raise ValueError("The run to resume has no saved prompt, so it cannot be continued exactly. "
                         "Use Continue instead.")
    try:
        base = validate_settings(user_settings(latest.settings), context)
    except ValueError as e:
        raise ValueError(f"The run to resume has unusable settings: {e} Use Continue instead.") from None
    if settings and settings.get("max_new_tokens") is not None:
        base = validate_settings({**base, "max_new_tokens": settings["max_new_tokens"]}, context, max_tokens)
    if written >= base["max_new_tokens"]:
        raise ValueError(f"Nothing to resume: {written:,} of {base['max_new_tokens']:,} tokens are already "
                         "written. Raise max new tokens to write further.")
    base["method"] = latest.method
    return st.start_chapter_run(db, chapter_id, "resume", method=latest.method, model=model,
                                settings={**base, "resume_of": latest.id}, heads=heads, prompt=chain[0].prompt,
                                **limits)


def queue_comparison(db: st.Database, prompt: str, settings: Mapping[str, Any] | None, *, model: str,
                     heads: str | None = None, project_id: int | None = None, context: int | None = None,
                     owner: str = st.LOCAL_OWNER, max_queued: int | None = None,
                     max_tokens: int | None = None) -> st.Comparison:
    """Queue the same prompt twice with the same settings and seed: plain AR decoding, then TokenSwift.

    The settings' ``method`` is ignored (each run has its own). Raises ValueError before writing anything.
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("The prompt cannot be empty.")
    normalized = validate_settings(settings, context, max_tokens)
    normalized.pop("method")  # each of the two runs has its own method column
    return st.create_comparison(db, prompt, model=model, settings=normalized, heads=heads, project_id=project_id,
                                owner=owner, max_queued=max_queued)


def _memory_settings(settings: Mapping[str, Any] | None, max_new_tokens: int, context: int | None) -> dict[str, Any]:
    """A summary or outline run's settings: the writer's sampling settings at that run's own length, with TokenSwift,
    and the model may end it (never "write to full length")."""
    base = validate_settings(user_settings(settings or {}), context)
    return {**base, "max_new_tokens": max_new_tokens, "method": "tokenswift", "ignore_eos": False}


def queue_summary(db: st.Database, chapter_id: int, settings: Mapping[str, Any] | None, *, model: str,
                  heads: str | None = None, context: int | None = None, owner: str | None = None, auto: bool = False,
                  max_queued: int | None = None) -> st.Run | None:
    """Queue a run that writes the chapter's summary (see storage.queue_summary for `auto`). Its prompt is built by
    the worker, from the chapter's text as it is then."""
    normalized = _memory_settings(settings, SUMMARY_TOKENS, context)
    return st.queue_summary(db, chapter_id, model=model, settings=normalized, heads=heads, owner=owner, auto=auto,
                            max_queued=None if auto else max_queued)


def queue_outline(db: st.Database, project_id: int, n_chapters: int, settings: Mapping[str, Any] | None, *,
                  model: str, heads: str | None = None, context: int | None = None, owner: str = st.LOCAL_OWNER,
                  max_queued: int | None = None) -> st.Run:
    """Queue a run that proposes a plan of `n_chapters` chapters from the project's premise (app.prompting)."""
    if isinstance(n_chapters, bool) or not isinstance(n_chapters, (int, float)) or not float(n_chapters).is_integer() \
            or not 1 <= n_chapters <= MAX_OUTLINE_CHAPTERS:
        raise ValueError(f"An outline has from 1 to {MAX_OUTLINE_CHAPTERS} chapters, got {n_chapters!r}.")
    project = st.get_project(db, project_id, owner)
    normalized = _memory_settings(settings or project.settings, OUTLINE_TOKENS, context)
    return st.queue_outline(db, project_id, model=model, settings=normalized,
                            prompt=outline_prompt(project, int(n_chapters)), heads=heads, owner=owner,
                            max_queued=max_queued)
