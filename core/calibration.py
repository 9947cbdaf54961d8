"""Online calibration of draft scores: how often a first-level draft with a given score is the token drawn there.

A drafter's score is a ranking, not a probability: the heads' noised softmax runs high with the paper's sampling and
an n-gram's count / (total + 1) depends on how repetitive the text is. Each step's outcome is known for every
first-level draft, verified or not (the token after the root is drawn in any case), so each generation learns, per
source and score bin, the real rate at which such drafts are drawn. The estimate starts at the raw score (a prior
worth PRIOR observations) and moves to the measured rate as the bin fills. Only which drafts get verified depends on
it, never the tokens written, so losslessness is untouched.
"""
from __future__ import annotations

BINS = 10  # equal-width bins of the raw score over [0, 1]
PRIOR = 4.0  # the raw score's weight, in observations, before a bin has data


class DraftCalibrator:
    def __init__(self) -> None:
        self._hits: dict[tuple[int, int], float] = {}
        self._seen: dict[tuple[int, int], float] = {}

    @staticmethod
    def _bin(score: float) -> int:
        return min(BINS - 1, max(0, int(score * BINS)))

    def chance(self, score: float, source: int) -> float:
        """Estimated chance that a first-level draft of this raw score, proposed by `source`, is drawn."""
        key = (source, self._bin(score))
        return (self._hits.get(key, 0.0) + PRIOR * score) / (self._seen.get(key, 0.0) + PRIOR)

    def observe(self, drafts: list[tuple[int, float, int]], drawn: int) -> None:
        """Record one step: the first-level drafts (token, raw score, source) and the token drawn after the root."""
        for token, score, source in drafts:
            key = (source, self._bin(score))
            self._seen[key] = self._seen.get(key, 0.0) + 1
            self._hits[key] = self._hits.get(key, 0.0) + (token == drawn)
