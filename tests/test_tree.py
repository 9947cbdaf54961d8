"""The candidate trie: shared prefixes, budget, mask, positions."""
from __future__ import annotations

import torch

from conftest import path_tokens
from core.tokenswift.tree import HEADS, NGRAM, TreeBuilder, TreeInputs


def test_identical_prefixes_share_nodes_and_sources_merge() -> None:
    b = TreeBuilder(root=5)
    b.add([1, 2, 3], [0.9, 0.5, 0.2], HEADS)
    b.add([1, 2, 4], [0.8, 0.6, 0.3], NGRAM)
    tree = b.build(budget=100)
    assert tree.tokens == [5, 1, 2, 3, 4]
    assert tree.parents == [-1, 0, 1, 2, 2]
    assert tree.depths == [0, 1, 2, 3, 3]
    assert tree.sources[1] == HEADS | NGRAM and tree.sources[3] == HEADS and tree.sources[4] == NGRAM
    assert tree.children[2] == {3: 3, 4: 4}


def test_mask_and_positions() -> None:
    b = TreeBuilder(root=0)
    b.add([1, 2], [0.9, 0.8], HEADS)
    b.add([3], [0.7], HEADS)
    tree = b.build(10)
    # order: root, 1, 3 (depth 1), 2 (depth 2)
    assert tree.tokens == [0, 1, 3, 2]
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree.mask(), expected)
    assert tree.positions(100).tolist() == [100, 101, 101, 102]
    assert path_tokens(tree, 3) == [1, 2]


def test_a_generations_inputs_are_each_trees_own() -> None:
    """TreeInputs writes every tree into the same buffers and builds a mask once per shape: each call's tensors are
    that tree's ids, positions and mask, whatever came before."""
    inputs = TreeInputs(budget=5)
    trees = []
    for root, paths in ((0, [[1, 2], [3]]), (7, [[8, 9], [4]]), (7, [[8, 9, 10, 11]]), (2, [[6]])):
        b = TreeBuilder(root)
        for path in paths:
            b.add(path, [0.9 - 0.1 * i for i in range(len(path))], HEADS)
        trees.append(b.build(5))
    assert trees[0].parents == trees[1].parents != trees[2].parents  # a repeated shape, then new ones
    for at, tree in enumerate(trees):
        ids, positions, mask = inputs(tree, 40 + at)
        assert ids.tolist() == tree.tokens
        assert torch.equal(positions, tree.positions(40 + at))
        assert torch.equal(mask, tree.mask())
    again = TreeInputs(budget=5)
    assert again(trees[1], 0)[2] is again(trees[0], 0)[2], "a shape's mask is built once"


def test_budget_keeps_the_best_prefix_closed_nodes() -> None:
    b = TreeBuilder(root=0)
    b.add_product([[(1, 0.6), (2, 0.3)], [(3, 0.5), (4, 0.4)], [(5, 0.9)]])
    assert len(b.tokens) == 1 + 2 + 4 + 4
    tree = b.build(budget=5)
    # chances: 1:.6, 1-3:.3, 1-3-5:.27, 1-4:.24, 2:.3, ... -> best four non-root nodes
    assert len(tree) == 5
    kept = {tuple(path_tokens(tree, i)) for i in range(1, len(tree))}
    assert kept == {(1,), (2,), (1, 3), (1, 3, 5)}
    for i in range(1, len(tree)):  # every kept node's parent is kept and comes first
        assert 0 <= tree.parents[i] < i


def test_a_chain_hangs_each_level_under_the_top_drafts_above_it() -> None:
    b = TreeBuilder(root=0)
    b.add_chain([[(1, 0.6), (2, 0.3)], [(3, 0.5), (4, 0.4)], [(5, 0.9)]])
    tree = b.build(budget=100)
    paths = {tuple(path_tokens(tree, i)): b.scores[i] for i in range(1, len(b.tokens))}
    # the second level knew only that the first was 1: nothing hangs under 2
    assert set(paths) == {(1,), (2,), (1, 3), (1, 4), (1, 3, 5)}
    assert abs(paths[(1, 4)] - 0.24) < 1e-9 and abs(paths[(1, 3, 5)] - 0.27) < 1e-9
    empty = TreeBuilder(root=0)
    empty.add_chain([[(1, 0.5)], [], [(9, 0.9)]])  # a level that proposes nothing ends the chain
    assert empty.tokens == [0, 1]


def test_child_estimate_never_exceeds_parent() -> None:
    b = TreeBuilder(root=0)
    b.add([1, 2], [0.1, 0.9], NGRAM)  # a chain whose tail claims more than its head
    b.add([7], [0.5], HEADS)
    tree = b.build(budget=2)
    assert tree.tokens == [0, 7]


def test_drafts_below_the_minimum_score_are_not_verified() -> None:
    b = TreeBuilder(root=0)
    b.add([1, 2], [0.6, 0.2], HEADS)
    b.add([3], [0.3], NGRAM)
    assert b.build(budget=10, min_score=0.25).tokens == [0, 1, 3]
    assert b.build(budget=10, min_score=0.5).tokens == [0, 1]
    assert b.build(budget=10, min_score=0.7).tokens == [0]  # nothing likely enough: a plain one-token step
