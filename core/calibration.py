"""What the draft gate learns as a generation runs: how often a first-level draft with a given score is the token
drawn there (DraftCalibrator), and what verifying a draft costs on this machine now (VerifyCost).

A drafter's score is a ranking, not a probability: the heads' noised softmax runs high with the paper's sampling and
an n-gram's count / (total + 1) depends on how repetitive the text is. Each step's outcome is known for every
first-level draft, verified or not (the token after the root is drawn in any case), so each generation learns, per
source and score bin, the real rate at which such drafts are drawn. The estimate starts at the raw score (a prior
worth PRIOR observations) and moves to the measured rate as the bin fills. Only which drafts get verified depends on
it, never the tokens written, so losslessness is untouched.
"""
from __future__ import annotations

import statistics
from collections import deque

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


class VerifyCost:
    """c(2): the time of a 2-token forward over a 1-token one, measured on this generation's own forwards.

    A 2-node tree yields 1 + p tokens for c(2) against 1 token for 1, so a draft pays iff its chance p exceeds
    c(2) - 1. That depends on the machine, its load and the context length (attention grows with it: on the
    development CPU 0.12 at 1K cached tokens, 0.23 at 7K), so the gate reads it off the medians of the last WINDOW
    forwards of each size, and uses `prior` until both sizes have been seen MIN_SEEN times. Only which drafts are
    verified depends on it, never the tokens written.
    """

    WINDOW = 15
    MIN_SEEN = 3

    def __init__(self, prior: float = 1.25):
        self.prior = prior
        self._seconds = {1: deque(maxlen=self.WINDOW), 2: deque(maxlen=self.WINDOW)}

    def observe(self, size: int, seconds: float) -> None:
        """Record one verification forward of `size` tokens (other sizes are not modelled)."""
        if size in self._seconds:
            self._seconds[size].append(seconds)

    @property
    def c2(self) -> float:
        one, two = self._seconds[1], self._seconds[2]
        if min(len(one), len(two)) < self.MIN_SEEN:
            return self.prior
        return statistics.median(two) / statistics.median(one)

    def threshold(self) -> float:
        """The least chance for which verifying a draft pays: c(2) - 1, within [0, 1]."""
        return min(1.0, max(0.0, self.c2 - 1.0))
