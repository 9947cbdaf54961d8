"""Plotly figures of a run's step metrics, built from a bounded, incrementally updated summary.

A long run has one step row per decoding step (100K+ for a long chapter). The UI must not hold, ship or draw them all
each second, so rows are folded into ``StepBuckets``: at most ``max_points`` buckets of consecutive steps, each keeping
sums and counts; when a new row would need one bucket too many, neighbouring buckets merge pairwise and every bucket
then covers twice as many steps. A chart point is a bucket mean. Feeding rows in as they arrive (``get_steps`` with
``after_step``) costs O(new rows), memory stays O(max_points), and a figure is ≤ max_points points per trace whatever
the run's length.

The figures: tokens per step (drafts accepted from the heads vs from the n-gram table), throughput (tokens/s over
tokens generated) and n-gram repetition over a sliding window. Each takes one run or several (``{label: buckets}``,
overlaid, for Compare).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go

from core.generation.metrics import REPETITION_N, REPETITION_WINDOW

MAX_POINTS = 500
Figures = tuple[go.Figure, go.Figure, go.Figure]  # tokens per step, throughput, repetition
# Fields kept per bucket. "heads" is derived: accepted drafts that did not come from the n-gram table.
FIELDS = ("step", "tokens_so_far", "new_tokens", "accepted", "from_ngram", "heads", "tokens_per_s", "repetition",
          "step_ms")

PALETTE = {
    "heads": "#6366f1",  # indigo
    "ngram": "#f59e0b",  # amber
    "total": "#0f766e",  # teal
    "runs": ("#64748b", "#2563eb", "#db2777", "#16a34a"),  # vanilla (slate) first, then TokenSwift (blue), ...
}


def _get(row: Any, name: str) -> Any:
    return row.get(name) if isinstance(row, Mapping) else getattr(row, name, None)


@dataclass
class StepBuckets:
    """Bucket sums of a run's step metrics (see the module docstring). Feed rows in step order with ``extend``."""

    max_points: int = MAX_POINTS
    width: int = 1  # steps per full bucket (a power of two)
    n_steps: int = 0
    last_step: int | None = None  # for get_steps(after_step=...)
    sums: dict[str, list[float]] = field(default_factory=lambda: {f: [] for f in FIELDS})
    counts: dict[str, list[int]] = field(default_factory=lambda: {f: [] for f in FIELDS})
    # Running totals for the status line.
    total_ms: float = 0.0
    tokens: int = 0
    accepted: int = 0
    from_ngram: int = 0
    last_tokens_per_s: float | None = None
    last_repetition: float | None = None

    def __post_init__(self) -> None:
        if self.max_points < 2:
            raise ValueError("max_points must be at least 2")

    def extend(self, rows: Iterable[Any]) -> int:
        """Add step rows (StepMetric objects or dicts with the STEP_FIELDS keys); returns how many were added.

        Rows at or before ``last_step`` are ignored, so overlapping reads are harmless.
        """
        added = 0
        for row in rows:
            step = int(_get(row, "step"))
            if self.last_step is not None and step <= self.last_step:
                continue
            self._add(step, row)
            added += 1
        return added

    def _add(self, step: int, row: Any) -> None:
        new = int(_get(row, "new_tokens") or 0)
        accepted = int(_get(row, "accepted") or 0)
        ngram = int(_get(row, "from_ngram") or 0)
        step_ms = float(_get(row, "step_ms") or 0.0)
        so_far = _get(row, "tokens_so_far")
        self.total_ms += step_ms
        self.tokens = int(so_far) if so_far is not None else self.tokens + new
        tps = _get(row, "tokens_per_s")
        if tps is None and self.total_ms > 0:  # older rows / workers that leave it out: tokens over decode time
            tps = self.tokens / (self.total_ms / 1000)
        if self.n_steps == 0:
            # The first step is one token over one draw or forward (TokenSwift's comes from the prefill's logits, a
            # draw of ~2 ms: "500 tokens/s"), not yet a rate; plotted, it flattened the rest of the line.
            tps = None
        rep = _get(row, "repetition")
        values = {"step": step, "tokens_so_far": self.tokens, "new_tokens": new, "accepted": accepted,
                  "from_ngram": ngram, "heads": max(0, accepted - ngram), "tokens_per_s": tps,
                  "repetition": rep, "step_ms": step_ms}
        if self.n_steps % self.width == 0:  # this step opens a new bucket
            if len(self.sums["step"]) == self.max_points:
                self._merge_pairs()
            if self.n_steps % self.width == 0:  # (still true after merging unless the last bucket is half full)
                for f in FIELDS:
                    self.sums[f].append(0.0)
                    self.counts[f].append(0)
        for f, v in values.items():
            if v is not None:
                self.sums[f][-1] += float(v)
                self.counts[f][-1] += 1
        self.n_steps += 1
        self.last_step = step
        self.accepted += accepted
        self.from_ngram += ngram
        self.last_tokens_per_s = float(tps) if tps is not None else self.last_tokens_per_s
        self.last_repetition = float(rep) if rep is not None else self.last_repetition

    def _merge_pairs(self) -> None:
        # Buckets 2i and 2i+1 become bucket i; an odd last bucket stays alone (it is the newest and still filling).
        for f in FIELDS:
            s, c = self.sums[f], self.counts[f]
            self.sums[f] = [sum(s[i:i + 2]) for i in range(0, len(s), 2)]
            self.counts[f] = [sum(c[i:i + 2]) for i in range(0, len(c), 2)]
        self.width *= 2

    def series(self, name: str) -> list[float | None]:
        """Bucket means of one field (None where a bucket has no value for it, e.g. repetition not measured)."""
        return [s / c if c else None for s, c in zip(self.sums[name], self.counts[name])]

    @property
    def mean_tokens_per_step(self) -> float | None:
        return self.tokens / self.n_steps if self.n_steps else None


def buckets_from_rows(rows: Iterable[Any], max_points: int = MAX_POINTS) -> StepBuckets:
    """A fresh ``StepBuckets`` filled with ``rows``."""
    buckets = StepBuckets(max_points=max_points)
    buckets.extend(rows)
    return buckets


# -- figures ----------------------------------------------------------------------------------------------------------

Runs = StepBuckets | Mapping[str, StepBuckets] | None


def _as_runs(runs: Runs) -> dict[str, StepBuckets]:
    if runs is None:
        return {}
    if isinstance(runs, StepBuckets):
        return {"": runs}
    return {label: b for label, b in runs.items() if b is not None}


def _layout(title: str, x_title: str, y_title: str, empty: str | None = None, **extra: Any) -> dict[str, Any]:
    grid = "rgba(128,128,128,0.18)"
    layout: dict[str, Any] = {
        "title": {"text": title, "font": {"size": 14}, "x": 0.01, "xanchor": "left"},
        "height": 250,
        "margin": {"l": 48, "r": 12, "t": 40, "b": 40},
        # Transparent backgrounds and a mid-grey font read on Gradio's light and dark themes alike.
        "paper_bgcolor": "rgba(0,0,0,0)",
        "plot_bgcolor": "rgba(0,0,0,0)",
        "font": {"family": "IBM Plex Sans, system-ui, sans-serif", "size": 11, "color": "#7b8494"},
        "xaxis": {"title": {"text": x_title}, "gridcolor": grid, "zeroline": False},
        "yaxis": {"title": {"text": y_title}, "gridcolor": grid, "zeroline": False, "rangemode": "tozero"},
        "legend": {"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right"},
        "hovermode": "x unified",
        # Keeps the user's zoom/pan across the 1 s updates (Plotly only resets the view when this changes).
        "uirevision": title,
    }
    for axis, spec in extra.pop("axes", {}).items():
        layout[axis].update(spec)
    layout.update(extra)
    if empty:
        layout["annotations"] = [{"text": empty, "showarrow": False, "xref": "paper", "yref": "paper",
                                  "x": 0.5, "y": 0.5, "font": {"size": 13}}]
        layout["xaxis"]["visible"] = layout["yaxis"]["visible"] = False
    return layout


def _empty_message(runs: dict[str, StepBuckets], empty: str) -> str | None:
    return None if any(b.n_steps for b in runs.values()) else empty


def _color(i: int) -> str:
    colors = PALETTE["runs"]
    return colors[i % len(colors)]


def accepted_figure(runs: Runs, empty: str = "No steps yet") -> go.Figure:
    """Tokens per decoding step. One run: stacked areas of accepted drafts from the heads and from the n-gram table
    (plus the model's own token = the total line); several runs: one total line each."""
    runs = _as_runs(runs)
    traces: list[Any] = []
    if len(runs) == 1:
        b = next(iter(runs.values()))
        x = b.series("step")
        traces = [
            go.Scatter(x=x, y=b.series("heads"), name="from heads", stackgroup="acc", mode="lines",
                       line={"width": 0.5, "color": PALETTE["heads"]}),
            go.Scatter(x=x, y=b.series("from_ngram"), name="from n-gram", stackgroup="acc", mode="lines",
                       line={"width": 0.5, "color": PALETTE["ngram"]}),
            go.Scatter(x=x, y=b.series("new_tokens"), name="tokens / step", mode="lines",
                       line={"width": 1.5, "color": PALETTE["total"]}),
        ]
    else:
        traces = [go.Scatter(x=b.series("step"), y=b.series("new_tokens"), name=label or "tokens / step",
                             mode="lines", line={"width": 1.5, "color": _color(i)})
                  for i, (label, b) in enumerate(runs.items())]
    return go.Figure(traces, _layout("Tokens per step", "step", "tokens", _empty_message(runs, empty)))


def throughput_figure(runs: Runs, empty: str = "No steps yet") -> go.Figure:
    """Decode throughput (tokens/s so far) against tokens generated; one line per run."""
    runs = _as_runs(runs)
    traces = [go.Scatter(x=b.series("tokens_so_far"), y=b.series("tokens_per_s"), name=label or "tokens/s",
                         mode="lines", line={"width": 1.8, "color": _color(i if len(runs) > 1 else 1)})
              for i, (label, b) in enumerate(runs.items())]
    return go.Figure(traces, _layout("Throughput", "tokens generated", "tokens / s", _empty_message(runs, empty)))


def repetition_figure(runs: Runs, empty: str = "No steps yet") -> go.Figure:
    """Share of repeated n-grams in the recent text (core.metrics' sliding-window figure); one line per run."""
    runs = _as_runs(runs)
    message = _empty_message(runs, empty)
    if message is None and not any(any(c for c in b.counts["repetition"]) for b in runs.values()):
        message = "Repetition not measured for this run"
    traces = [go.Scatter(x=b.series("tokens_so_far"), y=b.series("repetition"), name=label or "repetition",
                         mode="lines", connectgaps=True,
                         line={"width": 1.8, "color": _color(i if len(runs) > 1 else 2)})
              for i, (label, b) in enumerate(runs.items())]
    return go.Figure(traces, _layout(f"Repetition (last {REPETITION_WINDOW} tokens)", "tokens generated",
                                     f"repeated {REPETITION_N}-grams", message,
                                     axes={"yaxis": {"range": [0, 1], "tickformat": ".0%"}}))


def all_figures(runs: Runs, empty: str = "No steps yet") -> Figures:
    """The three charts for one run or several overlaid: (tokens per step, throughput, repetition)."""
    return accepted_figure(runs, empty), throughput_figure(runs, empty), repetition_figure(runs, empty)
