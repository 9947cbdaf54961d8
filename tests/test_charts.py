"""app/charts.py: bucket downsampling (one-shot and incremental agree), empty data, 10K+ steps quickly."""
from __future__ import annotations

import json
import random
import time

import pytest

from app.charts import (
    MAX_POINTS,
    StepBuckets,
    accepted_figure,
    all_figures,
    buckets_from_rows,
    repetition_figure,
    throughput_figure,
)


def bucket_means(values: list[float], max_points: int = MAX_POINTS) -> list[float]:
    """The buckets StepBuckets must produce, computed in one shot: at most ``max_points`` means of consecutive
    equal-width runs (the last may be short), widths doubling until they fit."""
    if max_points < 1:
        raise ValueError("max_points must be at least 1")
    width = 1
    while -(-len(values) // width) > max_points:
        width *= 2
    return [sum(chunk) / len(chunk) for chunk in (values[i:i + width] for i in range(0, len(values), width))]


def rows(n: int, seed: int = 0, start: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out, so_far = [], 0
    for i in range(start, start + n):
        accepted = rng.randint(0, 4)
        ngram = rng.randint(0, accepted)
        so_far += accepted + 1
        out.append({"step": i, "new_tokens": accepted + 1, "accepted": accepted, "from_ngram": ngram,
                    "step_ms": 10.0 + rng.random(), "tokens_so_far": so_far, "tokens_per_s": 100.0 + i % 7,
                    "repetition": (i % 10) / 10 if i % 3 else None})
    return out


def figure_points(fig) -> list[int]:
    return [len(t.x or ()) for t in fig.data]


def test_bucket_means_small_series_unchanged():
    assert bucket_means([1, 2, 3], max_points=5) == [1, 2, 3]
    assert bucket_means([], max_points=5) == []


def test_bucket_means_power_of_two_buckets_last_may_be_short():
    values = list(range(10))
    assert bucket_means(values, max_points=4) == [1.5, 5.5, 8.5]  # width 4: [0..3], [4..7], [8, 9]
    assert len(bucket_means(list(range(10_001)), max_points=500)) <= 500
    with pytest.raises(ValueError):
        bucket_means([1.0], max_points=0)


@pytest.mark.parametrize("n, max_points", [(1, 4), (7, 4), (8, 4), (9, 4), (1000, 500), (1234, 7), (5000, 3)])
def test_incremental_buckets_equal_one_shot_means(n, max_points):
    data = rows(n)
    whole = buckets_from_rows(data, max_points=max_points)
    # Fed in uneven batches, as a live run arrives (get_steps with after_step).
    live = StepBuckets(max_points=max_points)
    i = 0
    while i < n:
        k = random.Random(i).randint(1, 50)
        live.extend(data[i:i + k])
        i += k
    assert live.series("new_tokens") == whole.series("new_tokens")
    assert len(whole.series("step")) <= max_points
    expected = bucket_means([r["new_tokens"] for r in data], max_points)
    assert whole.series("new_tokens") == pytest.approx(expected)
    assert whole.series("step") == pytest.approx(bucket_means([r["step"] for r in data], max_points))
    assert (whole.n_steps, whole.last_step) == (n, n - 1)
    assert whole.tokens == data[-1]["tokens_so_far"]
    assert whole.mean_tokens_per_step == pytest.approx(sum(r["new_tokens"] for r in data) / n)


def test_overlapping_reads_are_ignored_and_heads_are_derived():
    b = StepBuckets()
    data = rows(20)
    assert b.extend(data[:10]) == 10
    assert b.extend(data[5:15]) == 5  # steps 5..9 again: skipped
    assert b.n_steps == 15
    heads = b.series("heads")
    assert heads == [r["accepted"] - r["from_ngram"] for r in data[:15]]


def test_missing_values_stay_gaps_and_throughput_falls_back_to_step_times():
    b = buckets_from_rows([{"step": 0, "new_tokens": 2, "step_ms": 100.0, "tokens_so_far": 2},
                           {"step": 1, "new_tokens": 2, "step_ms": 100.0, "tokens_so_far": 4, "repetition": 0.5}])
    assert b.series("repetition") == [None, 0.5]
    assert b.series("tokens_per_s") == [None, pytest.approx(20.0)]  # tokens / decode seconds so far, from step 2
    assert b.last_repetition == 0.5


def test_throughput_starts_at_the_second_step():
    # TokenSwift's first step is a draw from the prefill's logits: one token in 2 ms is not a rate worth drawing.
    data = [{"step": 0, "new_tokens": 1, "step_ms": 2.0, "tokens_so_far": 1, "tokens_per_s": 500.0},
            {"step": 1, "new_tokens": 2, "step_ms": 98.0, "tokens_so_far": 3, "tokens_per_s": 30.0},
            {"step": 2, "new_tokens": 1, "step_ms": 100.0, "tokens_so_far": 4, "tokens_per_s": 20.0}]
    b = StepBuckets()
    b.extend(data[:1])
    assert b.last_tokens_per_s is None and b.series("tokens_per_s") == [None]  # the status line waits too
    b.extend(data[1:])
    assert b.series("tokens_per_s") == [None, 30.0, 20.0] and b.last_tokens_per_s == 20.0
    # Merged into one bucket, the first step's figure still does not count.
    assert buckets_from_rows(data, max_points=2).series("tokens_per_s")[0] == pytest.approx(30.0)


def test_empty_data_gives_placeholder_figures():
    for fig in (*all_figures(None), *all_figures(StepBuckets()), *all_figures({})):
        assert fig.layout.annotations and fig.layout.annotations[0].text in ("No steps yet",)
        assert sum(figure_points(fig)) == 0
    fig = accepted_figure(None, empty="No run yet")
    assert fig.layout.annotations[0].text == "No run yet"


def test_repetition_not_measured_message():
    b = buckets_from_rows([{"step": 0, "new_tokens": 1, "step_ms": 1.0, "tokens_so_far": 1}])
    assert "not measured" in repetition_figure(b).layout.annotations[0].text


def test_one_run_stacks_heads_and_ngram_and_runs_overlay():
    b = buckets_from_rows(rows(50))
    acc = accepted_figure(b)
    assert [t.name for t in acc.data] == ["from heads", "from n-gram", "tokens / step"]
    assert acc.data[0].stackgroup == acc.data[1].stackgroup == "acc"
    both = {"Vanilla": buckets_from_rows(rows(30, seed=1)), "TokenSwift": b}
    for fig in all_figures(both):
        assert [t.name for t in fig.data] == ["Vanilla", "TokenSwift"]
    assert throughput_figure(both).data[0].line.color != throughput_figure(both).data[1].line.color


def test_ten_thousand_steps_fast_and_bounded():
    data = rows(20_000)
    t0 = time.perf_counter()
    b = StepBuckets()
    for i in range(0, len(data), 100):  # 200 polls' worth of incremental reads
        b.extend(data[i:i + 100])
    figs = all_figures(b)
    payload = sum(len(f.to_json()) for f in figs)
    elapsed = time.perf_counter() - t0
    assert elapsed < 3.0, f"20K steps took {elapsed:.2f} s"
    for fig in figs:
        assert max(figure_points(fig)) <= MAX_POINTS
    assert payload < 200_000  # what one refresh sends for three charts, whatever the run's length
    assert len(json.loads(figs[1].to_json())["data"][0]["x"]) <= MAX_POINTS
