"""`python -m core gpu-check`: the GPU check, one prepared run that downloads nothing (random weights in the published
checkpoints' shapes, core/tools/random_model.py) and writes one JSON file. `make bench-gpu` runs it on CUDA; with
`--device cpu` it runs the same code on tiny shapes in seconds (CI runs it so, tests/test_gpu_check.py).

1. **Cost curve**: the time of one forward of n new tokens (n = 1..64, causal) over 4K / 32K / 100K cached tokens on
   a Llama-3.1-8B-shaped model in bf16, and c(n) = t(n) / t(1): what verifying a tree of n nodes costs.
2. **Compare**: vanilla decoding against TokenSwift (fused and the paper's separate draft mode, random heads) on a
   Qwen2.5-1.5B-shaped model after 2K and 20K tokens of context: decode tokens/s, tokens per step, and whether the
   ids are identical (if not: where they first differ, and vanilla decoding's draw there with its top-2 gap).
3. **Exactness**: TokenSwift's ids against vanilla decoding's on CUDA. On a CPU our kernels make them equal by
   construction; on a GPU a tree's rows share matrix products that one-token steps do not, so bf16 rounding may
   differ at a near-tie. This records, not asserts: identical or not, where, and how close a call vanilla
   decoding's draw was there (core/generation/divergence.py).

Random weights make the acceptance rates meaningless (random heads, near-uniform text); the timings and c(n) are
what the check is for.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from core.engine import Engine
from core.generation.agreement import first_divergence, format_gap
from core.generation.decoding import GenerationConfig, Result
from core.generation.divergence import explain_divergence
from core.generation.sampling import PRESETS
from core.tokenswift.options import TokenSwiftOptions
from core.tools.random_model import parameter_count, random_engine

# (cost-curve shape, its contexts, compare shape, its contexts, new tokens per run) per device kind
PLANS: dict[str, dict[str, Any]] = {
    "cuda": {"curve_shape": "llama-3.1-8b", "contexts": [4096, 32768, 100000], "sizes": list(range(1, 65)),
             "repeats": 5, "compare_shape": "qwen2.5-1.5b", "compare_contexts": [2048, 20480], "new_tokens": 256,
             "exact_tokens": 512},
    "cpu": {"curve_shape": "tiny", "contexts": [256, 1024, 2048], "sizes": [1, 2, 4, 8, 16, 32, 64], "repeats": 2,
            "compare_shape": "tiny", "compare_contexts": [200, 2000], "new_tokens": 40, "exact_tokens": 80},
}
VARIANTS = {"tokenswift": TokenSwiftOptions(), "tokenswift-separate": TokenSwiftOptions(draft_mode="separate")}


def add_gpu_check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda: the real check; cpu: a dry run on tiny shapes (seconds)")
    p.add_argument("--json", default="artifacts/gpu-check.json", help="where the results go")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fill_cache(engine: Engine, length: int, slots: int):  # -> KVCache
    """A cache of `slots` with `length` tokens of random keys and values committed (no prefill needed to time a
    forward over them)."""
    cache = engine.model.new_cache(slots)
    cache.begin(length)
    for buf in (cache.k, cache.v):
        buf[:, :, :length].normal_()
    cache.commit()
    return cache


@torch.inference_mode()
def cost_curve(engine: Engine, contexts: list[int], sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """Median seconds of a forward of n tokens over each context, and c(n) = t(n) / t(1)."""
    device, vocab = engine.device, engine.model.cfg.vocab_size
    cache = fill_cache(engine, max(contexts), max(contexts) + max(sizes))
    rows = []
    for ctx in contexts:
        cache.length = ctx  # every slot below max(contexts) holds keys: any shorter context is a prefix
        times: dict[int, float] = {}
        for n in sizes:
            tokens = torch.randint(vocab, (n,), device=device)
            positions = torch.arange(ctx, ctx + n, device=device)
            mask = torch.ones(n, n, dtype=torch.bool, device=device).tril_() if n > 1 else None
            samples = []
            for i in range(repeats + 1):  # the first one warms up (kernel selection, allocator)
                sync(device)
                t0 = time.perf_counter()
                engine.forward(tokens, positions, cache, mask)
                sync(device)
                if i:
                    samples.append(time.perf_counter() - t0)
                cache.rollback()
            times[n] = statistics.median(samples)
        rows.append({"context": ctx, "ms": {n: 1e3 * t for n, t in times.items()},
                     "c": {n: t / times[sizes[0]] for n, t in times.items()}})
        print(f"  context {ctx}: t(1) {1e3 * times[sizes[0]]:.2f} ms, c(16) {times.get(16, 0) / times[sizes[0]]:.2f},"
              f" c(64) {times.get(64, 0) / times[sizes[0]]:.2f}", flush=True)
    return rows


def ids_report(engine: Engine, prompt: list[int], config: GenerationConfig, ar: list[int],
               ts: list[int]) -> dict[str, Any]:
    """Whether TokenSwift's ids `ts` equal vanilla decoding's `ar`; if not, where they first differ and vanilla
    decoding's draw there (position, both tokens, top-1 / top-2, their gap; None if it could not be recomputed)."""
    where = first_divergence(ar, ts)
    found = None
    if where is not None:
        try:
            found = explain_divergence(engine, prompt, config, ar, ts)
        except Exception as e:  # noqa: BLE001  (out of memory, a failed prefill: a record without it beats none)
            print(f"  could not recompute the draw at token {where}: {type(e).__name__}: {e}", flush=True)
    return {"identical": where is None, "first_divergence": where,
            "divergence": found.to_dict() if found is not None else None}


def said(report: dict[str, Any]) -> str:
    """A report of ids_report in words: identical, or where they differ and the gap there."""
    if report["identical"]:
        return "identical"
    found = report["divergence"]
    return f"differs at {report['first_divergence']}" + (f", gap {format_gap(found['gap'])}" if found else "")


def summary(result: Result) -> dict[str, Any]:
    return {"tokens": result.n_tokens, "tokens_per_s": result.tokens_per_s, "prefill_s": result.prefill_s,
            "decode_s": result.decode_s, "tokens_per_step": result.mean_accepted}


def compare(engine: Engine, context: int, new_tokens: int, presets: list[str]) -> list[dict[str, Any]]:
    """Vanilla and each TokenSwift variant after `context` random prompt tokens; ids compared exactly."""
    vocab = engine.model.cfg.vocab_size
    prompt = torch.randint(3, vocab, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    rows = []
    for preset in presets:
        config = GenerationConfig(max_new_tokens=new_tokens, sampling=PRESETS[preset].with_(seed=7), ignore_eos=True)
        ar = engine.generate(prompt, replace(config, method="ar")).run()
        row: dict[str, Any] = {"context": context, "preset": preset, "ar": summary(ar)}
        for name, options in VARIANTS.items():
            variant = Engine(engine.loaded, engine.heads, options)
            ts = variant.generate(prompt, replace(config, method="tokenswift")).run()
            row[name] = {**summary(ts), "speedup": ts.tokens_per_s / ar.tokens_per_s if ar.tokens_per_s else 0.0,
                         **ids_report(engine, prompt, config, ar.token_ids, ts.token_ids)}
        rows.append(row)
        print(f"  context {context}, {preset}: ar {ar.tokens_per_s:.1f} tok/s; " + ", ".join(
            f"{name} {row[name]['tokens_per_s']:.1f} tok/s ({row[name]['tokens_per_step']:.2f}/step, "
            f"{said(row[name])})"
            for name in VARIANTS), flush=True)
    return rows


def machine(device: torch.device) -> dict[str, Any]:
    info = {"device": device.type, "torch": torch.__version__, "python": platform.python_version(),
            "host": platform.node()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / (1 << 30), 1), cuda=torch.version.cuda)
    return info


def run_gpu_check(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA device here: run `python -m core gpu-check --device cpu` for the dry run")
    plan = PLANS[device.type]
    if device.type == "cpu":
        torch.set_num_threads(1)  # a dry run: steady on a small shared machine
    started = time.perf_counter()
    out: dict[str, Any] = {"command": getattr(args, "command_line", ""), "machine": machine(device),
                           "dry_run": device.type == "cpu", "plan": plan}

    print(f"cost curve: {plan['curve_shape']}-shaped, contexts {plan['contexts']}", flush=True)
    engine = random_engine(plan["curve_shape"], args.device, heads=False)
    out["cost_curve"] = {"shape": plan["curve_shape"], "parameters": parameter_count(engine.model),
                         "dtype": str(engine.model.dtype),
                         "rows": cost_curve(engine, plan["contexts"], plan["sizes"], plan["repeats"])}
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()

    print(f"compare: {plan['compare_shape']}-shaped, random heads", flush=True)
    engine = random_engine(plan["compare_shape"], args.device)
    out["compare"] = {"shape": plan["compare_shape"], "parameters": parameter_count(engine.model),
                      "new_tokens": plan["new_tokens"],
                      "rows": [row for ctx in plan["compare_contexts"]
                               for row in compare(engine, ctx, plan["new_tokens"], ["greedy", "studio"])]}

    print("exactness: TokenSwift's ids against vanilla decoding's", flush=True)
    out["exactness"] = compare(engine, 64, plan["exact_tokens"], ["greedy", "studio", "paper"])
    out["seconds"] = time.perf_counter() - started
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path} in {out['seconds']:.0f} s", file=sys.stderr)
    return 0
