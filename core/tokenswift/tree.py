"""The candidate tree: drafts from the heads and n-gram chains merged into one trie under a node budget.

Each proposed path carries an estimate of the chance that verification accepts it (the product of the heads'
probabilities, or an n-gram's relative count). Identical prefixes share nodes (a node keeps the best estimate of the
paths through it, capped by its parent's so estimates never grow with depth). Expected accepted length is the sum
of the chances of the nodes in the tree, so keeping the `budget` best nodes is the best tree of that size, and it is
prefix-closed because a child never outranks its parent.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from core.tokenswift.calibration import Proposal

HEADS = 1
NGRAM = 2


@dataclass
class Tree:
    tokens: list[int]  # node 0 is the root
    parents: list[int]  # parent node index, -1 for the root; parents come before children
    depths: list[int]
    sources: list[int]  # bit set of HEADS / NGRAM that proposed the node
    children: list[dict[int, int]] = field(default_factory=list)  # token -> child node

    def __len__(self) -> int:
        return len(self.tokens)

    def mask(self, device: torch.device | str = "cpu") -> Tensor:
        """[n, n] bool: node i attends to node j iff j is i or one of its ancestors."""
        n = len(self.tokens)
        rows: list[list[bool]] = []
        for i in range(n):  # a node's row is its parent's plus itself (parents come first)
            row = list(rows[self.parents[i]]) if i else [False] * n
            row[i] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool, device=device)

    def positions(self, root_position: int, device: torch.device | str = "cpu") -> Tensor:
        return torch.tensor([root_position + d for d in self.depths], dtype=torch.long, device=device)


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
            node = child

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
        prefix: list[int] = []
        scores: list[float] = []
        for level in candidates:
            above = scores[-1] if scores else 1.0
            for token, p in level:
                self.add(prefix + [token], scores + [above * p], source)
            if not level:
                return
            prefix.append(level[0][0])
            scores.append(above * level[0][1])

    def recalibrate(self, chance: Callable[[float, int, int], float]) -> list[Proposal]:
        """Rescore every node by `chance(raw score given its parent, sources, depth)`, the calibrated chance that it
        is drawn once its parent is, times its parent's new score. Returns every node as proposed (Proposal), for
        the calibrator to judge once the step is drawn."""
        raw = self.scores[:]
        prefixes: list[tuple[int, ...]] = [()]
        proposed: list[Proposal] = []
        for i in range(1, len(self.tokens)):  # parents come before their children
            parent = self.parents[i]
            prefixes.append(prefixes[parent] + (self.tokens[parent],) if parent else ())
            given_parent = raw[i] if parent == 0 else (raw[i] / raw[parent] if raw[parent] > 0 else 0.0)
            proposed.append((prefixes[i], self.tokens[i], given_parent, self.sources[i]))
            # chances are at most 1, so a child never outranks its parent and the best nodes stay prefix-closed
            self.scores[i] = (1.0 if parent == 0 else self.scores[parent]) * chance(given_parent, self.sources[i],
                                                                                     self.depths[i])
        return proposed

    def build(self, budget: int, min_score: float = 0.0) -> Tree:
        """The root plus the `budget - 1` best nodes scoring at least `min_score`, parents before children."""
        nodes = [i for i in range(1, len(self.tokens)) if self.scores[i] >= min_score]
        order = sorted(nodes, key=lambda i: (-self.scores[i], i))[: max(0, budget - 1)]
        keep = [0] + sorted(order, key=lambda i: (self.depths[i], i))
        index = {old: new for new, old in enumerate(keep)}
        tree = Tree([self.tokens[i] for i in keep], [index.get(self.parents[i], -1) for i in keep],
                    [self.depths[i] for i in keep], [self.sources[i] for i in keep])
        tree.children = [{} for _ in keep]
        for new, old in enumerate(keep[1:], start=1):
            parent = tree.parents[new]
            assert parent >= 0, "tree selection must be prefix-closed"
            tree.children[parent][tree.tokens[new]] = new
        return tree
