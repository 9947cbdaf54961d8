"""The n-gram table: counts, top-k order, and no entry lost on equal counts."""
from __future__ import annotations

import pytest

from core.tokenswift.ngram import NGramTable


def test_counts_and_topk_order() -> None:
    t = NGramTable(4)
    t.extend([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5])
    assert t.topk(1, 5) == [((2, 3, 4), 2), ((2, 3, 5), 1)]
    assert t.total(1) == 3
    assert t.topk(9, 3) == []


def test_equal_counts_never_drop_or_overwrite_a_continuation() -> None:
    # Ten different continuations of token 7, each seen exactly twice: all must survive, each with count 2.
    seq: list[int] = []
    for rep in range(2):
        for c in range(10):
            seq += [7, 100 + c, 200 + c, 300 + c]
    t = NGramTable(4)
    t.extend(seq)
    top = t.topk(7, 20)
    assert sorted(top) == sorted(((100 + c, 200 + c, 300 + c), 2) for c in range(10))
    assert len(t.table[7]) == 10
    # ties are broken by recency, deterministically: the last seen comes first
    assert top[0][0] == (109, 209, 309)
    assert [cont for cont, _ in t.topk(7, 3)] == [(109, 209, 309), (108, 208, 308), (107, 207, 307)]


def test_incremental_extend_equals_one_shot() -> None:
    seq = [i % 7 for i in range(200)] + [3, 1, 4, 1, 5, 9, 2, 6]
    whole = NGramTable(4)
    whole.extend(seq)
    parts = NGramTable(4)
    for end in range(0, len(seq) + 1, 13):
        parts.extend(seq[:end])
    parts.extend(seq)
    assert whole.table == parts.table


def test_lag_leaves_recent_tokens_out() -> None:
    t = NGramTable(4)
    t.extend([1, 2, 3, 4, 5, 6], upto=4)
    assert t.topk(1, 1) == [((2, 3, 4), 1)]
    assert t.topk(2, 1) == []
    t.extend([1, 2, 3, 4, 5, 6])
    assert t.topk(2, 1) == [((3, 4, 5), 1)]


def test_n_must_be_at_least_two() -> None:
    with pytest.raises(ValueError):
        NGramTable(1)
