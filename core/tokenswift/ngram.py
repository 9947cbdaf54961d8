"""Token reutilization: an n-gram table of the text so far that proposes continuations.

Key = a token, value = counts of the (n-1)-token continuations that followed it. `topk` returns the most frequent
continuations with a deterministic order under equal counts (most recently seen first); a continuation is never
dropped or overwritten because another has the same count (the paper's code loses entries on ties).

Every operation a step performs costs the same at 100K tokens as at 1K: a frequent token (a comma, "the") has
thousands of continuations in a long text, so nothing may scan them. Each key keeps its continuations in buckets by
count, each bucket in the order they last reached that count (which is recency, since positions only grow), and the
sorted list of its non-empty counts; `topk` walks the buckets from the top and stops after k, `total` is a counter,
and `extend` moves one continuation between two buckets per new n-gram.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections import defaultdict


class NGramTable:
    def __init__(self, n: int = 4):
        if n < 2:
            raise ValueError("n-grams need n >= 2")
        self.n = n
        # key -> continuation -> [count, last position seen]
        self.table: defaultdict[int, dict[tuple[int, ...], list[int]]] = defaultdict(dict)
        # key -> count -> the continuations with that count, least recently counted first (dict: ordered, O(1) pop)
        self._buckets: defaultdict[int, dict[int, dict[tuple[int, ...], None]]] = defaultdict(dict)
        self._counts: defaultdict[int, list[int]] = defaultdict(list)  # key -> its non-empty counts, ascending
        self._totals: defaultdict[int, int] = defaultdict(int)  # key -> n-grams seen starting with it
        self._size = 0  # distinct (key, continuation) pairs
        self.indexed = 0  # n-grams starting before this position are in the table

    def extend(self, tokens: list[int], upto: int | None = None) -> None:
        """Index every n-gram of `tokens` that ends at or before position `upto` (default: the end) not yet seen."""
        end = len(tokens) if upto is None else min(upto, len(tokens))
        for i in range(self.indexed, end - self.n + 1):
            self._count(tokens[i], tuple(tokens[i + 1:i + self.n]), i)
        self.indexed = max(self.indexed, end - self.n + 1)

    def _count(self, key: int, cont: tuple[int, ...], i: int) -> None:
        """One more occurrence of `cont` after `key`, at position i: moved from its bucket to the next one up."""
        conts, buckets = self.table[key], self._buckets[key]
        entry = conts.get(cont)
        if entry is None:
            conts[cont] = entry = [0, i]
            self._size += 1
        else:
            old = buckets[entry[0]]
            del old[cont]
            if not old:
                del buckets[entry[0]]
                counts = self._counts[key]
                del counts[bisect_left(counts, entry[0])]
        entry[0] += 1
        entry[1] = i
        bucket = buckets.get(entry[0])
        if bucket is None:
            buckets[entry[0]] = bucket = {}
            insort(self._counts[key], entry[0])
        bucket[cont] = None  # appended last: the most recently counted of its bucket
        self._totals[key] += 1

    def topk(self, token: int, k: int) -> list[tuple[tuple[int, ...], int]]:
        """The k most frequent continuations of `token` as (continuation, count), ties broken by recency."""
        buckets = self._buckets.get(token)
        out: list[tuple[tuple[int, ...], int]] = []
        if not buckets or k <= 0:
            return out
        for count in reversed(self._counts[token]):
            for cont in reversed(buckets[count]):
                out.append((cont, count))
                if len(out) == k:
                    return out
        return out

    def total(self, token: int) -> int:
        """How many n-grams seen start with `token`."""
        return self._totals.get(token, 0)

    def __len__(self) -> int:
        return self._size
