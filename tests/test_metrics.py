"""core/generation/metrics.py: distinct-n, the windowed repetition share and its incremental tracker."""

import random
import time

import pytest

from core.generation.metrics import (
    RepetitionTracker,
    distinct_n,
    ngrams,
    repeated_ngram_share,
)


def test_ngrams_and_distinct_n():
    assert ngrams([1, 2, 3], 2) == [(1, 2), (2, 3)]
    assert ngrams([1, 2], 3) == []
    assert distinct_n([1, 2, 3, 4], 1) == 1.0
    assert distinct_n([1, 1, 1, 1], 1) == 0.25
    assert distinct_n([1, 2, 1, 2, 1], 2) == pytest.approx(2 / 4)  # (1,2) (2,1) (1,2) (2,1)
    assert distinct_n([], 2) == 0.0 and distinct_n([5], 2) == 0.0
    with pytest.raises(ValueError):
        distinct_n([1, 2], 0)


def test_repeated_ngram_share():
    assert repeated_ngram_share(list(range(100)), n=4) == 0.0  # nothing repeats
    assert repeated_ngram_share([7] * 100, n=4) == pytest.approx(1 - 1 / 97)  # one 4-gram, 97 times
    loop = [1, 2, 3, 4, 5] * 20  # a 5-token loop: 5 distinct 4-grams among 97
    assert repeated_ngram_share(loop, n=4) == pytest.approx(1 - 5 / 97)
    # Only the window counts: an old loop followed by fresh text scores 0.
    assert repeated_ngram_share([9] * 1000 + list(range(100, 700)), n=4, window=512) == 0.0
    assert repeated_ngram_share([1, 2, 3], n=4) == 0.0
    with pytest.raises(ValueError):
        repeated_ngram_share([1, 2, 3], window=0)


@pytest.mark.parametrize("n, window", [(4, 512), (2, 16), (3, 3), (1, 5), (4, 1)])
def test_tracker_matches_the_function(n, window):
    rng = random.Random(n * 1000 + window)
    tokens: list[int] = []
    tracker = RepetitionTracker(n, window)
    for _ in range(300):
        chunk = [rng.randrange(12) for _ in range(rng.randrange(1, 5))]  # small vocabulary: plenty of repeats
        tokens += chunk
        assert tracker.extend(chunk) == pytest.approx(repeated_ngram_share(tokens, n, window))
    assert RepetitionTracker(n, window, tokens).value == pytest.approx(repeated_ngram_share(tokens, n, window))


def test_tracker_is_fast_on_long_outputs():
    rng = random.Random(0)
    tokens = [rng.randrange(500) for _ in range(20_000)]
    t0 = time.perf_counter()
    tracker = RepetitionTracker()
    for t in tokens:  # one step per token: the worst case for the worker
        tracker.extend([t])
    assert time.perf_counter() - t0 < 1.0
    assert tracker.value == pytest.approx(repeated_ngram_share(tokens))
