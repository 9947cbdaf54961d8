"""The page benchmark (app/page_bench.py): a real `app.py` on the tiny model, the same run decoded with a headless
Chromium page open on it and without; a table and JSON of every run; ratios paired by repeat."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from app import page_bench


@pytest.mark.slow
def test_page_bench_runs_with_and_without_a_page(tiny_model_dir: Path, tmp_path: Path, capsys):
    if not os.path.exists(page_bench.CHROMIUM):
        if os.environ.get("CI"):
            pytest.fail(f"{page_bench.CHROMIUM} is missing: install it with `make browser`")
        pytest.skip(f"{page_bench.CHROMIUM} is missing")
    out = tmp_path / "bench" / "page.json"
    # One thread setting (one server start, the test's main cost); the ratios across settings are tested below.
    rc = page_bench.main(["--model", str(tiny_model_dir), "--threads", "all", "--repeats", "1",
                          "--max-new-tokens", "24", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "| all | on |" in table and "| all | off |" in table
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert sorted((r["threads"], r["page"]) for r in runs) == [("all", "off"), ("all", "on")]
    assert all(r["n_tokens"] == 24 and r["tokens_per_s"] > 0 for r in runs)
    assert report["same_text"] is True  # the same premise and seed: every run wrote the same tokens
    assert [r["vs_all"] for r in report["summary"]] == [1.0, 1.0]
    assert report["hardware"]["cpus"] >= 1


def test_summary_ratios_pair_runs_of_the_same_repeat():
    def run(threads, page, repeat, tps):
        return page_bench.PageRun(threads, page, repeat, 10, 10 / tps, tps, "x")

    runs = [run("all", "on", 0, 4.0), run("1", "on", 0, 8.0), run("all", "on", 1, 10.0), run("1", "on", 1, 10.0),
            run("all", "on", 2, 5.0), run("1", "on", 2, 6.0)]
    rows = {r["threads"]: r for r in page_bench.summarize(runs, ["1", "all"], ["on"])}
    assert rows["1"]["tokens_per_s"] == 8.0 and rows["all"]["tokens_per_s"] == 5.0
    # Median of 2.0, 1.0 and 1.2 (each repeat against its own reference), not 8 / 5.
    assert rows["1"]["vs_all"] == pytest.approx(1.2) and rows["all"]["vs_all"] == 1.0


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--threads", "two"], ["--pages", "maybe"], ["--threads", ""]])
def test_bad_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        page_bench.build_parser().parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_out_of_range_lengths_are_refused(capsys):
    assert page_bench.main(["--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens" in capsys.readouterr().err
