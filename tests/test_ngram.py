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


def brute_topk(t: NGramTable, token: int, k: int) -> list[tuple[tuple[int, ...], int]]:
    """What topk means, by scanning every continuation: count, then recency."""
    conts = sorted(t.table.get(token, {}).items(), key=lambda kv: (kv[1][0], kv[1][1]), reverse=True)
    return [(cont, entry[0]) for cont, entry in conts[:k]]


def test_topk_and_total_equal_a_full_scan_as_the_table_grows() -> None:
    import random

    rng = random.Random(0)
    seq = [min(int(rng.paretovariate(1.2)), 40) for _ in range(3000)]  # few frequent tokens, many rare ones
    t = NGramTable(4)
    for end in range(0, len(seq) + 1, 97):
        t.extend(seq[:end])
        for token in (1, 2, 3, 17, 40):
            for k in (1, 5, 20):
                assert t.topk(token, k) == brute_topk(t, token, k)
            assert t.total(token) == sum(e[0] for e in t.table.get(token, {}).values())
    assert len(t) == sum(len(c) for c in t.table.values())


def lines_run(fn) -> int:
    """Python lines executed by fn(): a count of the work it does in Python, independent of the machine's speed."""
    import sys

    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def test_a_steps_lookups_do_not_scan_the_history() -> None:
    """A step's n-gram work (index the new tokens, then total and top-20 of two keys) runs the same Python lines
    whether the key has 50 continuations or 5,000, as a frequent token has in a 100K-token text."""
    def history(n_conts: int) -> list[int]:
        seq: list[int] = []
        for c in range(n_conts):  # key 7 followed by n_conts distinct continuations, each seen once or twice
            seq += [7, 1000 + c, 2000 + c % 97, 3000 + c % 89] * (1 + c % 2)
        return seq

    work = []
    for n_conts in (50, 5000):
        seq = history(n_conts)
        t = NGramTable(4)
        t.extend(seq)
        seq += [7, 5, 6, 8]  # one step's new tokens

        def step(t: NGramTable = t, seq: list[int] = seq) -> None:
            t.extend(seq)
            for key in (7, 5):
                t.total(key)
                t.topk(key, 20)

        work.append(lines_run(step))
    assert work[0] == work[1], work
