"""The memory roofline of decoding: the bytes a step must read (every weight matrix and the cached keys and values,
once), the rate this CPU reads memory, and the rate a generation achieved (gpt-fast's "bandwidth achieved").

A decoding step that reads those bytes at the machine's read rate is as fast as it can be without reading fewer;
achieved / read rate is its distance to that roofline. TokenSwift verifies several tokens per read, so its tokens
per second can pass what the roofline allows one-token steps, but its steps cannot read faster.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Iterable

import torch

from core.generation.decoding import Step
from core.runtime.model import Transformer
from core.runtime.weights import NativeLinear


def weight_bytes(model: Transformer) -> int:
    """Bytes of the weight matrices a one-token forward reads: the layers' and the lm_head (the embedding lookup
    reads one row), in their stored format."""
    total = 0
    for module in [*model.layers.modules(), model.lm_head]:
        if isinstance(module, NativeLinear):
            total += module.packed.nbytes
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def cache_bytes(model: Transformer, context: int) -> int:
    """Bytes of the keys and values of `context` tokens in the model's KV cache."""
    cfg = model.cfg
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * context * model.cache_dtype.itemsize


def step_bytes(model: Transformer, context: int) -> int:
    """Bytes a one-token forward reads at least: every weight matrix and the keys and values of `context` tokens."""
    return weight_bytes(model) + cache_bytes(model, context)


class ReadRate:
    """Bytes per second this CPU reads from memory with torch's threads: a sum over a buffer far beyond any cache,
    sampled where the caller wants the same contention as the steps it bounds (between timed forwards)."""

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


def read_rate_now(mib: int = 128, samples: int = 5) -> float:
    """This CPU's read rate now (bytes/s): the median of `samples` sums over a fresh `mib` MiB buffer (four times a
    large L3), freed before it returns."""
    rate = ReadRate(mib)
    for _ in range(samples):
        rate.sample()
    return rate.median()


def step_reads(model: Transformer, prompt_tokens: int, steps: Iterable[Step]) -> list[int]:
    """Per step, the bytes its forward had to read at least: step_bytes over the sequence written before the step
    (0 for a step with no forward, such as vanilla decoding's last, drawn from the forward before it)."""
    weights = weight_bytes(model)  # (a walk over every module: once, not per step)
    return [weights + cache_bytes(model, prompt_tokens + s.n_tokens - len(s.token_ids)) if s.forward_s > 0 else 0
            for s in steps]
