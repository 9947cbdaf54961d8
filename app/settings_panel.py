"""The generation-settings controls, built from ``app.jobs`` defaults and limits, and back to a settings dict.

Write and Compare each get their own panel (a component renders once); both go through ``collect`` and the jobs
module's ``validate_settings``, so the limits live in one place.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import gradio as gr

from app import jobs
from app.model_offers import Offer

# name -> (label, help); the order is the panel's order.
FIELDS: dict[str, tuple[str, str]] = {
    "method": ("Method", "TokenSwift drafts several tokens per step and verifies them; the text is the same."),
    "max_new_tokens": ("Max new tokens", "How many tokens this run may write."),
    "ignore_eos": ("Write to full length", "Suppress the end token so the run writes exactly max new tokens."),
    "temperature": ("Temperature", "0 = greedy; higher = more varied."),
    "top_p": ("Top-p", "Nucleus sampling; 1 = off."),
    "top_k": ("Top-k", "0 = off."),
    "min_p": ("Min-p", "Drop tokens below this fraction of the most likely one; 0 = off."),
    "penalty": ("Repetition penalty θ", "Applied to tokens of the recent window; 1 = off."),
    "penalty_window": ("Penalty window", "How many recent tokens the penalty looks at."),
    "seed": ("Seed", "Same seed + same settings = the same text."),
}
METHOD_CHOICES = [("TokenSwift", "tokenswift"), ("Vanilla", "ar")]
SLIDERS = {"temperature": 0.05, "top_p": 0.01, "min_p": 0.01, "penalty": 0.01}  # name -> step
INTEGERS = ("max_new_tokens", "top_k", "penalty_window", "seed")
MODEL = "model"  # the picker's name among a panel's values (not a generation setting)


@dataclass
class SettingsPanel:
    """The settings components of one panel, in ``names`` order."""

    names: list[str]
    components: list[gr.components.Component]

    def by_name(self) -> dict[str, gr.components.Component]:
        """{setting name: component}, for ``inputs_kwargs`` (the API then names each parameter after its setting)."""
        return dict(zip(self.names, self.components))

    def updates(self, settings: Mapping[str, Any] | None) -> list[Any]:
        """gr.update()s that show ``settings`` (defaults where missing or unknown)."""
        merged = {**jobs.DEFAULT_SETTINGS, **{k: v for k, v in (settings or {}).items() if k in jobs.DEFAULT_SETTINGS}}
        # The model is not a stored setting: the picker keeps what it shows.
        return [gr.update() if name == MODEL else gr.update(value=merged.get(name)) for name in self.names]


def _limits(name: str, context: int | None = None) -> tuple[float | None, float | None]:
    lo, hi = jobs.LIMITS.get(name, (None, None))
    if name == "max_new_tokens" and context is not None:
        hi = max(1, context - jobs.PROMPT_RESERVE)
    return lo, hi


def build(prefix: str, *, include_method: bool = True, compact: bool = False,
          models: Sequence[Offer] = (), context: int | None = None) -> SettingsPanel:
    """Create the controls inside the current Blocks context and return them.

    ``prefix`` makes the element ids unique ("write-max_new_tokens"); ``include_method``: False for Compare, which
    always runs both methods; ``models``: the studio's offers (app.model_offers), a picker named "model" when there
    is more than one (``pop_model`` takes it out of the values before they are validated); ``context``: the longest
    context of the models a run may use, in tokens, which bounds "Max new tokens" (default: the default model's).
    """
    defaults = jobs.DEFAULT_SETTINGS
    names = [n for n in FIELDS if n in defaults and (include_method or n != "method")]
    comps: list[gr.components.Component] = []
    by_name: dict[str, gr.components.Component] = {}

    def make(name: str) -> gr.components.Component:
        label, info = FIELDS[name]
        value = defaults.get(name)
        lo, hi = _limits(name, context)
        elem_id = f"{prefix}-{name}"
        if name == "method":
            return gr.Radio(METHOD_CHOICES, value=value, label=label, info=info, elem_id=elem_id)
        if name == "ignore_eos":
            return gr.Checkbox(value=bool(value), label=label, info=info, elem_id=elem_id)
        if name in SLIDERS and lo is not None and hi is not None:
            return gr.Slider(lo, hi, value=value, step=SLIDERS[name], label=label, info=info, elem_id=elem_id)
        return gr.Number(value=value, label=label, info=info, minimum=lo, maximum=hi, elem_id=elem_id,
                         precision=0 if name in INTEGERS else None, step=1 if name in INTEGERS else None)

    if len(models) > 1:
        with gr.Row():
            by_name[MODEL] = gr.Dropdown([(o.label, o.spec) for o in models], value=models[0].spec, label="Model",
                                         info="A GPU studio with the hub in reach offers TokenSwift's published "
                                              "checkpoints; the worker loads the one a run asks for.",
                                         elem_id=f"{prefix}-model")
        names = [MODEL, *names]
    first = [n for n in ("method", "max_new_tokens", "ignore_eos") if n in names]
    rest = [n for n in names if n not in first and n != MODEL]
    with gr.Row(equal_height=True):
        for name in first:
            by_name[name] = make(name)
    with gr.Accordion("Sampling", open=not compact):
        for i in range(0, len(rest), 3):
            with gr.Row():
                for name in rest[i:i + 3]:
                    by_name[name] = make(name)
    comps = [by_name[n] for n in names]
    return SettingsPanel(names, comps)


def collect(values: Mapping[str, Any]) -> dict[str, Any]:
    """A raw settings dict from panel values (Numbers arrive as floats: integers are made ints here)."""
    raw: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue
        if name in INTEGERS and isinstance(value, float) and value.is_integer():
            value = int(value)
        raw[name] = value
    return raw


def pop_model(values: dict[str, Any]) -> str | None:
    """Take the model picker's value out of a panel's values (None: no picker, or nothing picked)."""
    return values.pop(MODEL, None) or None


def validated(values: Mapping[str, Any], context: int | None = None) -> dict[str, Any]:
    """Collect and validate (``app.jobs.validate_settings``) for a model of `context` tokens (None: the default
    model's); raises ValueError with a readable message."""
    return jobs.validate_settings(collect(values), context)
