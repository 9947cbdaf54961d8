"""Draft-score calibration: each draft whose parent was drawn learns from whether it was drawn too, verified or not."""
from __future__ import annotations

import pytest

from core.tokenswift.calibration import PRIOR, DraftCalibrator, Proposed
from core.tokenswift.tree import HEADS, NGRAM, TreeBuilder


def test_an_unseen_bin_trusts_the_raw_score() -> None:
    assert DraftCalibrator().chance(0.73, HEADS) == pytest.approx(0.73)


def proposed(*paths: tuple[list[int], list[float], int]) -> Proposed:
    """The drafts of a trie holding these (path, scores, source), each score given the node's parent as drafted."""
    b = TreeBuilder(root=0)
    for path, scores, source in paths:
        b.add(path, scores, source)
    return b.recalibrate(lambda score, source, depth: score)


def test_the_measured_rate_takes_over_per_source_and_bin() -> None:
    cal = DraftCalibrator()
    drafts = proposed(([7], [0.9], HEADS), ([8], [0.3], NGRAM))
    for step in range(40):  # heads' drafts scored 0.9 are drawn one time in five; n-gram drafts at 0.3 always
        cal.observe(drafts, [7 if step % 5 == 0 else 8])
    assert cal.chance(0.92, HEADS) == pytest.approx((8 + PRIOR * 0.92) / (40 + PRIOR))
    assert cal.chance(0.9, HEADS) < 0.3 < 0.7 < cal.chance(0.3, NGRAM)
    # other bins and sources keep their raw score
    assert cal.chance(0.5, HEADS) == pytest.approx(0.5) and cal.chance(0.9, NGRAM) == pytest.approx(0.9)


def test_deeper_drafts_are_judged_given_their_parent_was_drawn() -> None:
    cal = DraftCalibrator()
    chain = proposed(([5, 6, 7], [0.5, 0.5, 0.5], NGRAM))  # 0.5, then 1.0 given the parent, twice
    for step in range(40):
        # the chain's first token is drawn every other step; given it, its second one time in two; given both,
        # its third always (the drawn tokens: the accepted path and the one after it)
        drawn = [5, 6, 7] if step % 8 == 0 else [5, 6] if step % 8 == 4 else [5, 9] if step % 2 == 0 else [3]
        cal.observe(chain, drawn)
    assert cal.chance(0.5, NGRAM, 1) == pytest.approx((20 + PRIOR * 0.5) / (40 + PRIOR))
    assert cal.chance(1.0, NGRAM, 2) == pytest.approx((10 + PRIOR) / (20 + PRIOR))  # judged only after a 5
    # third tokens: judged only where 5, 6 were drawn and a token after them (steps 0, 8, ...: 5 of them, all right)
    assert cal.chance(1.0, NGRAM, 3) == pytest.approx(1.0)
    assert cal.chance(0.95, NGRAM, 4) == cal.chance(0.95, NGRAM, 3) > 0.95  # deeper ones share depth 3's bins
    assert cal.chance(0.2, NGRAM, 3) == pytest.approx(0.2)  # an unseen bin keeps its raw score


def test_recalibrate_scores_each_node_by_its_chance_given_its_parent() -> None:
    b = TreeBuilder(root=0)
    b.add([1, 2], [0.8, 0.4], HEADS)
    b.add([3, 4], [0.5, 0.5], NGRAM)
    drafts = b.recalibrate(lambda score, source, depth: score / 4 if source == HEADS else 1.0 / depth)
    # each node's raw score given its parent, and who proposed it; the trie's children: 1 -> 2, 3 -> 4 under the root
    assert drafts.scores[1:] == pytest.approx([0.8, 0.5, 0.5, 1.0])
    assert drafts.sources[1:] == [HEADS, HEADS, NGRAM, NGRAM]
    assert drafts.children == [{1: 1, 3: 3}, {2: 2}, {}, {4: 4}, {}]
    # node 1: 0.8 -> 0.2, its child 0.2 * (0.5 / 4); node 3: raised to 1.0, its child 1.0 * 1 / 2
    assert b.scores[1:] == pytest.approx([0.2, 0.025, 1.0, 0.5])
    assert b.build(budget=2, min_score=0.15).tokens == [0, 3]
    assert b.build(budget=10, min_score=0.15).tokens == [0, 1, 3, 4]


def test_a_raised_chance_never_lifts_a_child_above_its_parent() -> None:
    b = TreeBuilder(root=0)
    b.add([1, 2], [0.2, 0.2], HEADS)
    b.recalibrate(lambda score, source, depth: 0.6)
    assert b.scores[1:] == pytest.approx([0.6, 0.36])
