"""The compute floor of a native forward: how long the kernels' arithmetic alone takes for n tokens over L keys.

A forward must read every weight and the cached keys once (cost_curve's memory floor), and it must also do its
arithmetic: every linear layer's multiply-adds for each of its n rows, and attention's scores and weighted values
of each row over the L keys. The arithmetic is timed here on inputs that stay in the caches, on one thread, as the
slope between two sizes (so no call's fixed cost counts), and shared evenly by the forward's threads: no forward of
these kernels on this CPU can take less, however well its reads overlap its arithmetic. So a forward of n tokens
costs at least max(memory floor, compute floor(n)), and c(n) is at least that over the measured one-token step:
where the arithmetic of n rows outgrows the reading of the weights, wider trees cost more than one step however the
kernels stream. The per-row glue (norms, rotary embedding, quantizing activations) is left out: a lower bound.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from core.runtime.kernels import cpu
from core.runtime.kv_cache import tile_keys
from core.runtime.model import Transformer
from core.runtime.weights import COLS, NativeLinear, PackedWeight

SLICE_BYTES = 96 * 1024  # the smaller slice of a weight timed (the larger is twice it): well inside a core's L2
ATTENTION_KEYS = (256, 512)  # the two key counts attention is timed over (a chunk and two: in L2 at these widths)
CALLS = 10  # calls per timing: one takes microseconds


def _slope(run: Callable[[int], None], sizes: tuple[int, int], repeats: int) -> float:
    """Seconds per unit of size: the median time of `run(sizes[1])` less that of `run(sizes[0])`, over the
    difference (each timed `repeats` times, alternating, CALLS calls a time)."""
    times: dict[int, list[float]] = {s: [] for s in sizes}
    for s in sizes:  # untimed: the inputs into the caches
        run(s)
    for _ in range(repeats):
        for s in sizes:
            t0 = time.perf_counter()
            for _ in range(CALLS):
                run(s)
            times[s].append((time.perf_counter() - t0) / CALLS)
    a, b = (statistics.median(times[s]) for s in sizes)
    return max(0.0, b - a) / (sizes[1] - sizes[0])


def _tiles(w: PackedWeight, t: int) -> NativeLinear:
    """A layer of the first t tiles (16 output columns each) of w: the same kernel on fewer columns."""
    return NativeLinear(PackedWeight(w.fmt, t * COLS, w.k, w.data[:t], None if w.d is None else w.d[:t],
                                     None if w.m is None else w.m[:t]))


def linear_seconds(model: Transformer, n: int, repeats: int = 15) -> float:
    """One thread's seconds for the linear layers' arithmetic of n rows: the decoder's layers and the lm_head,
    each kind (format, inputs) timed once on a slice in the caches, per tile, times the model's tiles of it."""
    kinds: dict[tuple[str, int], list[PackedWeight]] = defaultdict(list)
    for module in [*model.layers.modules(), model.lm_head]:
        if isinstance(module, NativeLinear):
            kinds[(module.packed.fmt, module.packed.k)].append(module.packed)
    total = 0.0
    for (_, k), weights in kinds.items():
        w = max(weights, key=lambda p: p.data.shape[0])
        per_tile = max(1, w.nbytes // w.data.shape[0])
        t = max(1, min(w.data.shape[0] // 2, SLICE_BYTES // per_tile))
        slices = {t: _tiles(w, t), 2 * t: _tiles(w, 2 * t)}
        x = torch.randn(n, k)
        seconds_per_tile = _slope(lambda s: slices[s](x), (t, 2 * t), repeats)
        total += seconds_per_tile * sum(p.data.shape[0] for p in weights)
    return total


def attention_seconds(model: Transformer, n: int, repeats: int = 15) -> float:
    """One thread's seconds for attention's arithmetic of n tokens per cached key, over every layer: timed over keys
    in the caches, in the model's cache format, multiplied as the stack multiplies them."""
    cfg = model.cfg
    h, g, d = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    slots = max(ATTENTION_KEYS) + n
    dtype = model.cache_dtype
    keys = tile_keys(torch.randn(h, slots, d).to(dtype))  # in tiles, as the cache holds them
    values = torch.randn(h, slots, d).to(dtype)
    q = torch.randn(h, g * n, d)
    block = torch.ones(n, n, dtype=torch.bool).tril_() if n > 1 else None
    products = not model.bf16_activations  # a bf16 model's stack computes in fp32 over the widened cache

    def run(past: int) -> None:
        cpu.attend(q, keys, values, n, past, block, None, d**-0.5, products)

    return _slope(run, ATTENTION_KEYS, repeats) * cfg.n_layers


@torch.inference_mode()
def compute_floor(model: Transformer, contexts: list[int], sizes: list[int], threads: int | None = None,
                  repeats: int = 15) -> dict[tuple[int, int], float]:
    """Milliseconds of arithmetic a native forward of n tokens over L cached ones needs at least, per (L, n): one
    thread's time shared evenly by `threads` (default: torch's)."""
    threads = threads or torch.get_num_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for n in sizes:
            linear, per_key = linear_seconds(model, n, repeats), attention_seconds(model, n, repeats)
            for L in contexts:
                out[(L, n)] = 1000 * (linear + per_key * L) / threads
        return out
    finally:
        torch.set_num_threads(before)
