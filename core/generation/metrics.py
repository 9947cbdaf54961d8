"""Text-quality figures computed from token ids: distinct-n and the windowed repetition share.

Pure Python, no torch: the worker calls these on every flush, the UI and the benchmark on finished runs.

Repetition figure: the share of the n-grams in the last `window` output tokens that already occurred earlier in
that window. An n-gram occurring k times in the window contributes k - 1 repeats, so the share is
1 - distinct / total over the window. `RepetitionTracker` keeps the window's n-gram counts up to date as tokens
arrive (O(1) per token), so a 10K-token run costs the same per step as a 100-token one.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence

REPETITION_N = 4
REPETITION_WINDOW = 512


def ngrams(tokens: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """All contiguous n-grams of `tokens`, in order."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(tokens: Sequence[int], n: int) -> float:
    """Distinct n-grams / total n-grams (1.0 = no n-gram repeats); 0.0 when there is no n-gram at all."""
    grams = ngrams(tokens, n)
    return len(set(grams)) / len(grams) if grams else 0.0


def repeated_ngram_share(tokens: Sequence[int], n: int = REPETITION_N, window: int = REPETITION_WINDOW) -> float:
    """Share of the n-grams in the last `window` tokens that already occurred earlier in that window.

    0.0 = nothing repeats (or too few tokens to tell), close to 1.0 = the text loops.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    grams = ngrams(tokens[-window:], n)
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


class RepetitionTracker:
    """`repeated_ngram_share` of a growing token list, updated incrementally.

    `extend(new_tokens)` then `.value` equals `repeated_ngram_share(all_tokens, n, window)`.
    """

    def __init__(self, n: int = REPETITION_N, window: int = REPETITION_WINDOW, tokens: Iterable[int] = ()):
        if n < 1 or window < 1:
            raise ValueError(f"n and window must be >= 1, got n={n}, window={window}")
        self.n, self.window = n, window
        self._tail: deque[int] = deque(maxlen=n)  # the last n tokens: the next n-gram's source
        self._grams: deque[tuple[int, ...]] = deque()  # n-grams inside the window, oldest first
        self._counts: Counter[tuple[int, ...]] = Counter()
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> float:
        """Add tokens at the end; returns the new value."""
        # A window of W tokens holds W - n + 1 n-grams.
        keep = max(0, self.window - self.n + 1)
        for t in tokens:
            self._tail.append(int(t))
            if len(self._tail) < self.n:
                continue
            gram = tuple(self._tail)
            self._grams.append(gram)
            self._counts[gram] += 1
            while len(self._grams) > keep:
                old = self._grams.popleft()
                self._counts[old] -= 1
                if not self._counts[old]:
                    del self._counts[old]
        return self.value

    @property
    def value(self) -> float:
        total = len(self._grams)
        return 1.0 - len(self._counts) / total if total else 0.0

