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
            assert row[name]["divergence"] is None
    assert report["seconds"] < 60


def test_ids_that_differ_are_reported_with_the_draw_there() -> None:
    """Where the ids differ (here: one edited token of a real vanilla run), the record says where and holds vanilla
    decoding's recomputed draw there, whose top-1 is the token vanilla decoding drew."""
    from core.generation.agreement import format_gap
    from core.generation.decoding import GenerationConfig
    from core.generation.divergence import explain_divergence
    from core.generation.sampling import PRESETS
    from core.tools.gpu_check import ids_report, said
    from core.tools.random_model import random_engine

    engine = random_engine("tiny", "cpu")
    prompt = list(range(3, 40))
    config = GenerationConfig(max_new_tokens=24, sampling=PRESETS["paper"].with_(seed=7), ignore_eos=True)
    ar = engine.generate(prompt, config).run().token_ids
    assert ids_report(engine, prompt, config, ar, list(ar)) == {"identical": True, "first_divergence": None,
                                                                "divergence": None}
    ts = ar[:10] + [(ar[10] + 1) % engine.model.cfg.vocab_size] + ar[11:]
    report = ids_report(engine, prompt, config, ar, ts)
    found = explain_divergence(engine, prompt, config, ar, ts)
    assert report == {"identical": False, "first_divergence": 10, "divergence": found.to_dict()}
    assert (found.position, found.vanilla_token, found.tokenswift_token, found.top1) == (10, ar[10], ts[10], ar[10])
    assert said(report) == f"differs at 10, gap {format_gap(found.gap)}"


def test_the_makefile_target_runs_it() -> None:
    makefile = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    target = makefile[makefile.index("\nbench-gpu:"):]
    assert "-m core gpu-check --device cuda" in target.split("\n\n")[0]
