"""Online calibration of draft scores: how often a draft with a given score is the token drawn, at each tree depth.

A drafter's score is a ranking, not a probability: the heads' noised softmax runs high with the paper's sampling, an
n-gram's count / (total + 1) depends on how repetitive the text is, and an n-gram chain scores its deeper tokens as
high as its first although each is a fresh guess. Each step's outcome is known for every draft whose parent was
drawn, verified or not (vanilla decoding draws the tokens after the root in any case: the accepted path and the one
after it), so each generation learns, per source, depth and score bin, the real rate at which such drafts are drawn
given their parent was. The estimate starts at the raw score (a prior worth PRIOR observations) and moves to the
measured rate as the bin fills. Only which drafts get verified depends on it, never the tokens written, so
losslessness is untouched.
"""
from __future__ import annotations

from typing import NamedTuple

BINS = 10  # equal-width bins of the raw score over [0, 1]
PRIOR = 4.0  # the raw score's weight, in observations, before a bin has data
DEPTHS = 3  # drafts at this depth and deeper share their estimates


class Proposed(NamedTuple):
    """A step's drafts as proposed, the trie that held them (TreeBuilder.recalibrate): node 0 is the root, children[i]
    maps a token to node i's child holding it, scores[i] is node i's raw score given its parent and sources[i] the
    drafters that proposed it."""

    children: list[dict[int, int]]
    scores: list[float]
    sources: list[int]


class DraftCalibrator:
    def __init__(self) -> None:
        # (source, depth, bin) -> [drafts judged, drafts drawn]: one lookup per estimate, a dozen a step
        self._counts: dict[tuple[int, int, int], list[float]] = {}

    def chance(self, score: float, source: int, depth: int = 1) -> float:
        """Estimated chance that a draft of this raw score, proposed by `source` at `depth` (1: right after the
        root), is the token drawn there, given that its parent was."""
        seen, hits = self._counts.get(_key(score, source, depth), _NONE)
        return (hits + PRIOR * score) / (seen + PRIOR)

    def observe(self, drafts: Proposed, drawn: list[int]) -> None:
        """Record one step: the drafts as proposed and the tokens drawn after the root (the accepted path and the
        token after it). A draft is judged only where its parent was drawn: the children of the nodes along the drawn
        tokens' path down the trie."""
        node: int | None = 0
        for depth, token in enumerate(drawn, start=1):
            for draft, child in drafts.children[node].items():
                counts = self._counts.setdefault(_key(drafts.scores[child], drafts.sources[child], depth), [0.0, 0.0])
                counts[0] += 1
                counts[1] += draft == token
            node = drafts.children[node].get(token)
            if node is None:
                return


_NONE = (0.0, 0.0)


def _key(score: float, source: int, depth: int) -> tuple[int, int, int]:
    return source, min(depth, DEPTHS), min(BINS - 1, max(0, int(score * BINS)))
