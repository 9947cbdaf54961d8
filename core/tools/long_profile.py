"""`python -m core long-profile`: the per-step Python overhead of decoding at lengths up to 100K tokens and beyond, on
a CPU, with a tiny random model (core/tools/random_model.py), so that nothing a step does outside the model grows
with the text: the n-gram table, calibration, drafting, the tree, the draws and the decode loop.

A step's overhead is its wall time less its forwards' (Step.seconds - Step.forward_s). The forwards grow with
length (attention reads every cached key), the overhead must not. Its time still rises a little: the same Python
code runs slower after a forward that streamed a long cache through the CPU's caches. So a step's work is also
counted, in Python function calls, which no cache state changes. The history is Zipf-distributed tokens, so a
frequent token has thousands of n-gram continuations at 100K, as a comma has in a real text. Instead of a prefill
(hours of attention at 100K on two cores) the cache is filled with random keys and values: the steps after it do
exactly what they do after a real prefill.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch
from torch import Tensor

from core.engine import Engine
from core.generation.decoding import Generation, GenerationConfig, Step
from core.generation.sampling import PRESETS
from core.runtime.kv_cache import KVCache
from core.tokenswift.ngram import NGramTable
from core.tools.args import options_from
from core.tools.random_model import random_engine

CALL_COUNTED_STEPS = 16  # steps whose Python calls are counted, after the timed ones (counting slows them)


def add_long_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="1000,10000,50000,100000", help="cached tokens before the profiled steps")
    p.add_argument("--steps", type=int, default=64, help="decoding steps profiled at each length")
    p.add_argument("--methods", default="ar,tokenswift")
    p.add_argument("--preset", default="studio", choices=sorted(PRESETS))
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a small shared machine more threads make timings noisy)")
    p.add_argument("--json", help="also write the rows to this file")


def zipf_history(length: int, vocab: int, seed: int = 0) -> list[int]:
    """`length` token ids, frequent ones very frequent (rank r drawn with chance ∝ 1 / r^1.1)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab - 2) ** 1.1
    return (rng.choice(vocab - 3, size=length, p=p / p.sum()) + 3).tolist()  # ids 0-2: special


def filled_prefill(gen: Generation, cache: KVCache) -> tuple[Tensor, Tensor]:
    """Stands in for Generation.prefill: random keys and values for the whole sequence, committed; the last
    position's logits and hidden state random too."""
    n, model = len(gen.tokens), gen.decoder.model
    g = torch.Generator(device=model.device).manual_seed(n)
    cache.begin(n)
    for buf in (cache.k, cache.v):
        buf[:, :, :n].copy_(torch.randn(buf[:, :, :n].shape, generator=g, device=model.device))
    cache.commit()
    return (torch.randn(model.cfg.vocab_size, generator=g, device=model.device),
            torch.randn(model.cfg.hidden_size, generator=g, device=model.device, dtype=model.dtype))


def profile_steps(engine: Engine, length: int, steps: int, method: str, preset: str = "studio") -> dict[str, Any]:
    """Run `steps` steps of `method` after `length` cached tokens; per-step overhead and forward time."""
    history = zipf_history(length, engine.model.cfg.vocab_size)
    counted_steps = min(steps, CALL_COUNTED_STEPS)
    config = GenerationConfig(max_new_tokens=(steps + counted_steps) * engine.max_block + 1, method=method,
                              sampling=PRESETS[preset].with_(seed=1), ignore_eos=True)
    gen = engine.generate(history, config)
    gen.prefill = lambda cache: filled_prefill(gen, cache)  # type: ignore[method-assign]
    overhead, forward, tokens = [], [], 0
    # n-gram continuations proposed: the one part of a step's work that rises with length, up to its cap (two keys,
    # each at most the tree's nodes below the root), as rarer tokens gather continuations; counted on the class since
    # the step makes its own table
    chains = [0]
    topk = NGramTable.topk

    def counted(self: NGramTable, token: int, k: int) -> list[tuple[tuple[int, ...], int]]:
        out = topk(self, token, k)
        chains[0] += len(out)
        return out

    NGramTable.topk = counted  # type: ignore[method-assign]
    steps_left = iter(gen)
    try:
        for step in steps_left:
            if step.index == 0:
                chains[0] = 0
                continue  # the prefill's own draw
            overhead.append(step.seconds - step.forward_s)
            forward.append(step.forward_s)
            tokens += len(step.token_ids)
            if len(overhead) == steps:
                break
    finally:
        NGramTable.topk = topk  # type: ignore[method-assign]
    ordered = sorted(overhead)
    return {"method": method, "length": length, "steps": len(overhead),
            "overhead_ms_median": 1e3 * statistics.median(overhead),
            "overhead_ms_p90": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
            "forward_ms_median": 1e3 * statistics.median(forward), "tokens_per_step": tokens / len(overhead),
            "ngram_chains_per_step": chains[0] / len(overhead),
            "python_calls_per_step": python_calls_per_step(steps_left, counted_steps)}


def python_calls_per_step(steps: Iterator[Step], n: int) -> float:
    """The Python function calls each of the next `n` steps makes, on average (model code included): a measure of a
    step's work that, unlike its time, cold caches after a long forward do not inflate."""
    calls, done = 0, 0

    def on_event(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call"

    for _ in range(n):
        sys.setprofile(on_event)
        try:
            step = next(steps, None)
        finally:
            sys.setprofile(None)
        if step is None:
            break
        done += 1
    return calls / max(done, 1)


def run_long_profile(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in args.lengths.split(",")]
    methods = args.methods.split(",")
    torch.set_num_threads(args.threads)
    engine = random_engine("tiny", "cpu", options=options_from(args))
    room = (args.steps + min(args.steps, CALL_COUNTED_STEPS)) * engine.max_block + 1  # the tokens the steps write
    if max(lengths) + room > engine.max_context:
        raise ValueError(f"lengths up to {engine.max_context - room} tokens")
    rows = []
    print(f"{'method':<12}{'cached':>9}{'overhead ms (median / p90)':>30}{'forward ms':>12}{'tokens/step':>13}"
          f"{'n-gram chains/step':>20}{'Python calls/step':>19}")
    with torch.inference_mode():
        for method in methods:
            for length in lengths:
                row = profile_steps(engine, length, args.steps, method, args.preset)
                rows.append(row)
                print(f"{method:<12}{length:>9}{row['overhead_ms_median']:>19.3f} / {row['overhead_ms_p90']:<8.3f}"
                      f"{row['forward_ms_median']:>12.3f}{row['tokens_per_step']:>13.2f}{row['ngram_chains_per_step']:>20.1f}"
                      f"{row['python_calls_per_step']:>19.0f}")
                sys.stdout.flush()
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        ratio = mine[-1]["overhead_ms_median"] / max(mine[0]["overhead_ms_median"], 1e-9)
        calls = mine[-1]["python_calls_per_step"] / max(mine[0]["python_calls_per_step"], 1e-9)
        print(f"{method}: at {mine[-1]['length']} tokens a step's median overhead is {ratio:.2f}x and its Python calls "
              f"{calls:.2f}x those at {mine[0]['length']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": getattr(args, "command_line", ""), "rows": rows}, indent=1))
    return 0
