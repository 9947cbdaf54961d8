"""Whether two runs' ids agree: where they first differ, and how the top-2 gap of the draw there is written.

Pure Python, no torch: the studio's pages import it to show a stored divergence (core/generation/divergence.py
recomputes the draw), the benchmark and the GPU check to report one.
"""
from __future__ import annotations

import math
from collections.abc import Sequence


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length when one run is a prefix of the other); None if
    the runs are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def format_gap(gap: float | None) -> str:
    """A gap in two significant digits: scientific notation below 0.01 (3.1e-06), plain above (0.034, 2.0, 12; the
    integer part whole from 100 on); ∞ for a draw with a single candidate (None: its runner-up scores -inf)."""
    if gap is None:
        return "∞"
    if gap == 0 or not math.isfinite(gap):
        return str(gap) if gap else "0"
    if abs(gap) < 0.01:
        return f"{gap:.1e}"
    return f"{gap:.{max(0, 1 - math.floor(math.log10(abs(gap))))}f}"
