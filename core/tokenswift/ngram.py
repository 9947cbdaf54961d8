"""Token reutilization: an n-gram table of the text so far that proposes continuations.

Key = a token, value = counts of the (n-1)-token continuations that followed it. `topk` returns the most frequent
continuations with a deterministic order under equal counts (most recently seen first); a continuation is never
dropped or overwritten because another has the same count (the paper's code loses entries on ties).
"""
from __future__ import annotations

import heapq
from collections import defaultdict


class NGramTable:
    def __init__(self, n: int = 4):
        if n < 2:
            raise ValueError("n-grams need n >= 2")
        self.n = n
        # key -> continuation -> [count, last position seen]
        self.table: defaultdict[int, dict[tuple[int, ...], list[int]]] = defaultdict(dict)
        self.indexed = 0  # n-grams starting before this position are in the table

    def extend(self, tokens: list[int], upto: int | None = None) -> None:
        """Index every n-gram of `tokens` that ends at or before position `upto` (default: the end) not yet seen."""
        end = len(tokens) if upto is None else min(upto, len(tokens))
        for i in range(self.indexed, end - self.n + 1):
            cont = tuple(tokens[i + 1:i + self.n])
            entry = self.table[tokens[i]].get(cont)
            if entry is None:
                self.table[tokens[i]][cont] = [1, i]
            else:
                entry[0] += 1
                entry[1] = i
        self.indexed = max(self.indexed, end - self.n + 1)

    def topk(self, token: int, k: int) -> list[tuple[tuple[int, ...], int]]:
        """The k most frequent continuations of `token` as (continuation, count), ties broken by recency."""
        conts = self.table.get(token)
        if not conts or k <= 0:
            return []
        best = heapq.nlargest(k, conts.items(), key=lambda kv: (kv[1][0], kv[1][1]))
        return [(cont, entry[0]) for cont, entry in best]

    def total(self, token: int) -> int:
        conts = self.table.get(token)
        return sum(e[0] for e in conts.values()) if conts else 0

    def __len__(self) -> int:
        return sum(len(c) for c in self.table.values())
