"""The GPU check (`make bench-gpu`, core/tools/gpu_check.py) end to end in its dry mode: the same code on tiny
shapes on a CPU, so that it cannot break unnoticed before a GPU runs it. On a CPU the ids must be identical: our
kernels make TokenSwift's equal to vanilla decoding's by construction."""
from __future__ import annotations

import json
from pathlib import Path

from core.tools.cli import main
from core.tools.gpu_check import PLANS, VARIANTS


def test_the_dry_run_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    assert main(["gpu-check", "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    plan = PLANS["cpu"]
    assert report["dry_run"] and report["machine"]["device"] == "cpu"
    curve = report["cost_curve"]["rows"]
    assert [r["context"] for r in curve] == plan["contexts"]
    for row in curve:
        assert list(row["c"]) == [str(n) for n in plan["sizes"]] and row["c"]["1"] == 1.0
        assert all(ms > 0 for ms in row["ms"].values())
    compared = report["compare"]["rows"]
    assert [(r["context"], r["preset"]) for r in compared] == [(c, p) for c in plan["compare_contexts"]
                                                                for p in ("greedy", "studio")]
    for row in compared + report["exactness"]:
        assert row["ar"]["tokens"] == row["tokenswift"]["tokens"] > 0
        for name in VARIANTS:
            assert row[name]["identical"] and row[name]["first_divergence"] is None, (name, row)
    assert report["seconds"] < 60


def test_the_makefile_target_runs_it() -> None:
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    target = makefile[makefile.index("\nbench-gpu:"):]
    assert "-m core gpu-check --device cuda" in target.split("\n\n")[0]
