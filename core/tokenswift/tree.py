"""The candidate tree: drafts from the heads and n-gram chains merged into one trie under a node budget.

Each proposed path carries an estimate of the chance that verification accepts it (the product of the heads'
probabilities, or an n-gram's relative count). Identical prefixes share nodes (a node keeps the best estimate of the
paths through it, capped by its parent's so estimates never grow with depth). Expected accepted length is the sum
of the chances of the nodes in the tree, so keeping the `budget` best nodes is the best tree of that size, and it is
prefix-closed because a child never outranks its parent.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from core.tokenswift.calibration import Proposed

HEADS = 1
NGRAM = 2


@dataclass
class Tree:
    tokens: list[int]  # node 0 is the root
    parents: list[int]  # parent node index, -1 for the root; parents come before children
    depths: list[int]
    sources: list[int]  # bit set of HEADS / NGRAM that proposed the node

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def children(self) -> list[dict[int, int]]:
        """Each node's children, token -> child node."""
        out: list[dict[int, int]] = [{} for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            out[self.parents[i]][self.tokens[i]] = i
        return out

    # The verification forward's inputs are built in numpy: between two forwards, with the caches cold, a few numpy
    # operations cost less than the torch operators that would build them.

    def mask(self, device: torch.device | str = "cpu") -> Tensor:
        """[n, n] bool: node i attends to node j iff j is i or one of its ancestors."""
        rows = np.eye(len(self.tokens), dtype=bool)
        for i in range(1, len(rows)):  # a node's row is its parent's plus itself (parents come first)
            rows[i] |= rows[self.parents[i]]
        return _tensor(rows, device)

    def positions(self, root_position: int, device: torch.device | str = "cpu") -> Tensor:
        return _tensor(np.add(self.depths, root_position, dtype=np.int64), device)

    def token_ids(self, device: torch.device | str = "cpu") -> Tensor:
        return _tensor(np.array(self.tokens, dtype=np.int64), device)


def _tensor(array: np.ndarray, device: torch.device | str) -> Tensor:
    t = torch.from_numpy(array)
    return t if getattr(device, "type", device) == "cpu" else t.to(device)


class TreeBuilder:
    def __init__(self, root: int):
        self.tokens = [root]
        self.parents = [-1]
        self.depths = [0]
        self.sources = [0]
        self.scores = [float("inf")]
        self.children: list[dict[int, int]] = [{}]

    def add(self, path: list[int], scores: list[float], source: int) -> None:
        """Insert the path below the root; scores[i] estimates the chance that path[:i+1] is accepted."""
        node = 0
        for token, score in zip(path, scores):
            node = self._child(node, token, score, source)

    def _child(self, node: int, token: int, score: float, source: int) -> int:
        """The child of `node` holding `token`, added if new, with the path's estimate through it (capped by its
        parent's) merged in."""
        score = min(score, self.scores[node])
        child = self.children[node].get(token)
        if child is None:
            child = len(self.tokens)
            self.children[node][token] = child
            self.tokens.append(token)
            self.parents.append(node)
            self.depths.append(self.depths[node] + 1)
            self.sources.append(source)
            self.scores.append(score)
            self.children.append({})
        else:
            self.sources[child] |= source
            self.scores[child] = max(self.scores[child], score)
        return child

    def add_product(self, candidates: list[list[tuple[int, float]]], source: int = HEADS) -> None:
        """Every combination of per-depth candidates [(token, prob), ...], scored by the product of probabilities."""
        def expand(prefix: list[int], scores: list[float], depth: int) -> None:
            if depth == len(candidates):
                return
            for token, p in candidates[depth]:
                s = (scores[-1] if scores else 1.0) * p
                self.add(prefix + [token], scores + [s], source)
                expand(prefix + [token], scores + [s], depth + 1)

        expand([], [], 0)

    def add_chain(self, candidates: list[list[tuple[int, float]]], source: int = HEADS) -> None:
        """Per-depth candidates drafted along one path, each depth's knowing the top candidates above it (a chained
        root head): every candidate hangs under that path of top candidates, scored by the product along it."""
        node, above = 0, 1.0  # the path of top candidates so far, and its score
        for level in candidates:
            if not level:
                return
            children = [self._child(node, token, above * p, source) for token, p in level]
            node, above = children[0], above * level[0][1]

    def recalibrate(self, chance: Callable[[float, int, int], float]) -> Proposed:
        """Rescore every node by `chance(raw score given its parent, sources, depth)`, the calibrated chance that it
        is drawn once its parent is, times its parent's new score. Returns the nodes as proposed, for the calibrator
        to judge once the step is drawn."""
        raw = self.scores[:]
        given = [1.0] * len(raw)
        for i in range(1, len(raw)):  # parents come before their children
            parent = self.parents[i]
            given[i] = raw[i] if parent == 0 else (raw[i] / raw[parent] if raw[parent] > 0 else 0.0)
            # chances are at most 1, so a child never outranks its parent and the best nodes stay prefix-closed
            self.scores[i] = (1.0 if parent == 0 else self.scores[parent]) * chance(given[i], self.sources[i],
                                                                                     self.depths[i])
        return Proposed(self.children, given, self.sources)

    def build(self, budget: int, min_score: float = 0.0) -> Tree:
        """The root plus the `budget - 1` best nodes scoring at least `min_score`, parents before children."""
        nodes = [i for i in range(1, len(self.tokens)) if self.scores[i] >= min_score]
        order = sorted(nodes, key=lambda i: (-self.scores[i], i))[: max(0, budget - 1)]
        keep = [0] + sorted(order, key=lambda i: (self.depths[i], i))
        index = {old: new for new, old in enumerate(keep)}
        parents = [-1] + [index.get(self.parents[i], -1) for i in keep[1:]]
        assert min(parents[1:], default=0) >= 0, "tree selection must be prefix-closed"
        return Tree([self.tokens[i] for i in keep], parents, [self.depths[i] for i in keep],
                    [self.sources[i] for i in keep])
