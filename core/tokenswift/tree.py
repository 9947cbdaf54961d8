"""The candidate tree: drafts from the heads and n-gram chains merged into one trie under a node budget.

Each proposed path carries an estimate of the chance that verification accepts it (the product of the heads'
probabilities, or an n-gram's relative count). Identical prefixes share nodes (a node keeps the best estimate of the
paths through it, capped by its parent's so estimates never grow with depth). Expected accepted length is the sum
of the chances of the nodes in the tree, so keeping the `budget` best nodes is the best tree of that size, and it is
prefix-closed because a child never outranks its parent.

A generation builds its trees through `Trees`: TreeDrafts (TreeBuilder with the draft calibrator) or its native twin
(trees.cpp), which computes the same trees and chances in one call a step; TreeInputs writes each tree's
verification inputs into buffers held for the generation.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from core.runtime.kernels import cpu
from core.runtime.kernels.build import build
from core.tokenswift.calibration import BINS, DEPTHS, PRIOR, DraftCalibrator, Proposed

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


def _tensor(array: np.ndarray, device: torch.device | str) -> Tensor:
    t = torch.from_numpy(array)
    return t if getattr(device, "type", device) == "cpu" else t.to(device)


class TreeInputs:
    """A generation's verification inputs (token ids, positions, mask) for trees of up to `budget` nodes, written
    into buffers it holds for all its steps: between two forwards, with the caches cold, building three tensors a
    step costs more than writing two rows of ids. A tree's shape repeats from step to step (a small budget has few),
    so its mask is built once per shape. The tensors are valid until the next call."""

    MAX_SHAPES = 1024  # masks kept; a large budget's shapes rarely repeat, and then are rebuilt as needed

    def __init__(self, budget: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._on_cpu = self.device.type == "cpu"  # (a device's attributes cost a lookup each between two forwards)
        rows = torch.zeros(2, budget, dtype=torch.long)
        self._rows = rows.numpy()  # the same memory: written as an array, read as tensors
        self._views = [(rows[0, :n], rows[1, :n]) for n in range(budget + 1)]
        self._masks: dict[tuple[int, ...], Tensor] = {}

    def __call__(self, tree: Tree, root_position: int) -> tuple[Tensor, Tensor, Tensor]:
        """Token ids [n], positions [n] and mask [n, n] (Tree.mask) of `tree`, whose root sits at `root_position`."""
        n = len(tree.tokens)
        self._rows[:, :n] = tree.tokens, [root_position + d for d in tree.depths]
        ids, positions = self._views[n]
        shape = tuple(tree.parents)
        mask = self._masks.get(shape)
        if mask is None:
            if len(self._masks) >= self.MAX_SHAPES:
                self._masks.clear()
            mask = self._masks[shape] = tree.mask(self.device)
        if not self._on_cpu:
            ids, positions = ids.to(self.device), positions.to(self.device)
        return ids, positions, mask


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


Level = list[tuple[int, float]]  # one depth's drafts: (token, estimated chance)
NGrams = list[tuple[int, list[tuple[tuple[int, ...], int]]]]  # per key: (total, [(continuation, count), ...])


class Trees(Protocol):
    """A generation's candidate trees and draft calibrator: TreeDrafts, or its native twin (trees.cpp), which
    computes the same trees and chances in one call a step."""

    def chance(self, score: float, source: int, depth: int) -> float:
        """The calibrated chance that a draft of raw `score` from `source` at `depth` is drawn, given its parent
        is (DraftCalibrator.chance; the raw score without calibration)."""

    def build(self, root: int, levels: list[Level], ngrams: NGrams) -> tuple[list[int], list[int], list[int],
                                                                             list[int]]:
        """The tree's tokens, parents, depths and sources (Tree) below `root`: the model's drafts, one level per
        depth, and the n-gram continuations of the root, then (with drafts) of the first level's top draft."""

    def observe(self, drawn: list[int]) -> None:
        """Learn from the tokens drawn after the root of the last tree built (DraftCalibrator.observe)."""


class TreeDrafts:
    """Trees in Python: TreeBuilder and DraftCalibrator, the reference trees.cpp is tested against."""

    def __init__(self, budget: int, min_score: float, ngram_weight: float, chained: bool, calibrate: bool):
        self.budget, self.min_score, self.ngram_weight, self.chained = budget, min_score, ngram_weight, chained
        self.calibrator = DraftCalibrator() if calibrate else None
        self._proposed: Proposed | None = None

    def chance(self, score: float, source: int, depth: int) -> float:
        return score if self.calibrator is None else self.calibrator.chance(score, source, depth)

    def build(self, root: int, levels: list[Level], ngrams: NGrams) -> tuple[list[int], list[int], list[int],
                                                                             list[int]]:
        builder = TreeBuilder(root)
        if self.chained:  # deeper drafts hold only under the top draft above them
            builder.add_chain(levels, HEADS)
        else:
            builder.add_product(levels, HEADS)
        depth = self.budget - 1  # no deeper draft fits the tree
        keys = [([], 1.0)] + ([([levels[0][0][0]], levels[0][0][1])] if levels else [])
        for (prefix, base), (total, continuations) in zip(keys, ngrams, strict=True):
            # a continuation seen c times among `total` scores c / (total + 1): one seen once is right ~1 time in 4
            # with the studio settings, not always (as c / total would claim); measured on generated text
            for cont, count in continuations:
                score = base * min(1.0, self.ngram_weight * count / (total + 1))
                builder.add(prefix + list(cont)[:depth - len(prefix)], [base] * len(prefix) + [score] * len(cont),
                            NGRAM)
        if self.calibrator is not None:
            self._proposed = builder.recalibrate(self.calibrator.chance)
        tree = builder.build(self.budget, self.min_score)
        return tree.tokens, tree.parents, tree.depths, tree.sources

    def observe(self, drawn: list[int]) -> None:
        if self.calibrator is not None and self._proposed is not None:
            self.calibrator.observe(self._proposed, drawn)


def tree_drafts(budget: int, min_score: float, ngram_weight: float, chained: bool, calibrate: bool,
                native: bool = True) -> Trees:
    """A generation's Trees: on our kernels where they are built (and `native`), else TreeDrafts."""
    kernel = native_trees() if native else None
    if kernel is None:
        return TreeDrafts(budget, min_score, ngram_weight, chained, calibrate)
    return kernel.TreeDrafts(budget, min_score, ngram_weight, chained, calibrate, BINS, PRIOR, DEPTHS)


@functools.cache
def native_trees() -> Any | None:
    """The trees' extension (trees.cpp; built on the first call, then loaded from the cache), or None where our
    kernels are off or cannot be built."""
    return None if cpu.kernel() is None else build("trees", Path(__file__).with_name("trees.cpp"))
