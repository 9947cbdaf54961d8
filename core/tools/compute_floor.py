"""The compute floor of a native forward: how long the kernels' arithmetic alone takes for n tokens over L keys.

A forward must read every weight and the cached keys once (cost_curve's memory floor), and it must also do its
arithmetic: every linear layer's multiply-adds for each of its n rows, and attention's scores and weighted values
of each row over the L keys. The arithmetic is timed here on inputs that stay in the caches, with the forward's
threads working at once (each on its own part, kept in its core's L2), as the slope between two sizes (so no call's
fixed cost counts): no forward of these kernels on this CPU can take less, however well its reads overlap its
arithmetic. So a forward of n tokens costs at least max(memory floor, compute floor(n)), and c(n) is at least that
over the measured one-token step: where the arithmetic of n rows outgrows the reading of the weights, wider trees
cost more than one step however the kernels stream. The per-row glue (norms, rotary embedding, quantizing
activations) is left out: a lower bound.

The threads are timed together, not one thread's time shared out, and a round at a time between the forwards it
bounds: on a virtual machine two processors may be one core's two hyperthreads, or share it with another machine's
work for a while, so what two threads add moves in phases, and the floor must see the phase the forwards saw.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from core.runtime.kernels import cpu
from core.runtime.kv_cache import tile_keys
from core.runtime.model import Transformer
from core.runtime.weights import COLS, NativeLinear, PackedWeight

SLICE_BYTES = 96 * 1024  # a thread's part of the smaller slice of a weight timed (the larger twice it): in its L2
ATTENTION_KEYS = (256, 512)  # a thread's keys of each head attention is timed over (a chunk and two: in its L2)
CALLS = 10  # calls per timing
PASSES = 10  # passes over a weight's slice per call of the linear layers' timing (one takes microseconds)


def _slope(run: Callable[[int], None], sizes: tuple[int, int]) -> float:
    """Seconds per unit of size, once: the time of `run(sizes[1])` less that of `run(sizes[0])`, over the difference.
    Each size is run once untimed (its inputs back into the caches), then timed CALLS calls at a time in the order
    small, large, large, small, so a drift of the machine's speed within the round cancels."""
    for s in sizes:
        run(s)
    times = {s: 0.0 for s in sizes}
    for s in (*sizes, *reversed(sizes)):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            run(s)
        times[s] += time.perf_counter() - t0
    return (times[sizes[1]] - times[sizes[0]]) / (2 * CALLS) / (sizes[1] - sizes[0])


def _tiles(w: PackedWeight, t: int) -> NativeLinear:
    """A layer of the first t tiles (16 output columns each) of w: the same kernel on fewer columns."""
    return NativeLinear(PackedWeight(w.fmt, t * COLS, w.k, w.data[:t], None if w.d is None else w.d[:t],
                                     None if w.m is None else w.m[:t]))


class ComputeFloor:
    """The arithmetic of native forwards of each size n on `threads` threads, timed a round at a time (`sample`)
    where the caller wants the machine as its forwards find it (between the forwards over each context), and `ms`
    from the medians of each context's rounds.

    Linear layers: each kind (format, inputs) timed on two slices of its largest weight in the caches, per tile, times
    the model's tiles of that kind (the decoder's layers and the lm_head). Attention: per cached key, timed over two
    key counts in the caches (as many chunks of each head for every thread), in the model's cache format, multiplied
    as the stack multiplies them, times the layers.
    """

    def __init__(self, model: Transformer, sizes: list[int], threads: int | None = None):
        self.sizes = sizes
        self.threads = threads or torch.get_num_threads()
        self.layers = model.cfg.n_layers
        # per (context, n): each round's (linear layers' seconds, attention's seconds per key)
        self.samples: dict[tuple[int, int], list[tuple[float, float]]] = {}
        weights: dict[tuple[str, int], list[PackedWeight]] = {}
        for module in [*model.layers.modules(), model.lm_head]:
            if isinstance(module, NativeLinear):
                weights.setdefault((module.packed.fmt, module.packed.k), []).append(module.packed)
        self.linear = []  # per kind: tiles in the model, the two slices, their input rows per n
        for (_, k), ws in weights.items():
            w = max(ws, key=lambda p: p.data.shape[0])
            per_tile = max(1, w.nbytes // w.data.shape[0])
            t = max(1, min(w.data.shape[0] // 2, self.threads * SLICE_BYTES // per_tile))
            self.linear.append((sum(p.data.shape[0] for p in ws), {t: _tiles(w, t), 2 * t: _tiles(w, 2 * t)},
                                {n: torch.randn(n, k) for n in sizes}))
        cfg = model.cfg
        h, g, self.head_dim = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
        self.keys = (ATTENTION_KEYS[0] * self.threads, ATTENTION_KEYS[1] * self.threads)
        slots = self.keys[1] + max(sizes)
        self.k = tile_keys(torch.randn(h, slots, self.head_dim).to(model.cache_dtype))  # in tiles, as cached
        self.v = torch.randn(h, slots, self.head_dim).to(model.cache_dtype)
        self.q = {n: torch.randn(h, g * n, self.head_dim) for n in sizes}
        self.block = {n: torch.ones(n, n, dtype=torch.bool).tril_() if n > 1 else None for n in sizes}
        self.products = not model.bf16_activations  # a bf16 model's stack computes in fp32 over the widened cache

    @staticmethod
    def _per_tile(slices: dict[int, NativeLinear], x: torch.Tensor) -> float:
        """Seconds of a tile's arithmetic for the rows of x: the slope over the two slices, each call PASSES passes
        inside the kernels (so a call's own cost, tens of microseconds, is shared out instead of drowning a slice's
        difference)."""
        outs = {t: x.new_empty(x.shape[0], layer.args[5]) for t, layer in slices.items()}
        return _slope(lambda t: cpu.linear_passes(x, slices[t].args, PASSES, outs[t]), tuple(slices)) / PASSES

    def _attend(self, n: int, past: int) -> None:
        cpu.attend(self.q[n], self.k, self.v, n, past, self.block[n], None, self.head_dim**-0.5, self.products)

    @torch.inference_mode()
    def sample(self, context: int) -> None:
        """One round of timings, between the forwards over `context` cached tokens: every size's linear layers and
        attention per key."""
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            for n in self.sizes:
                linear = sum(tiles * self._per_tile(slices, x[n]) for tiles, slices, x in self.linear)
                per_key = _slope(lambda past: self._attend(n, past), self.keys) * self.layers
                self.samples.setdefault((context, n), []).append((linear, per_key))
        finally:
            torch.set_num_threads(before)

    def ms(self, contexts: list[int]) -> dict[tuple[int, int], float]:
        """Milliseconds of arithmetic a forward of n tokens over L cached ones needs at least, per (L, n): the
        medians of the rounds sampled at L (at least one)."""
        out = {}
        for L in contexts:
            for n in self.sizes:
                rounds = self.samples[(L, n)]
                linear = max(0.0, statistics.median(s[0] for s in rounds))
                per_key = max(0.0, statistics.median(s[1] for s in rounds))
                out[(L, n)] = 1000 * (linear + per_key * L)
        return out
