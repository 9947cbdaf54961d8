"""Python side of the CPU kernels (kernels/cpu.cpp and its headers): the extension, built once per machine, and thin
typed calls.

`kernel()` is None where the kernels cannot be used (no compiler, or TOKENSWIFT_KERNELS=off): the model then runs
PyTorch's operators, which compute the same functions but are not row-invariant.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from core.runtime.kernels.build import build

SOURCE = Path(__file__).with_name("cpu.cpp")

HEAD_SIZES = (16, 32, 64, 80, 96, 128, 256)  # the attention kernel's instances (attention.h: attend_into)

# A packed weight as the kernels take it: format code, tiles, fp16 scales, fp16 mins, fp32 bias (empty tensors
# where absent), output columns. core/runtime/weights.py makes them.
WeightArgs = tuple[int, Tensor, Tensor, Tensor, Tensor, int]


@functools.cache  # called for every layer of every step: the setting is read, the extension found, once
def kernel() -> Any | None:
    """The compiled extension (built on the first call; then loaded from the cache), or None."""
    if os.environ.get("TOKENSWIFT_KERNELS", "on") == "off":
        return None
    return build("cpu", SOURCE)


def linear(x: Tensor, weight: WeightArgs, bf16: bool = False) -> Tensor:
    """x [R, K] W^T (+ bias), float32; with `bf16` each output rounded to bf16 once, after the fp32 accumulation (a
    bf16 GEMM's output)."""
    return kernel().linear(x, *weight, bf16)


def linear_passes(x: Tensor, weight: WeightArgs, passes: int, out: Tensor | None = None) -> float:
    """Seconds per pass of `linear` (fp32 out, into `out` if given), `passes` passes in one call with every thread
    over its own part of the weight's tiles: the kernels' arithmetic without a call's own cost."""
    x = x.contiguous()
    out = x.new_empty(x.shape[0], weight[5]) if out is None else out
    return kernel().linear_passes(x, *weight, out, passes)


def rms_norm(x: Tensor, weight: Tensor, eps: float, bf16: bool = False) -> Tensor:
    """RMSNorm of each row of x [R, H] (float32); with `bf16` rounded as a bf16 model rounds it: the normalised row
    rounded to bf16, times the weight, rounded again."""
    return kernel().rms_norm(x, weight, eps, bf16)


def attend(q: Tensor, keys: Tensor, values: Tensor, n: int, past: int, visible: Tensor | None, window: int | None,
           scale: float, bf16_products: bool = True) -> Tensor:
    """Attention of q [H_kv, G * n, D] (row g * n + i: query head g of the KV head, token i of n) over keys in tiles
    [H_kv, S / 64, D, 64] (kv_cache.tile_keys) and values [H_kv, S, D], fp32 or bf16: `past` committed keys, then
    the n new ones in slots past .. past + n - 1, token i seeing new token j where visible[i, j] (None: causally).
    Each row reduces over its keys in logical order, so its result is the one a single-token step at its position
    gives. Over bf16 keys and values `bf16_products` takes the scaled query and the values' weights in bf16 too
    (attention.h: kPairs)."""
    empty = q.new_empty(0, dtype=torch.bool) if visible is None else visible.contiguous()
    return kernel().attend(q, keys, values, n, past, empty, window or 0, scale, bf16_products)
