"""Weight formats of the CPU kernels: fp32, bf16, and 8- and 4-bit blocks run as they are (q8_0, q4_1: GGML's
formats).

A weight [N, K] is packed into tiles of 16 output columns (kernels/linear.h describes the layouts), from a float
matrix (`pack`: rounding it to bf16, or quantizing it for q8_0 / q4_1) or from a GGUF file's own blocks
(`from_gguf_blocks`, which keeps the file's numbers: a GGUF model runs exactly the weights it ships). `NativeLinear`
is the module a layer holds; its forward is the kernel's, so every row is computed alike whatever rows come with it.

Quantizing fp32 weights follows GGML's reference quantizers: q8_0 blocks of 32 with d = max|w| / 127 and
q = round(w / d); q4_1 blocks of 32 with m = min, d = (max - min) / 15 and q = round((w - m) / d) in 0..15.
Dequantized, a q8_0 weight is d * q and a q4_1 weight d * q + m, in fp32, as GGUF readers compute them. A bf16
weight stays bf16 in memory (half of fp32's bytes): the kernel widens it to fp32 as it reads it, which is exact, so
it computes what an fp32 tile of the widened weight computes.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from core.runtime import large_pages
from core.runtime.kernels import cpu

COLS = 16  # output columns per tile
BLOCK = 32  # weights per quantization block
FORMATS = ("f32", "bf16", "q8_0", "q4_1")
CODES = {"f32": 0, "q8_0": 1, "q4_1": 2, "bf16": 3}
DENSE = ("f32", "bf16")  # formats whose tiles hold the weights themselves: [T, K, 16] values


@dataclass
class PackedWeight:
    """A weight [n, k] packed for the kernel: tiles (`data`: fp32, bf16, int8 or uint8), fp16 scales `d` and mins
    `m` where the format has them, and an fp32 bias."""

    fmt: str
    n: int
    k: int
    data: Tensor
    d: Tensor | None = None
    m: Tensor | None = None
    bias: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.d, self.m) if t is not None)

    def kernel_args(self) -> cpu.WeightArgs:
        """The weight as the kernels take it."""
        empty = self.data.new_empty(0, dtype=torch.float16)
        return (CODES[self.fmt], self.data, self.d if self.d is not None else empty,
                self.m if self.m is not None else empty,
                self.bias if self.bias is not None else self.data.new_empty(0, dtype=torch.float32), self.n)

    def dequantize(self) -> Tensor:
        """The fp32 weight [n, k] these tiles compute with."""
        t = self.data.shape[0]
        if self.fmt in DENSE:
            return self.matrix().float()
        b = self.k // BLOCK
        d = self.d.float().permute(0, 2, 1).reshape(t * COLS, b, 1)
        if self.fmt == "q8_0":
            q = self.data.view(t, b, 8, COLS, 4).permute(0, 3, 1, 2, 4).reshape(t * COLS, b, BLOCK).float()
            return (d * q).reshape(-1, self.k)[: self.n]
        packed = self.data.view(t, b, 4, COLS, 4)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=2).permute(0, 3, 1, 2, 4).reshape(t * COLS, b, BLOCK).float()
        m = self.m.float().permute(0, 2, 1).reshape(t * COLS, b, 1)
        return (d * q + m).reshape(-1, self.k)[: self.n]

    def dequantize_rows(self, ids: Tensor) -> Tensor:
        """Rows `ids` of the fp32 weight (an embedding lookup in a tied lm_head's table): one call of the kernels
        where they are built (a lookup every step and every drafted level), else `unpack_rows`."""
        native = cpu.kernel() if self.data.device.type == "cpu" else None
        if native is None:
            return self.unpack_rows(ids)
        code, data, d, m, _, n = self.kernel_args()
        return native.embed_rows(ids.reshape(-1).long(), code, data, d, m, n, self.k).view(*ids.shape, self.k)

    def unpack_rows(self, ids: Tensor) -> Tensor:
        """`dequantize_rows` through PyTorch's operators (the same numbers)."""
        t, c = ids // COLS, ids % COLS
        if self.fmt in DENSE:
            return self.data[t, :, c].float()
        b = self.k // BLOCK
        d = self.d[t, :, c].float()[..., None]  # [len, b, 1]
        if self.fmt == "q8_0":
            q = self.data.view(-1, b, 8, COLS, 4)[t, :, :, c, :].reshape(len(ids), b, BLOCK).float()
            return (d * q).reshape(len(ids), self.k)
        packed = self.data.view(-1, b, 4, COLS, 4)[t, :, :, c, :]
        q = torch.cat([packed & 0x0F, packed >> 4], dim=2).reshape(len(ids), b, BLOCK).float()
        return (d * q + self.m[t, :, c].float()[..., None]).reshape(len(ids), self.k)

    def rows(self, ids: Tensor) -> PackedWeight:
        """The weight of output rows `ids` only (same numbers, repacked): e.g. the lm_head rows drafting scores."""
        if self.fmt in DENSE:
            return pack(self.matrix()[ids], self.fmt)
        return from_blocks(self.fmt, *self.blocks(ids))

    def matrix(self) -> Tensor:
        """A dense format's weight [n, k] in its own dtype (fp32 or bf16): a view of the tiles, nothing widened."""
        return self.data.transpose(1, 2).reshape(-1, self.k)[: self.n]

    def blocks(self, ids: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Quantized values [n, k], scales [n, k/32] (and mins) in row order: what `from_blocks` packs. With `ids`,
        those rows only, and nothing else unpacked (a vocabulary's rows of a large lm_head)."""
        ids = torch.arange(self.n) if ids is None else ids
        t, b, tile, col = self.data.shape[0], self.k // BLOCK, ids // COLS, ids % COLS
        d = self.d[tile, :, col]  # [len, b]
        if self.fmt == "q8_0":
            return self.data.view(t, b, 8, COLS, 4)[tile, :, :, col, :].reshape(len(ids), self.k), d, None
        packed = self.data.view(t, b, 4, COLS, 4)[tile, :, :, col, :]  # [len, b, 4, 4]: low and high nibbles
        q = torch.cat([packed & 0x0F, packed >> 4], dim=2).reshape(len(ids), self.k)
        return q, d, self.m[tile, :, col]


def _pad_rows(x: Tensor) -> Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, -x.shape[0] % COLS))


def from_blocks(fmt: str, q: Tensor, d: Tensor, m: Tensor | None = None, bias: Tensor | None = None) -> PackedWeight:
    """Tiles from quantized values q [n, k] (int8 for q8_0, 0..15 for q4_1), fp16 scales d [n, k/32] and, for
    q4_1, fp16 mins m [n, k/32]."""
    n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"quantized weights need a row length that is a multiple of {BLOCK}, got {k}")
    b = k // BLOCK
    scales = large_pages.contiguous(_pad_rows(d.to(torch.float16)).view(-1, COLS, b).permute(0, 2, 1))
    if fmt == "q8_0":
        tiles = large_pages.contiguous(_pad_rows(q.to(torch.int8)).view(-1, COLS, b, 8, 4).permute(0, 2, 3, 1, 4))
        return PackedWeight("q8_0", n, k, tiles, scales, None, bias)
    if fmt != "q4_1" or m is None:
        raise ValueError(f"unknown quantized format {fmt!r} (or q4_1 without mins)")
    nib = _pad_rows(q.to(torch.uint8)).view(-1, COLS, b, 8, 4).permute(0, 2, 3, 1, 4)
    tiles = large_pages.contiguous(nib[:, :, :4] | (nib[:, :, 4:] << 4))
    mins = large_pages.contiguous(_pad_rows(m.to(torch.float16)).view(-1, COLS, b).permute(0, 2, 1))
    return PackedWeight("q4_1", n, k, tiles, scales, mins, bias)


QUANTIZE_ROWS = 256  # rows quantized at a time: the fp32 temporaries stay small whatever the weight's size


def _by_rows(quantize: Callable[[Tensor], tuple[Tensor, ...]], w: Tensor) -> tuple[Tensor, ...]:
    """`quantize` of w, QUANTIZE_ROWS rows at a time, stacked: a block never spans two rows, so every number is the
    one a single call would give."""
    parts = [quantize(w[i:i + QUANTIZE_ROWS]) for i in range(0, w.shape[0], QUANTIZE_ROWS)]
    return tuple(torch.cat(found) for found in zip(*parts))


def quantize_q8_0(w: Tensor) -> tuple[Tensor, Tensor]:
    """GGML's q8_0 of an fp32 [n, k] weight: int8 values and fp16 scales per block of 32."""
    q, d = _by_rows(_quantize_q8_0, w)
    return q, d


def _quantize_q8_0(w: Tensor) -> tuple[Tensor, Tensor]:
    blocks = w.float().reshape(w.shape[0], -1, BLOCK)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(w.shape), d.to(torch.float16)


def quantize_q4_1(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """GGML's q4_1 of an fp32 [n, k] weight: values 0..15, fp16 scales and mins per block of 32."""
    q, d, m = _by_rows(_quantize_q4_1, w)
    return q, d, m


def _quantize_q4_1(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    blocks = w.float().reshape(w.shape[0], -1, BLOCK)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.floor((blocks - lo[..., None]) * inv[..., None] + 0.5).clamp(0, 15).to(torch.uint8)
    return q.reshape(w.shape), d.to(torch.float16), lo.to(torch.float16)


def dense_tiles(w: Tensor) -> Tensor:
    """[T, K, 16] tiles of a weight [n, k] in its own dtype, rows padded with zeros to a multiple of 16."""
    return large_pages.contiguous(_pad_rows(w).view(-1, COLS, w.shape[1]).transpose(1, 2))


def pack(w: Tensor, fmt: str, bias: Tensor | None = None) -> PackedWeight:
    """Pack a float weight [n, k]: in fp32, rounded to bf16 (a bf16 weight packs as it is: no fp32 copy of it is
    made), or quantized to q8_0 / q4_1."""
    w = w.detach()
    bias = None if bias is None else bias.detach().float().contiguous()
    if fmt == "bf16":
        return PackedWeight("bf16", w.shape[0], w.shape[1], dense_tiles(w.to(torch.bfloat16)), bias=bias)
    w = w.float()
    if fmt == "f32":
        return PackedWeight("f32", w.shape[0], w.shape[1], dense_tiles(w), bias=bias)
    if fmt == "q8_0":
        return from_blocks("q8_0", *quantize_q8_0(w), bias=bias)
    if fmt == "q4_1":
        return from_blocks("q4_1", *quantize_q4_1(w), bias=bias)
    raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(FORMATS)}")


# GGML's block layouts, as stored in GGUF files: (bytes per block of 32, name)
GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20}


def from_gguf_blocks(kind: str, raw: np.ndarray, n: int, k: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """Values [n, k], fp16 scales [n, k/32] (and q4_1's fp16 mins) of a GGUF tensor's raw blocks (uint8 rows)."""
    blocks = np.ascontiguousarray(raw).reshape(n * (k // BLOCK), GGUF_BLOCK_BYTES[kind])
    d = torch.from_numpy(blocks[:, 0:2].copy().view(np.float16)).reshape(n, k // BLOCK)
    if kind == "Q8_0":
        q = torch.from_numpy(blocks[:, 2:].copy().view(np.int8)).reshape(n, k)
        return q, d, None
    m = torch.from_numpy(blocks[:, 2:4].copy().view(np.float16)).reshape(n, k // BLOCK)
    qs = torch.from_numpy(blocks[:, 4:].copy())  # byte j: element j (low nibble) and j + 16 (high nibble)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).reshape(n, k)
    return q, d, m


class NativeLinear(nn.Module):
    """A frozen linear layer on the CPU kernel, over a packed weight in any format. `bf16_out`: its outputs rounded to
    bf16 (a bf16 model's layer: Transformer.to_native), else fp32."""

    def __init__(self, weight: PackedWeight, bf16_out: bool = False):
        super().__init__()
        self.packed = weight
        self.args = weight.kernel_args()
        self.in_features, self.out_features = weight.k, weight.n
        self.bf16_out = bf16_out

    @classmethod
    def of(cls, layer: nn.Linear, fmt: str, bf16_out: bool = False) -> NativeLinear:
        return cls(pack(layer.weight, fmt, layer.bias), bf16_out)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        out = cpu.linear(x.reshape(-1, shape[-1]).float(), self.args, self.bf16_out)
        return out.view(*shape[:-1], self.packed.n)

    @staticmethod
    def listed(layers: Iterable[NativeLinear]) -> tuple[list[Tensor], list[int]]:
        """Layers as the kernels' multi-layer calls take them (kernels/stack.h and root_head.h): four tensors each
        (packed, scales, mins, bias), and (format, outputs) each."""
        lin: list[Tensor] = []
        meta: list[int] = []
        for layer in layers:
            code, data, d, m, bias, n_out = layer.args
            lin += [data, d, m, bias]
            meta += [code, n_out]
        return lin, meta

    def rows(self, ids: Tensor) -> NativeLinear:
        """The layer of output rows `ids` only (e.g. the lm_head rows a drafting head scores), rounded alike."""
        return NativeLinear(self.packed.rows(ids), self.bf16_out)
