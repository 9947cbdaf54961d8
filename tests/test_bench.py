"""The benchmark command: one process, every method, a table and JSON with the figures; lengths beyond the
context refused."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from core.tools.cli import main


def test_bench_reports_every_method_and_length(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Write about rivers."}) + "\n" + json.dumps({"prompt": "A letter."}) + "\n")
    out, plot = tmp_path / "new" / "b.json", tmp_path / "charts" / "b.html"  # folders made on demand
    rc = main(["bench", "--model", str(tiny_model_dir), "--heads", "none", "--prompts", str(prompts),
               "--lengths", "16,40", "--methods", "hf,hf-lookup,ar,tokenswift,tokenswift-separate",
               "--sampling", "paper", "--json", str(out), "--plot", str(plot)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "| 40 | tokenswift-separate |" in table and "| 16 | hf-lookup |" in table
    report = json.loads(out.read_text())
    rows = {(r["method"], r["length"]): r for r in report["rows"]}
    assert len(rows) == 10 and all(r["runs"] == 2 for r in rows.values())
    for L in (16, 40):
        assert rows[("ar", L)]["speedup_vs_ar"] == 1.0
        for m in ("tokenswift", "tokenswift-separate"):
            assert rows[(m, L)]["ids_equal_ar"] is True and rows[(m, L)]["tokens_per_step"] >= 1.0
        assert rows[("hf", L)]["decode_tok_s"] > 0 and rows[("hf", L)]["peak_rss_mb"] > 0
        # our methods' steps read at a rate beside this CPU's (transformers' are not counted)
        for m in ("ar", "tokenswift"):
            assert rows[(m, L)]["bandwidth_gb_s"] > 0 and rows[(m, L)]["read_gb_s"] > 0
            assert rows[(m, L)]["bandwidth_share"] > 0  # (a tiny model may sit in the caches: no upper bound)
        assert rows[("hf", L)]["bandwidth_gb_s"] is None
    assert "GB/s (of rate)" in table
    hw = report["hardware"]
    assert hw["threads"] >= 1 and report["settings"]["sampling"] == "paper"
    if Path("/proc/cpuinfo").is_file() and hw["machine"] == "x86_64":  # the CPU is named, with its vector unit
        assert hw["cpu"] and hw["vector"] in ("avx512f", "avx2", "avx", "sse4_2") and "/" in hw["cpu_family_model"]
    html = plot.read_text()
    assert "<html>" in html and "speedup over ar" in html


def test_ablation_variants_change_one_thing(tmp_path: Path) -> None:
    from core.engine import Engine
    from core.generation.sampling import PRESETS
    from core.runtime.loading import load_model
    from core.tokenswift.heads import DraftHeads
    from core.tokenswift.options import MAX_TREE, TokenSwiftOptions
    from core.tools.bench import run_ours
    from tests.conftest import make_tiny_checkpoint

    loaded = load_model(str(make_tiny_checkpoint(tmp_path / "m", seed=3, initializer_range=0.3, vocab_size=512)))
    # every draft verified, so each source's drafts are tried however unlikely the calibrator finds them
    engine = Engine(loaded, DraftHeads.initial(loaded.model, root_width=16),
                    TokenSwiftOptions(draft_depth=MAX_TREE, min_draft_score=0.0))
    # a prompt after which this model's greedy text repeats itself a few times (n-gram drafts can be right)
    prompt = torch.randint(512, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    runs = {m: run_ours(engine, m, prompt, 300, PRESETS["greedy"])
            for m in ("ar", "tokenswift", "tokenswift-no-ngram", "tokenswift-no-heads", "tokenswift-no-root",
                      "tokenswift-tree2")}
    assert all(r.token_ids == runs["ar"].token_ids for r in runs.values())
    # on this peaky random model n-gram drafts are sometimes right; each source drafts only where it is on
    assert runs["tokenswift-no-ngram"].from_ngram == 0 < runs["tokenswift"].from_ngram
    assert runs["tokenswift-no-heads"].accepted == runs["tokenswift-no-heads"].from_ngram > 0
    assert max(runs["tokenswift-tree2"].step_tokens) <= 2 < engine.options.tree_budget  # the CPU default: 4 nodes
    assert engine.heads is not None and engine.options.ngram_topk > 0 and engine.options.root_head, "engine untouched"


def test_a_runs_bandwidth_is_the_bytes_its_steps_must_read_over_its_time(tiny_model_dir: Path) -> None:
    """Vanilla decoding's steps each read the weights and the cache of the sequence before their token once (the
    last token is drawn from the forward before it): the run's bytes by its last token are their sum, and its
    bandwidth that over its time."""
    from core.engine import Engine
    from core.generation.sampling import PRESETS
    from core.tools.bench import run_ours
    from core.tools.roofline import step_bytes

    engine = Engine.load(str(tiny_model_dir), heads=None, device="cpu")
    prompt = list(range(5, 25))
    run = run_ours(engine, "ar", prompt, 30, PRESETS["greedy"])
    read = sum(step_bytes(engine.model, len(prompt) + i) for i in range(29))
    assert run.reads[-1] == read and run.bandwidth_at(30) == read / run.times[-1]
    assert run.read_rate is not None and run.read_rate > 0


def test_a_diverging_run_reports_where_and_the_gap_there(tiny_model_dir: Path) -> None:
    """Records of real runs, one of which is made to differ from vanilla decoding's at a known token: its rows carry
    the recomputed draw there and the table says where and the gap; the identical ones still say "yes"."""
    from core.engine import Engine
    from core.generation.agreement import format_gap
    from core.generation.divergence import explain_divergence
    from core.generation.sampling import PRESETS
    from core.tools.bench import explain_runs, markdown, run_config, run_ours, summarize

    engine = Engine.load(str(tiny_model_dir), heads=None, device="cpu")
    prompt = torch.randint(3, 49152, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    sampling = PRESETS["studio"].with_(seed=9)
    methods = ["ar", "tokenswift", "tokenswift-separate"]
    runs = [run_ours(engine, m, prompt, 40, sampling) for m in methods]
    ar, ts, separate = runs
    assert ts.token_ids == separate.token_ids == ar.token_ids
    ts.token_ids[23] = (ar.token_ids[23] + 1) % 49152  # TokenSwift's record differs from token 23 on
    divergences = explain_runs(engine, runs, [prompt], 40, sampling)
    found = explain_divergence(engine, prompt, run_config("ar", 40, sampling), ar.token_ids, ts.token_ids)
    assert divergences == {("tokenswift", 0, 0): found}
    assert (found.position, found.vanilla_token, found.tokenswift_token, found.top1) == (
        23, ar.token_ids[23], ts.token_ids[23], ar.token_ids[23])  # the top-1 there is vanilla decoding's draw

    rows = {(r["method"], r["length"]): r for r in summarize(runs, methods, [16, 40], divergences)}
    for key in (("tokenswift", 16), ("tokenswift-separate", 16), ("tokenswift-separate", 40)):
        assert rows[key]["ids_equal_ar"] is True and rows[key]["first_divergence"] == [] and "divergences" not in rows[key]
    diverged = rows[("tokenswift", 40)]
    assert diverged["ids_equal_ar"] is False and diverged["first_divergence"] == [23]
    assert diverged["divergences"] == [{"prompt": 0, "repeat": 0, **found.to_dict()}]
    cells = {(line.split(" | ")[0][2:], line.split(" | ")[1]): line.rsplit(" | ", 1)[1][:-2]
             for line in markdown(list(rows.values())).splitlines()[2:]}
    assert cells[("40", "tokenswift")] == f"NO, from 23 (gap {format_gap(found.gap)})"
    assert cells[("16", "tokenswift")] == cells[("40", "tokenswift-separate")] == "yes"
    # a run saved before gaps were recorded reads as it did
    old = {k: v for k, v in diverged.items() if k != "divergences"}
    assert markdown([old]).splitlines()[2].endswith("| NO, from [23] |")


def test_a_variants_larger_tree_gets_its_graph_compiled(tmp_path: Path) -> None:
    from core.engine import Engine
    from core.runtime.loading import load_model
    from core.tokenswift.options import TokenSwiftOptions
    from core.tools.bench import method_engine
    from tests.conftest import make_tiny_checkpoint

    loaded = load_model(str(make_tiny_checkpoint(tmp_path / "m", vocab_size=512)), native=False)
    engine = Engine(loaded, None, TokenSwiftOptions(tree_budget=2), compile=True)
    graphs = {m: [what for what, _ in method_engine(engine, m).warm_up_plan()] for m in ("tokenswift", "tokenswift-tree4")}
    assert "the 2-token graph" in graphs["tokenswift"] and "the 4-token graph" not in graphs["tokenswift"]
    assert "the 4-token graph" in graphs["tokenswift-tree4"]  # else its trees would run eagerly and be timed so


def test_transformers_baselines_can_stop_early(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    rc = main(["bench", "--model", str(tiny_model_dir), "--heads", "none", "--n-prompts", "1", "--lengths", "16,40",
               "--methods", "hf,ar", "--hf-max-length", "16", "--json", str(out)])
    assert rc == 0
    rows = {(r["method"], r["length"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("hf", 16), ("ar", 16), ("ar", 40)}
    assert rows[("ar", 16)]["speedup_vs_hf"] > 0 and rows[("ar", 40)]["speedup_vs_hf"] is None


def test_lengths_beyond_the_context_are_refused(tiny_model_dir: Path, capsys) -> None:
    rc = main(["bench", "--model", str(tiny_model_dir), "--heads", "none", "--lengths", "1024,5000",
               "--methods", "ar"])
    assert rc == 2
    assert "do not fit the model's context of 4096 tokens" in capsys.readouterr().err


def test_the_context_limit_counts_every_methods_tree(tiny_model_dir: Path, capsys) -> None:
    import re

    def longest_that_fits(methods: str, length: int) -> int:
        rc = main(["bench", "--model", str(tiny_model_dir), "--heads", "none", "--tree-budget", "2",
                   "--lengths", str(length), "--methods", methods])
        assert rc == 2
        return int(re.search(r"the longest length that fits is (\d+)", capsys.readouterr().err).group(1))

    fits = longest_that_fits("ar,tokenswift", 5000)
    # a variant's 4-node tree appends two more tokens a step past the end than the 2-node default
    assert longest_that_fits("ar,tokenswift-tree4", fits) == fits - 2


def test_unknown_method_is_refused(tiny_model_dir: Path, capsys) -> None:
    assert main(["bench", "--model", str(tiny_model_dir), "--methods", "ar,medusa"]) == 2
    assert "unknown method(s) medusa" in capsys.readouterr().err


def test_cost_curve_times_the_native_decoder_beside_pytorchs(tiny_model_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "c.json"
    rc = main(["cost-curve", "--model", str(tiny_model_dir), "--weights", "q8", "--torch", "--contexts", "40,100",
               "--sizes", "1,3", "--repeats", "3", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    assert ("| L | n | native q8_0 ms | native q8_0 ×n=1 | arithmetic ms | least ×n=1 | torch fp32 ms | "
            "torch fp32 ×n=1 |") in table
    assert "| 100 | 3 |" in table
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(r["mode"], r["context"], r["n"]) for r in rows} == {
        (m, L, n) for m in ("native q8_0", "torch fp32") for L in (40, 100) for n in (1, 3)}
    assert all(r["ms"] > 0 for r in rows)
    assert all(r["vs_one"] == 1.0 for r in rows if r["n"] == 1)
    # the memory floor counts the bytes of the weights as stored (q8_0 blocks) and the keys/values at each L (bf16)
    assert "Memory floor of a one-token step of `native q8_0`" in table
    floor = report["memory_floor"]
    from core.runtime.loading import load_model

    model = load_model(str(tiny_model_dir), weights="q8").model
    cfg = model.cfg
    layers = [m for block in model.layers for m in (block.wqkv, block.wo, block.w_gate_up, block.w_down)]
    weights = sum(m.packed.data.numel() + 2 * m.packed.d.numel() for m in [*layers, model.lm_head])
    assert weights < sum(m.in_features * m.out_features for m in [*layers, model.lm_head]) * 1.1  # ~1 byte each
    assert floor["read_gb_s"] > 0 and [r["context"] for r in floor["rows"]] == [40, 100]
    for r in floor["rows"]:
        kv = 2 * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * r["context"]
        assert r["mb"] == round((weights + kv) / 1e6, 1)
        assert r["floor_ms"] == pytest.approx((weights + kv) / (floor["read_gb_s"] * 1e9) * 1000, rel=0.06)
        assert 0 < r["achieved"]
    assert "q8_0" in report["weights"]
    # the compute floor: the kernels' arithmetic for each (L, n) (test_compute_floor_* times it), and the least
    # c(n) that it and the memory floor allow over the measured one-token step
    arithmetic = {(r["context"], r["n"]): r for r in report["compute_floor"]}
    assert set(arithmetic) == {(L, n) for L in (40, 100) for n in (1, 3)}
    reads = {r["context"]: r["floor_ms"] for r in floor["rows"]}
    for r in rows:
        if r["mode"] != "native q8_0":
            continue
        a = arithmetic[(r["context"], r["n"])]
        assert a["ms"] > 0
        one = next(x["ms"] for x in rows if (x["mode"], x["context"], x["n"]) == (r["mode"], r["context"], 1))
        assert a["least_vs_one"] == round(max(reads[r["context"]], a["ms"]) / one, 2)


def test_compute_floor_keeps_each_contexts_rounds(smol_engine) -> None:
    """The real model's arithmetic floor: a round of timings per call, kept by the context whose forwards it sat
    between, on the threads asked for (torch's own count left as it was); each context's floor from its own rounds'
    medians, none for a context without rounds. (What the timings come to is the benchmark's business.)"""
    from core.tools.compute_floor import ComputeFloor

    threads = torch.get_num_threads()
    floor = ComputeFloor(smol_engine.model, [1, 4], threads=2)
    for _ in range(3):
        floor.sample(1024)
    floor.sample(4096)
    assert torch.get_num_threads() == threads
    assert sorted(floor.samples) == [(L, n) for L in (1024, 4096) for n in (1, 4)]
    assert [len(floor.samples[(L, 1)]) for L in (1024, 4096)] == [3, 1]
    ms = floor.ms([1024, 4096])
    for (L, n), rounds in floor.samples.items():
        linear, per_key = (max(0.0, statistics.median(r[i] for r in rounds)) for i in (0, 1))
        assert ms[(L, n)] == 1000 * (linear + per_key * L)
    with pytest.raises(KeyError):
        floor.ms([2048])


def test_cost_curve_refuses_contexts_beyond_the_model(tiny_model_dir: Path, capsys) -> None:
    assert main(["cost-curve", "--model", str(tiny_model_dir), "--contexts", "5000"]) == 2
    assert "exceed the model's context of 4096 tokens" in capsys.readouterr().err
