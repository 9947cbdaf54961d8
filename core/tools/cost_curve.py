"""The cost curve: how long one forward of n new tokens takes over a KV cache of L tokens.

TokenSwift replaces several one-token forwards by one forward of a token tree, so it pays exactly where verifying
n tokens costs little more than one: with a mean of a tokens accepted per step (bonus included), a tree of n nodes
can at best reach a / c(n) of vanilla decoding's speed, c(n) being the cost of n tokens relative to one.
`python -m core cost-curve` measures c(n, L) for the engine's decoder (native on a CPU, in the weights' format;
compiled graphs with `--compile` on CUDA) and, with `--torch`, for the same model on PyTorch's operators in fp32,
side by side in one process (sizes and modes alternate within every repeat); it prints a markdown table plus JSON.

On a CPU it also prints each context's memory floor: a one-token step must read every weight matrix and the cached
keys and values once, so it cannot take less than those bytes over the rate at which this machine reads memory
(timed between the forwards, as a sum over a buffer far larger than the caches; the median), and the share of that
rate a one-token step achieves. A step near its floor leaves nothing to gain but reading fewer bytes; verifying more
tokens per read is then all TokenSwift can add. Our kernels' rows also get each (L, n)'s compute floor, their
arithmetic alone (compute_floor.py, timed between the forwards as the read rate is), and the least c(n) the two
floors allow over the measured one-token step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from core.engine import Engine
from core.generation.decoding import PREFILL_CHUNK
from core.runtime.kv_cache import KVCache
from core.runtime.loading import load_model
from core.runtime.model import Transformer
from core.tools.compute_floor import ComputeFloor
from core.tools.hardware import hardware, run_report
from core.tools.roofline import ReadRate, step_bytes


def add_cost_curve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="1024,4096,7000", help="cached tokens L, comma-separated")
    p.add_argument("--sizes", default="1,2,4,8,16", help="new tokens n per forward, comma-separated")
    p.add_argument("--repeats", type=int, default=15, help="timed forwards per (L, n, mode); the median is reported")
    p.add_argument("--torch", action="store_true",
                   help="also time the model on PyTorch's operators with fp32 weights (the path before our kernels)")
    p.add_argument("--json", default=None, help="write every figure to this file")
    p.add_argument("--markdown", default=None, metavar="JSON",
                   help="print a saved run (a --json file) as the README shows it, and exit")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_forward(forward: Callable[..., Any], cache: KVCache, context: int, n: int, vocab: int,
                 device: torch.device) -> float:
    """Seconds of one forward of n new tokens after `context` cached ones; the cache is left as it was."""
    tokens = torch.randint(vocab, (n,), device=device)
    positions = torch.arange(context, context + n, device=device)
    block = torch.ones(n, n, dtype=torch.bool, device=device).tril_() if n > 1 else None
    _sync(device)
    t0 = time.perf_counter()
    forward(tokens, positions, cache, block)
    _sync(device)
    seconds = time.perf_counter() - t0
    cache.rollback()
    return seconds


@torch.inference_mode()
def measure(modes: dict[str, tuple[Transformer, Callable[..., Any]]], contexts: list[int], sizes: list[int],
            repeats: int, progress: Callable[[str], None] = lambda _: None,
            read_rate: ReadRate | None = None, arithmetic: ComputeFloor | None = None) -> list[dict[str, Any]]:
    """Median milliseconds per (mode, L, n); a mode is a model (whose cache it fills) and its forward. `read_rate`
    and `arithmetic`, if given, sample the memory's read rate and the kernels' arithmetic once per repeat, between
    the forwards."""
    rows = []
    for context in contexts:
        progress(f"filling {context}-token caches")
        caches = {}
        for name, (model, _) in modes.items():
            device, vocab = model.device, model.cfg.vocab_size
            cache = caches[name] = model.new_cache(context + max(sizes) + 32)
            ids = torch.randint(vocab, (context,), generator=torch.Generator().manual_seed(context)).to(device)
            for start in range(0, context, PREFILL_CHUNK):  # chunked, as generation prefills
                chunk = ids[start:start + PREFILL_CHUNK]
                model(chunk, torch.arange(start, start + len(chunk), device=device), cache,
                      logits_rows=slice(-1, None))
                cache.commit()
        times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in sizes}
        for name, (model, fwd) in modes.items():  # untimed: first calls allocate and fill caches
            for n in sizes:
                time_forward(fwd, caches[name], context, n, model.cfg.vocab_size, model.device)
        for r in range(repeats):
            progress(f"L={context}: repeat {r + 1}/{repeats}")
            order = sizes[r % len(sizes):] + sizes[:r % len(sizes)]  # rotate so drift hits every size alike
            if read_rate is not None:
                read_rate.sample()
            if arithmetic is not None:
                arithmetic.sample(context)
            for n in order:
                for name, (model, fwd) in (modes.items() if r % 2 == 0 else reversed(modes.items())):
                    times[(name, n)].append(time_forward(fwd, caches[name], context, n, model.cfg.vocab_size,
                                                         model.device))
        for name in modes:
            one = statistics.median(times[(name, 1)]) if 1 in sizes else None
            for n in sizes:
                ms = 1000 * statistics.median(times[(name, n)])
                rows.append({"mode": name, "context": context, "n": n, "ms": round(ms, 2),
                             "vs_one": round(ms / (1000 * one), 3) if one else None})
    return rows


def memory_floor(model: Transformer, rows: list[dict[str, Any]], mode: str, contexts: list[int],
                 bandwidth: float) -> list[dict[str, Any]]:
    """Per context: the megabytes a one-token step of `mode` reads, the milliseconds that takes at `bandwidth`
    bytes/s, and the share of that rate the measured step achieves."""
    out = []
    for L in contexts:
        b = step_bytes(model, L)
        floor_ms = 1000 * b / bandwidth
        one = next((r["ms"] for r in rows if (r["mode"], r["context"], r["n"]) == (mode, L, 1)), None)
        # Three significant digits: a tiny model's floor is a small fraction of its step, and must not round to 0.
        out.append({"context": L, "mb": round(b / 1e6, 1), "floor_ms": float(f"{floor_ms:.3g}"),
                    "achieved": float(f"{floor_ms / one:.3g}") if one else None})
    return out


def markdown(rows: list[dict[str, Any]], arithmetic: list[dict[str, Any]] | None = None) -> str:
    """The timings as a table, with the compute floor's columns (least_vs_one's rows) after the first mode's."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    names = [f"{m} ms | {m} ×n=1" + (" | arithmetic ms | least ×n=1" if arithmetic and i == 0 else "")
             for i, m in enumerate(modes)]
    header = "| L | n | " + " | ".join(names) + " |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for context in sorted({r["context"] for r in rows}):
        for n in sorted({r["n"] for r in rows}):
            cells = []
            for i, m in enumerate(modes):
                r = next(x for x in rows if (x["mode"], x["context"], x["n"]) == (m, context, n))
                cells += [f"{r['ms']:.1f}", f"{r['vs_one']:.2f}" if r["vs_one"] else "–"]
                if arithmetic and i == 0:
                    f = next(x for x in arithmetic if (x["context"], x["n"]) == (context, n))
                    cells += [f"{f['ms']:.1f}", f"{f['least_vs_one']:.2f}" if f["least_vs_one"] else "–"]
            lines.append(f"| {context} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def least_vs_one(rows: list[dict[str, Any]], mode: str, memory: list[dict[str, Any]],
                 arithmetic: dict[tuple[int, int], float]) -> list[dict[str, Any]]:
    """Per (L, n): the compute floor's milliseconds, and the least c(n) `mode`'s kernels allow on this CPU: a forward
    of n tokens takes at least its memory floor and at least its arithmetic (ComputeFloor), over the measured
    one-token step."""
    out = []
    for (L, n), ms in sorted(arithmetic.items()):
        one = next((r["ms"] for r in rows if (r["mode"], r["context"], r["n"]) == (mode, L, 1)), None)
        reads = next(r["floor_ms"] for r in memory if r["context"] == L)
        # ms unrounded (the table prints it rounded): at 3 digits two contexts' times could tie; the ratio from the
        # report's own numbers
        out.append({"context": L, "n": n, "ms": ms, "least_vs_one": round(max(reads, ms) / one, 2) if one else None})
    return out


def floor_line(floor: dict[str, Any]) -> str:
    achieved = any(r.get("achieved") for r in floor["rows"])
    return (f"Memory floor of a one-token step of `{floor['mode']}` (this CPU reads {floor['read_gb_s']} GB/s"
            + ("; the share of that rate the step achieved" if achieved else "") + "): "
            + ", ".join(f"L={r['context']}: {r['mb']:.0f} MB, {r['floor_ms']:.1f} ms"
                        + (f" ({100 * r['achieved']:.0f}%)" if r.get("achieved") else "") for r in floor["rows"]))


def report_markdown(report: dict[str, Any]) -> str:
    """A saved run (the --json file) as the README shows it: command, machine, table (with the compute floor's
    columns where the run has them), memory floor."""
    text = run_report(report["command"], report["hardware"], markdown(report["rows"], report.get("compute_floor")))
    return text + (f"\n\n{floor_line(report['memory_floor'])}" if report.get("memory_floor") else "")


def run_cost_curve(args: argparse.Namespace) -> int:
    if args.markdown:
        print(report_markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    contexts = sorted(int(x) for x in args.contexts.split(","))
    sizes = sorted(int(x) for x in args.sizes.split(","))
    if not sizes or min(sizes) < 1 or args.repeats < 1:
        raise ValueError("--sizes must be positive integers and --repeats at least 1")
    engine = Engine.load(args.model, heads=None, device=args.device, compile=args.compile, weights=args.weights)
    if max(contexts) + max(sizes) > engine.max_context:
        raise ValueError(f"--contexts up to {max(contexts)} plus {max(sizes)} new tokens exceed the model's "
                         f"context of {engine.max_context} tokens")
    model = engine.model
    main = f"native {model.layers[0].wqkv.packed.fmt}" if model.native else "eager"
    modes: dict[str, tuple[Transformer, Callable[..., Any]]] = {main: (model, lambda t, p, c, m: model(t, p, c, m))}
    if engine.runner is not None:
        print(f"compiling graphs for sizes {sizes} …", file=sys.stderr)
        engine.runner.warm_up(tuple(sizes))
        runner = engine.runner
        modes = {"compiled": (model, lambda t, p, c, m: runner.forward(t, p, c, m))}
    if args.torch:
        torch_model = load_model(args.model, device=args.device, weights="fp32", native=False).model
        modes["torch fp32"] = (torch_model, lambda t, p, c, m: torch_model(t, p, c, m))
    read_rate = ReadRate() if engine.device.type == "cpu" else None
    arithmetic = ComputeFloor(model, sizes) if model.native else None
    rows = measure(modes, contexts, sizes, args.repeats, lambda s: print(s, file=sys.stderr), read_rate, arithmetic)
    floor = least = None
    if read_rate is not None:
        bandwidth = read_rate.median()
        first = next(iter(modes))
        floor = {"mode": first, "read_gb_s": round(bandwidth / 1e9, 1),
                 "rows": memory_floor(model, rows, first, contexts, bandwidth)}
        if arithmetic is not None:
            least = least_vs_one(rows, first, floor["rows"], arithmetic.ms(contexts))
    print(markdown(rows, least))
    if floor is not None:
        print("\n" + floor_line(floor))
    if args.json:
        report = {"command": args.command_line, "model": engine.loaded.name, "weights": engine.loaded.source,
                  "hardware": hardware(), "repeats": args.repeats, "rows": rows, "memory_floor": floor,
                  "compute_floor": least}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0

