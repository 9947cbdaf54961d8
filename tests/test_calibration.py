"""Draft-score calibration: each first-level draft learns from whether it was the token drawn, verified or not."""
from __future__ import annotations

import pytest

from core.calibration import PRIOR, DraftCalibrator
from core.tree import HEADS, NGRAM, TreeBuilder


def test_an_unseen_bin_trusts_the_raw_score() -> None:
    assert DraftCalibrator().chance(0.73, HEADS) == pytest.approx(0.73)


def test_the_measured_rate_takes_over_per_source_and_bin() -> None:
    cal = DraftCalibrator()
    for step in range(40):  # heads' drafts scored 0.9 are drawn one time in five; n-gram drafts at 0.3 always
        cal.observe([(7, 0.9, HEADS), (8, 0.3, NGRAM)], drawn=7 if step % 5 == 0 else 8)
    assert cal.chance(0.92, HEADS) == pytest.approx((8 + PRIOR * 0.92) / (40 + PRIOR))
    assert cal.chance(0.9, HEADS) < 0.3 < 0.7 < cal.chance(0.3, NGRAM)
    # other bins and sources keep their raw score
    assert cal.chance(0.5, HEADS) == pytest.approx(0.5) and cal.chance(0.9, NGRAM) == pytest.approx(0.9)


def test_recalibrate_rescales_first_level_nodes_and_the_paths_below() -> None:
    b = TreeBuilder(root=0)
    b.add([1, 2], [0.8, 0.4], HEADS)
    b.add([3], [0.5], NGRAM)
    proposed = b.recalibrate(lambda score, source: score / 4 if source == HEADS else 1.0)
    assert proposed == [(1, 0.8, HEADS), (3, 0.5, NGRAM)]
    # node 1: 0.8 -> 0.2, its child scaled alike (0.4 -> 0.1); node 3 raised to 1.0
    assert b.scores[1:] == pytest.approx([0.2, 0.1, 1.0])
    tree = b.build(budget=2, min_score=0.15)
    assert tree.tokens == [0, 3]
    assert b.build(budget=10, min_score=0.15).tokens == [0, 1, 3]


def test_a_raised_chance_never_lifts_a_child_above_its_parent() -> None:
    b = TreeBuilder(root=0)
    b.add([1, 2], [0.2, 0.2], HEADS)
    b.recalibrate(lambda score, source: 0.6)
    assert b.scores[1:] == pytest.approx([0.6, 0.6])
