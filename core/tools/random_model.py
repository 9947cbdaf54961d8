"""Random-weight models in real shapes, for checks that must download nothing (the long-context profile, the GPU
check): a Llama-family config by name, a Transformer with random weights built straight on the device in the
dtype it runs in, random drafting heads, and a tokenizer stub that turns ids into text.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from core.engine import Engine
from core.runtime.loading import LoadedModel
from core.runtime.model import ModelConfig, Transformer, rope_frequencies
from core.tokenswift.heads import DraftHeads
from core.tokenswift.options import TokenSwiftOptions

# The published checkpoints' shapes (their config.json), and a tiny one for CPU dry runs and CI.
SHAPES: dict[str, ModelConfig] = {
    "llama-3.1-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, n_layers=32, n_heads=32,
                                n_kv_heads=8, head_dim=128, max_position=131072, rope_theta=500000.0,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                                eos_token_ids=(128001,)),
    "qwen2.5-1.5b": ModelConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960, n_layers=28, n_heads=12,
                                n_kv_heads=2, head_dim=128, max_position=131072, rms_eps=1e-6, rope_theta=1000000.0,
                                qkv_bias=True, tie_embeddings=True, arch="qwen2", eos_token_ids=(151643,)),
    "tiny": ModelConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4, n_kv_heads=2,
                        head_dim=16, max_position=262144, rope_theta=500000.0, eos_token_ids=(2,)),
}


class IdTokenizer:
    """Enough of a tokenizer for the decode loop's streamed text: each id becomes a short word."""

    chat_template = None

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(f" t{i}" for i in ids)


@torch.no_grad()
def random_model(cfg: ModelConfig, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> Transformer:
    """A Transformer of `cfg` with random weights (std 0.02; norms 1), built on `device` in `dtype` directly: an
    8B model never exists in fp32 or on the host."""
    with torch.device("meta"):  # shapes only: the weights are made once, on the device, in their dtype
        model = Transformer(cfg)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.inv_freq = rope_frequencies(cfg)[0].to(device)  # fp32 whatever the weights' dtype
    return model.eval().requires_grad_(False)


@torch.no_grad()
def random_heads(model: Transformer, seed: int = 1, std: float = 0.02) -> DraftHeads:
    """Three random heads in the published checkpoints' structure (no root head, the whole vocabulary)."""
    heads = DraftHeads.initial(model)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for proj in heads.proj:
        proj.weight.normal_(0.0, std, generator=gen)
    return heads.eval().requires_grad_(False)


def random_engine(shape: str | ModelConfig, device: str = "cpu", dtype: torch.dtype | None = None,
                  heads: bool = True, options: TokenSwiftOptions | None = None, native: bool = True) -> Engine:
    """An engine on a random model of `shape` (a SHAPES name or a config): bf16 on CUDA, fp32 (our CPU kernels
    where they build, unless `native` is False) on a CPU."""
    cfg = SHAPES[shape] if isinstance(shape, str) else shape
    cuda = torch.device(device).type == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    model = random_model(cfg, device, dtype)
    if native and not cuda and dtype == torch.float32:
        model.to_native("f32")
    name = shape if isinstance(shape, str) else "random"
    loaded = LoadedModel(name, model, IdTokenizer(), cfg, f"random weights, {name} shapes")
    return Engine(loaded, random_heads(model) if heads else None, options)


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters (a tied lm_head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
