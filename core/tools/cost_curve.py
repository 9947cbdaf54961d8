"""The cost curve: how long one forward of n new tokens takes over a KV cache of L tokens.

TokenSwift replaces several one-token forwards by one forward of a token tree, so it pays exactly where verifying
n tokens costs little more than one: with a mean of a tokens accepted per step (bonus included), a tree of n nodes
can at best reach a / c(n) of vanilla decoding's speed, c(n) being the cost of n tokens relative to one. On a GPU
c(n) stays near 1 up to dozens of tokens; on a CPU it grows at once. `python -m core cost-curve` measures c(n, L)
for the eager model and, with `--compile`, for the compiled graphs, side by side in one process (sizes and modes
alternate within every repeat), and prints a markdown table plus JSON. `--matmul-attention` times each mode a
second time with attention as two matrix products instead of the CPU attention kernel; `--library-linear` times the
eager model a second time on an unpacked copy of its weights, with MKL's matrix products instead of the few-row CPU
linear kernel (compiled graphs use inductor's GEMMs either way); side by side too.

On a CPU it also prints each context's memory floor: a one-token step must read every weight matrix and the cached
keys and values once, so it cannot take less than those bytes over the rate at which this machine reads memory
(timed between the forwards, as a sum over a buffer far larger than the caches; the median). A step near its floor
leaves nothing to gain but reading fewer bytes; verifying more tokens per read is then all TokenSwift can add.
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
from core.runtime.kernels import attention as attention_kernel
from core.runtime.kv_cache import KVCache
from core.runtime.loading import load_model
from core.tools.hardware import hardware, run_report


def add_cost_curve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="1024,4096,7000", help="cached tokens L, comma-separated")
    p.add_argument("--sizes", default="1,2,3,4,6,8", help="new tokens n per forward, comma-separated")
    p.add_argument("--repeats", type=int, default=15, help="timed forwards per (L, n, mode); the median is reported")
    p.add_argument("--matmul-attention", action="store_true",
                   help="also time each mode with attention as two matrix products instead of the CPU kernel")
    p.add_argument("--library-linear", action="store_true",
                   help="also time the eager model with MKL's matrix products instead of the few-row CPU kernel")
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
def measure(engine: Engine, model: Any, contexts: list[int], sizes: list[int], repeats: int,
            progress: Callable[[str], None] = lambda _: None, matmul_attention: bool = False,
            library_model: Any = None, read_rate: ReadRate | None = None) -> list[dict[str, Any]]:
    """Median milliseconds per (mode, L, n); modes are 'eager' (`model`, as eager decoding runs it) and, if the
    engine compiles, 'compiled', each also with matrix-product attention ('eager-matmul', 'compiled-matmul') if
    `matmul_attention`, and 'eager-library' (`library_model`: weights not packed, MKL's products) if given.
    `read_rate`, if given, samples the memory's read rate once per repeat, between the forwards."""
    device = engine.device
    vocab = model.cfg.vocab_size
    modes: dict[str, Callable[..., Any]] = {"eager": lambda t, p, c, m: model(t, p, c, m)}
    if engine.runner is not None:
        modes["compiled"] = lambda t, p, c, m: engine.runner.forward(t, p, c, m)
    if matmul_attention:
        for name, fwd in list(modes.items()):
            modes[f"{name}-matmul"] = without_kernel(fwd)
    if library_model is not None:
        modes["eager-library"] = lambda t, p, c, m: library_model(t, p, c, m)
    rows = []
    for context in contexts:
        progress(f"filling a {context}-token cache")
        cache = model.new_cache(context + max(sizes) + 32)
        ids = torch.randint(vocab, (context,), device=device)
        for start in range(0, context, PREFILL_CHUNK):  # chunked, as generation prefills
            chunk = ids[start:start + PREFILL_CHUNK]
            model(chunk, torch.arange(start, start + len(chunk), device=device), cache, logits_rows=slice(-1, None))
            cache.commit()
        times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in sizes}
        for name, fwd in modes.items():  # untimed: first calls allocate and fill caches
            for n in sizes:
                time_forward(fwd, cache, context, n, vocab, device)
        for r in range(repeats):
            progress(f"L={context}: repeat {r + 1}/{repeats}")
            order = sizes[r % len(sizes):] + sizes[:r % len(sizes)]  # rotate so drift hits every size alike
            if read_rate is not None:
                read_rate.sample()
            for n in order:
                for name, fwd in (modes.items() if r % 2 == 0 else reversed(modes.items())):
                    times[(name, n)].append(time_forward(fwd, cache, context, n, vocab, device))
        for name in modes:
            one = statistics.median(times[(name, 1)]) if 1 in sizes else None
            for n in sizes:
                ms = 1000 * statistics.median(times[(name, n)])
                rows.append({"mode": name, "context": context, "n": n, "ms": round(ms, 2),
                             "vs_one": round(ms / (1000 * one), 3) if one else None})
    return rows


def step_bytes(cfg: Any, context: int, element_size: int) -> int:
    """Bytes a one-token forward reads at least: every weight matrix (the layers' and the lm_head; the embedding
    lookup reads one row) and the keys and values of `context` cached tokens."""
    h, q, kv, inner = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    layer = h * (q + 2 * kv) + q * h + 3 * h * inner  # wqkv, wo, gate + up, down
    return element_size * (cfg.n_layers * (layer + 2 * kv * context) + cfg.vocab_size * h)


class ReadRate:
    """Bytes per second this CPU reads from memory with torch's threads, sampled between the timed forwards (a sum
    over a buffer far beyond any cache), so that the floor sees the same contention as the steps it bounds."""

    def __init__(self, mib: int = 512):
        self.buffer = torch.ones(mib * 2**20 // 4)
        self.buffer.sum()  # untimed: pages touched
        self.samples: list[float] = []

    def sample(self) -> None:
        t0 = time.perf_counter()
        self.buffer.sum()
        self.samples.append(self.buffer.numel() * 4 / (time.perf_counter() - t0))

    def median(self) -> float:
        return statistics.median(self.samples)


def memory_floor(model: Any, contexts: list[int], bandwidth: float) -> list[dict[str, Any]]:
    """Per context: the megabytes a one-token step reads and the milliseconds that takes at `bandwidth` bytes/s."""
    reads = {L: step_bytes(model.cfg, L, model.dtype.itemsize) for L in contexts}
    return [{"context": L, "mb": round(b / 1e6, 1), "floor_ms": round(1000 * b / bandwidth, 2)}
            for L, b in reads.items()]


def without_kernel(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        with attention_kernel.disabled():
            return forward(*args)
    return run


def markdown(rows: list[dict[str, Any]]) -> str:
    order = ["eager", "eager-matmul", "eager-library", "compiled", "compiled-matmul"]
    modes = sorted({r["mode"] for r in rows}, key=order.index)
    header = "| L | n | " + " | ".join(f"{m} ms | {m} ×n=1" for m in modes) + " |"
    lines = [header, "|" + "---|" * (2 + 2 * len(modes))]
    for context in sorted({r["context"] for r in rows}):
        for n in sorted({r["n"] for r in rows}):
            cells = []
            for m in modes:
                r = next(x for x in rows if (x["mode"], x["context"], x["n"]) == (m, context, n))
                cells += [f"{r['ms']:.1f}", f"{r['vs_one']:.2f}" if r["vs_one"] else "–"]
            lines.append(f"| {context} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def floor_line(floor: dict[str, Any]) -> str:
    return (f"Memory floor of a one-token step (this CPU reads {floor['read_gb_s']} GB/s): "
            + ", ".join(f"L={r['context']}: {r['mb']:.0f} MB, {r['floor_ms']:.1f} ms" for r in floor["rows"]))


def report_markdown(report: dict[str, Any]) -> str:
    """A saved run (the --json file) as the README shows it: command, machine, table, memory floor."""
    text = run_report(report["command"], report["hardware"], markdown(report["rows"]))
    return text + (f"\n\n{floor_line(report['memory_floor'])}" if report.get("memory_floor") else "")


def run_cost_curve(args: argparse.Namespace) -> int:
    if args.markdown:
        print(report_markdown(json.loads(Path(args.markdown).read_text())))
        return 0
    contexts = sorted(int(x) for x in args.contexts.split(","))
    sizes = sorted(int(x) for x in args.sizes.split(","))
    if not sizes or min(sizes) < 1 or args.repeats < 1:
        raise ValueError("--sizes must be positive integers and --repeats at least 1")
    engine = Engine.load(args.model, heads=None, device=args.device, compile=args.compile)
    if max(contexts) + max(sizes) > engine.max_context:
        raise ValueError(f"--contexts up to {max(contexts)} plus {max(sizes)} new tokens exceed the model's "
                         f"context of {engine.max_context} tokens")
    if engine.runner is not None:
        print(f"compiling graphs for sizes {sizes} …", file=sys.stderr)
        engine.runner.warm_up(tuple(sizes))
    eager_model, library_model = engine.model, None
    if engine.runner is not None:  # a compiled engine's graphs take the plain weights; eager decoding packs them
        eager_model = load_model(args.model, device=args.device).model
        eager_model.pack_for_decoding()
        library_model = engine.model if args.library_linear else None
    elif args.library_linear:
        library_model = load_model(args.model, device=args.device).model
    read_rate = ReadRate() if engine.device.type == "cpu" else None
    rows = measure(engine, eager_model, contexts, sizes, args.repeats, lambda s: print(s, file=sys.stderr),
                   args.matmul_attention, library_model, read_rate)
    print(markdown(rows))
    floor = None
    if read_rate is not None:
        bandwidth = read_rate.median()
        floor = {"read_gb_s": round(bandwidth / 1e9, 1), "rows": memory_floor(engine.model, contexts, bandwidth)}
        print("\n" + floor_line(floor))
    if args.json:
        report = {"command": args.command_line, "model": engine.loaded.name, "dtype": str(engine.model.dtype),
                  "hardware": hardware(),
                  "repeats": args.repeats, "rows": rows, "memory_floor": floor}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
