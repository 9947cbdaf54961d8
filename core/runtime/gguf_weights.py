"""A GGUF file's weights as the CPU kernels' packed weights, blocks as the file ships them.

Q8_0 and Q4_1 tensors keep their own numbers (GGML's block layouts read byte for byte), F32 and F16 tensors become
fp32 tiles; other GGML types are refused with a message (`--weights fp32` runs them dequantized). The query and key
projections come back from llama.cpp's rotary row order to Hugging Face's by permuting whole rows, which leaves
every block intact (the same permutation transformers applies when it dequantizes the file).

Memory: each tensor is read into memory of its own and packed before the next is read (core/runtime/gguf_file.py:
no mapping of the whole file, no metadata objects), the largest matrix (the embedding table) first, while little
else is resident, and the decoder is built as a skeleton (core/runtime/skeleton.py) whose weights are then set.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from core.runtime import large_pages
from core.runtime.gguf_file import read_table, read_tensor
from core.runtime.model import ModelConfig, NativeEmbedding, Transformer, rope_frequencies
from core.runtime.skeleton import skeleton
from core.runtime.weights import NativeLinear, PackedWeight, from_blocks, from_gguf_blocks, pack

NATIVE_TYPES = ("F32", "F16", "Q8_0", "Q4_1")


class GGUFTensors:
    """The named tensors of one GGUF file, read on demand."""

    def __init__(self, path: Path):
        self.path = path
        self.tensors = read_table(path)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def kind(self, name: str) -> str:
        return self.tensors[name].kind

    def data(self, name: str) -> np.ndarray:
        return read_tensor(self.path, self.tensors[name])

    def vector(self, name: str) -> Tensor:
        return torch.from_numpy(np.asarray(self.data(name), dtype=np.float32)).reshape(-1)

    def matrix(self, name: str, row_order: np.ndarray | None = None) -> tuple[str, Tensor, Tensor | None,
                                                                                Tensor | None]:
        """(format, values or fp32 weight [n, k], scales, mins) of a 2-D tensor, rows in `row_order` if given."""
        t = self.tensors[name]
        kind = t.kind
        if kind not in NATIVE_TYPES:
            raise ValueError(f"{self.path.name}: tensor {name} is {kind}; the CPU kernels run "
                             f"{', '.join(NATIVE_TYPES)} (run it dequantized with --weights fp32)")
        k, n = (int(x) for x in t.shape)  # GGML lists the row length first
        if kind in ("F32", "F16"):
            w = torch.from_numpy(np.asarray(self.data(name), dtype=np.float32)).reshape(n, k)
            return "f32", (w if row_order is None else w[row_order]), None, None
        q, d, m = from_gguf_blocks(kind, self.data(name), n, k)
        if row_order is not None:
            q, d, m = q[row_order], d[row_order], None if m is None else m[row_order]
        return kind.lower(), q, d, m


def rotary_rows(n_rows: int, n_head: int) -> np.ndarray:
    """The row order that undoes llama.cpp's rotary permutation of a query or key projection with `n_head` heads."""
    return np.arange(n_rows).reshape(n_head, n_rows // n_head // 2, 2).swapaxes(2, 1).reshape(n_rows)


def fused(parts: list[tuple[str, Tensor, Tensor | None, Tensor | None]], bias: Tensor | None) -> PackedWeight:
    """One packed weight from row blocks stacked in order (q, k, v; gate, up), which must share a format."""
    formats = {fmt for fmt, *_ in parts}
    if len(formats) != 1:
        raise ValueError(f"fused projections mix weight formats {sorted(formats)}; run with --weights fp32")
    fmt = formats.pop()
    if len(parts) == 1:  # nothing to stack: no copy of the weight
        _, q, d, m = parts[0]
        return pack(q, "f32", bias) if fmt == "f32" else from_blocks(fmt, q, d, m, bias)
    if fmt == "f32":
        return pack(torch.cat([w for _, w, _, _ in parts]), "f32", bias)
    q = torch.cat([p[1] for p in parts])
    d = torch.cat([p[2] for p in parts])
    m = torch.cat([p[3] for p in parts]) if fmt == "q4_1" else None
    return from_blocks(fmt, q, d, m, bias)


def build_native_model(cfg: ModelConfig, path: Path) -> Transformer:
    """The decoder with every matrix in its GGUF format, on the CPU, running natively."""
    f = GGUFTensors(path)
    with skeleton():
        model = Transformer(cfg)

    def norm(module: nn.Module, name: str) -> None:
        module.weight = nn.Parameter(f.vector(name), requires_grad=False)

    def bias(name: str) -> Tensor | None:
        return f.vector(name) if f.has(name) else None

    def linear(*names: str, rows: list[np.ndarray | None] | None = None) -> NativeLinear:
        parts = [f.matrix(f"{name}.weight", (rows or [None] * len(names))[i]) for i, name in enumerate(names)]
        biases = [bias(f"{name}.bias") for name in names]
        layer = NativeLinear(fused(parts, torch.cat(biases) if all(b is not None for b in biases) else None))
        del parts
        large_pages.release_freed()
        return layer

    # the largest matrices first, while nothing else is resident: their transient copies then set no peak
    model.lm_head = linear("output" if f.has("output.weight") else "token_embd")
    table = model.lm_head.packed if not f.has("output.weight") else linear("token_embd").packed
    model.embed = NativeEmbedding(table)
    q_rows, k_rows = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    for i, block in enumerate(model.layers):
        p = f"blk.{i}."
        norm(block.attn_norm, p + "attn_norm.weight")
        norm(block.mlp_norm, p + "ffn_norm.weight")
        block.wqkv = linear(p + "attn_q", p + "attn_k", p + "attn_v",
                            rows=[rotary_rows(q_rows, cfg.n_heads), rotary_rows(k_rows, cfg.n_kv_heads), None]
                            if cfg.arch == "llama" else None)
        block.wo = linear(p + "attn_output")
        block.w_gate_up = linear(p + "ffn_gate", p + "ffn_up")
        block.w_down = linear(p + "ffn_down")
    norm(model.norm, "output_norm.weight")
    model.inv_freq = rope_frequencies(cfg)[0]
    model.native = True
    return model.eval().requires_grad_(False)
