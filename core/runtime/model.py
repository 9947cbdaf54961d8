"""A compact Llama-family decoder (Llama 2/3/3.1, Qwen2/2.5, Mistral) over our own KV cache.

One forward takes any number of new tokens with explicit positions and an explicit attention mask over the
new-token block, so the same code runs a prefill, a one-token step, or a whole token tree. It returns the
logits of the rows asked for and the pre-final-norm hidden state of every new token (the multi-token heads read
it). Weights follow Hugging Face names on load, fused into one QKV and one gate/up matrix per layer so a step
does fewer, larger matrix products.

Two ways to run it: PyTorch's operators (any device and dtype; CUDA, compiled graphs), or, on a CPU, native: packed
weights in fp32, bf16, q8_0 or q4_1 (core/runtime/weights.py), fp32 activations (bf16 ones for bf16 weights: a bf16
model's numerics, as on CUDA), and the whole decoder stack in one call of our kernels (core/runtime/kernels/stack.h),
where every row is computed alike whatever rows share the forward and wherever its keys sit in the cache.
`to_native` switches a model over.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.runtime import large_pages
from core.runtime.kernels import cpu
from core.runtime.kv_cache import NATIVE_DTYPES, KVCache, PartialKVCache, key_slots
from core.runtime.weights import NativeLinear, PackedWeight, pack

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_position: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    sliding_window: int | None = None
    arch: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, hf: Any) -> "ModelConfig":
        """Read a transformers config (v4 `rope_scaling` or v5 `rope_parameters` style)."""
        arch = getattr(hf, "model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}: this runtime handles {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        n_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // n_heads
        rope = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        attention_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            n_layers=hf.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(hf, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim,
            max_position=hf.max_position_embeddings,
            rms_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            # Qwen2 always has q/k/v biases and no o bias; Llama's `attention_bias` covers all four.
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch != "qwen2" and attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            sliding_window=getattr(hf, "sliding_window", None) if arch == "mistral" else None,
            arch=arch,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )


def rope_frequencies(cfg: ModelConfig) -> tuple[Tensor, float]:
    """Inverse frequencies of the rotary embedding and the attention scale that some scalings add."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor") or 1.0)
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen = old_ctx / scaling["low_freq_factor"]
        high_wavelen = old_ctx / scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - scaling["low_freq_factor"]) / (
            scaling["high_freq_factor"] - scaling["low_freq_factor"]
        )
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled), 1.0
    if kind == "yarn":
        # YaRN: interpolate low frequencies, extrapolate high ones, linear ramp between; sharpen attention.
        old_ctx = scaling.get("original_max_position_embeddings") or cfg.max_position / factor
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp
        freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
        attn_factor = scaling.get("attention_factor")
        if attn_factor is None:
            mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")

            def get_mscale(scale: float, m: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

            attn_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all \
                else get_mscale(factor)
        return freq, float(attn_factor)
    raise ValueError(f"unsupported rope scaling {kind!r} (supported: linear, llama3, yarn)")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 as Hugging Face does, so bf16 runs match its rounding.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # Rotary embedding in the "rotate half" layout that Hugging Face checkpoints use.
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@dataclass
class Visibility:
    """What a forward's new tokens see: the `past` committed keys, then the new block's keys as `block_mask` allows
    (None: causally), within a sliding `window` (None: everything). `bias` says the same as an additive mask
    [group * n, keys] for PyTorch's attention (Transformer.attention_bias; None there: everything visible)."""

    past: int
    block_mask: Tensor | None
    window: int | None
    bias: Tensor | None = None


def attention(q: Tensor, keys: Tensor, values: Tensor, seen: Visibility) -> Tensor:
    """Attention of q [heads, n, d] over keys/values [kv_heads, L, d].

    The query heads that share a KV head are folded into its rows ([kv_heads, group * n, d]), so grouped-query
    attention needs no copies of the keys (PyTorch's `enable_gqa` path falls back to a slow kernel on CPU). On a
    float32 CPU with keys in tiles (kv_cache.tiled) our kernel runs it, each row over its keys in logical order;
    elsewhere two matrix products or PyTorch's fused kernel.
    """
    h, n, d = q.shape
    kv = keys.shape[0]
    qg = q.reshape(kv, (h // kv) * n, d)
    if native_attention(q, keys):
        return cpu.attend(qg, keys, values, n, seen.past, seen.block_mask, seen.window, d**-0.5).view(h, n, d)
    scale = d**-0.5
    keys = key_slots(keys, 0, values.shape[1])  # (from tiles, where the kernel does not take these queries)
    if keys.dtype == torch.bfloat16 and q.dtype == torch.float32:  # a bf16 cache: bf16 queries, as the kernel takes
        qg, scale = (qg * scale).to(torch.bfloat16).float(), 1.0
        keys, values = keys.float(), values.float()
    if q.device.type == "cpu":
        if seen.bias is None:
            scores = torch.matmul(qg, keys.transpose(1, 2)).mul_(scale)
        else:
            scores = torch.baddbmm(seen.bias, qg, keys.transpose(1, 2), alpha=scale)
        out = torch.matmul(scores.softmax(-1), values)
    else:
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=seen.bias)
    return out.view(h, n, d)


def native_attention(q: Tensor, keys: Tensor) -> bool:
    """Whether our CPU kernel runs this attention: float32 queries on a CPU, fp32 or bf16 keys in tiles, a head size
    it has."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and keys.dtype in NATIVE_DTYPES
            and keys.dim() == 4 and q.shape[-1] in cpu.HEAD_SIZES and not torch.compiler.is_compiling()
            and cpu.kernel() is not None)


class NativeEmbedding(nn.Module):
    """Token embeddings read from a packed weight's rows (the tied lm_head's): one copy of the table, in its own
    format; a q8_0 row dequantizes exactly as a GGUF reader does it."""

    def __init__(self, weight: PackedWeight):
        super().__init__()
        self.table = weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.table.dequantize_rows(ids)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.wqkv = nn.Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.w_gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | PartialKVCache, layer: int,
                seen: Visibility) -> Tensor:
        cfg = self.cfg
        n = x.shape[0]
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        q, k, v = self.wqkv(self.attn_norm(x)).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = rotate(q.view(n, cfg.n_heads, cfg.head_dim).transpose(0, 1), cos, sin)
        k = rotate(k.view(n, cfg.n_kv_heads, cfg.head_dim).transpose(0, 1), cos, sin)
        v = v.view(n, cfg.n_kv_heads, cfg.head_dim).transpose(0, 1)
        keys, values = cache.write(layer, q, k, v)
        out = attention(q, keys, values, seen)
        x = x + self.wo(out.transpose(0, 1).reshape(n, q_dim))
        gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # A plain attribute, not a buffer: it must stay fp32 when the weights move to bf16.
        self.inv_freq, self.rope_scale = rope_frequencies(cfg)
        self._rope_table: tuple[Tensor, Tensor] | None = None
        self.native = False  # set by to_native
        self.bf16_activations = False  # a native model rounding its activations to bf16 (to_native)
        self.kv_dtype: torch.dtype | None = None  # the KV cache's dtype if set (else cache_dtype's default)
        self._native_args: tuple | None = None  # the stack's weights bound in the kernels (bind_stack)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def to_native(self, fmt: str = "f32", activations: str | None = None) -> bool:
        """Pack every weight matrix in `fmt` (f32, bf16, q8_0, q4_1) for our CPU kernels and run the decoder
        natively from then on; False (nothing done) where they do not apply (not fp32 or bf16 weights on a CPU, a
        head size without an attention kernel, no compiler). Matrices that are native already keep their format (a
        GGUF's own blocks).

        `activations`: "fp32" (the default but for bf16 weights) computes in fp32 whatever the weights' format;
        "bf16" (bf16 weights only; their default) rounds to bf16 where a bf16 model stores a tensor (kernels/numerics.h:
        round_bf16 lists where), so the kernels compute what the PyTorch path computes in bf16 on CUDA, every row
        alike. Either way the norms and rotary table are fp32 tensors (exact: a bf16 value widens to the same
        number; in bf16 mode the norms' weights, biases, an untied embedding table and the rotary table are rounded
        to bf16 first); bf16 matrices stay bf16. The KV cache is bf16 (`kv_dtype`; float32 may be set instead):
        keys and values rounded once as they are written, which bf16 mode's already are. The draft pass over a
        partial cache (separate mode) runs the layers one by one: its linear layers round, its glue is fp32."""
        bf16 = fmt == "bf16" if activations is None else activations == "bf16"
        if activations not in (None, "fp32", "bf16") or (bf16 and fmt != "bf16"):
            raise ValueError(f"activations must be fp32, or bf16 with bf16 weights; got {activations!r} for {fmt}")
        if (self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16)
                or self.cfg.head_dim not in cpu.HEAD_SIZES or cpu.kernel() is None):
            return False
        if bf16:
            self.bfloat16()  # what is not packed yet (norms, biases, an untied embedding table) holds bf16 values
        for block in self.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                if isinstance(getattr(block, name), nn.Linear):
                    setattr(block, name, NativeLinear.of(getattr(block, name), fmt, bf16))
                    large_pages.release_freed()  # the float matrix's pages, before the next is packed
        if isinstance(self.lm_head, nn.Linear):
            self.lm_head = NativeLinear.of(self.lm_head, fmt, bf16)
            if self.cfg.tie_embeddings:  # one table: the embedding reads the lm_head's rows
                self.embed = NativeEmbedding(self.lm_head.packed)
        if isinstance(self.embed, nn.Embedding) and self.embed.weight.dtype == torch.bfloat16:
            # an untied bf16 table stays bf16 (not widened in memory); its rows are looked up as fp32
            self.embed = NativeEmbedding(pack(self.embed.weight, "bf16"))
        self.float()  # what is left (the norms) computes in fp32
        self._rope_table = None  # rebuilt in fp32 (of bf16 values in bf16 mode) on the next forward
        self.native, self.bf16_activations, self._native_args = True, bf16, None
        return True

    @property
    def cache_dtype(self) -> torch.dtype:
        """kv_dtype where set; else bf16 for a model on our kernels (the native GGUF build included), else the
        weights' dtype."""
        return self.kv_dtype or (torch.bfloat16 if self.native else self.dtype)

    def new_cache(self, max_len: int) -> KVCache:
        cfg = self.cfg
        return KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, max_len, self.cache_dtype, self.device)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin rows [n, head_dim] of the rotary embedding at these positions, from a table computed once
        (grown as positions grow): a position's row is the same floats in every forward."""
        cos, sin = self.rope_table(int(positions.max()) + 1)
        return cos[positions], sin[positions]

    def rope_table(self, rows: int) -> tuple[Tensor, Tensor]:
        """The cos and sin tables [>= rows, head_dim], grown to cover `rows` positions (exactly, at first: a native
        forward asks for its cache's length, and rows nobody reads would stay in the process's peak memory)."""
        have = 0 if self._rope_table is None else self._rope_table[0].shape[0]
        if have < rows:
            self._rope_table = self._rope_rows(have, max(rows, 2 * have))
        return self._rope_table

    def _rope_rows(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        """The table up to `end`: rows from `start` on computed, the ones before kept as they are."""
        # Angles in fp32 (large positions lose precision in bf16), then cast like Hugging Face does.
        angles = torch.arange(start, end, device=self.device).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        rounded = torch.bfloat16 if self.bf16_activations else self.dtype  # a bf16 model's table, held in fp32
        cos = (emb.cos() * self.rope_scale).to(rounded).to(self.dtype)
        sin = (emb.sin() * self.rope_scale).to(rounded).to(self.dtype)
        if self._rope_table is not None:
            cos, sin = torch.cat([self._rope_table[0], cos]), torch.cat([self._rope_table[1], sin])
        return cos, sin

    def attention_bias(self, cache: KVCache | PartialKVCache, n: int, block_mask: Tensor | None,
                       positions: Tensor) -> Tensor | None:
        """The cache's attention mask for n new tokens in additive form (0 visible, -inf hidden), each row repeated
        for the query heads that share a KV head: [group * n, L], or None when all is visible (PyTorch's attention).
        Built once per forward, not once per layer: a masked score matrix then costs one fused multiply-add."""
        mask = cache.attention_mask(n, block_mask, positions, self.cfg.sliding_window)
        if mask is None:
            return None
        bias = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return bias.repeat(self.cfg.n_heads // self.cfg.n_kv_heads, 1)

    def hidden(self, tokens: Tensor, positions: Tensor, cache: KVCache | PartialKVCache,
               block_mask: Tensor | None = None) -> Tensor:
        """Run the decoder on new tokens; returns pre-final-norm hidden states [n, hidden].

        `block_mask[i, j]` (bool, n x n) says whether new token i may attend to new token j; every cached token is
        visible to every new token. None means causal (a prefill or a one-token step). The new keys and values are
        appended to `cache`; the caller commits, compacts or rolls them back.
        """
        n = tokens.shape[0]
        cache.begin(n)
        if self.native and isinstance(cache, KVCache):
            return self._native_stack(tokens, positions, cache, block_mask)[0]
        cos, sin = self.rope(positions)
        x = self.embed(tokens)
        seen = Visibility(cache.visible_past(), block_mask, self.cfg.sliding_window)
        if not native_attention(x.new_empty(1, 1, self.cfg.head_dim), cache.k[0]):  # PyTorch's attention: a mask
            seen.bias = self.attention_bias(cache, n, block_mask, positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, seen)
        return x

    def bind_stack(self, with_table: bool = True) -> None:
        """Bind the stack's weights in our CPU kernels once (kernels/stack.h: Stack), with the packed embedding table
        (unless `with_table` is False: the embedding module looks the tokens up) and the lm_head where they are
        packed: a forward then passes only its inputs, not the weights' few hundred tensors."""
        cfg = self.cfg
        norms = [w.contiguous() for block in self.layers for w in (block.attn_norm.weight, block.mlp_norm.weight)]
        lin, meta = NativeLinear.listed(
            layer for block in self.layers for layer in (block.wqkv, block.wo, block.w_gate_up, block.w_down))
        table: list[Tensor] = []
        table_meta: list[int] = []
        if with_table and isinstance(self.embed, NativeEmbedding):
            code, data, d, m, _, n = self.embed.table.kernel_args()
            table, table_meta = [data, d, m], [code, n]
        native_head = isinstance(self.lm_head, NativeLinear)
        head, head_meta = NativeLinear.listed([self.lm_head]) if native_head else ([], [])
        stack = cpu.kernel().Stack(norms, lin, meta, table, table_meta, head, head_meta, self.norm.weight,
                                   cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rms_eps, cfg.head_dim**-0.5,
                                   self.bf16_activations, native_head and self.lm_head.bf16_out)
        none = tuple(torch.empty(0, dtype=t) for t in (torch.float32, torch.long, torch.bool))
        self._native_args = (stack, bool(table), none)

    def _native_stack(self, tokens: Tensor, positions: Tensor, cache: KVCache, block_mask: Tensor | None,
                      logits_from: int | None = None) -> list[Tensor]:
        """The decoder stack in one call of our CPU kernels (kernels/stack.h: Stack.forward, its weights bound once:
        bind_stack), keys and values written into the cache at its committed length; in bf16 mode rounding as a bf16
        model does. The kernel looks up the tokens' embeddings in a packed table and their rotary rows by position
        itself, and with `logits_from` it also takes the final norm and the lm_head of the rows from there on: a
        forward calls no operator around it. Returns [hidden states] or [hidden states, logits]."""
        if self._native_args is None:
            self.bind_stack()
        stack, with_table, (no_x, no_tokens, no_mask) = self._native_args
        if with_table:
            x, ids = no_x, tokens
        else:
            x, ids = self.embed(tokens).float().contiguous(), no_tokens
        visible = block_mask if block_mask is not None else no_mask  # (the kernel takes any layout)
        cos, sin = self.rope_table(cache.max_len)  # a row for every position the cache holds
        return stack.forward(x, ids, cos, sin, positions, cache.k, cache.v, cache.length, visible,
                             self.cfg.sliding_window or 0, -1 if logits_from is None else logits_from)

    def logits(self, hidden: Tensor) -> Tensor:
        """Next-token logits (fp32) from pre-final-norm hidden states. A native model takes the final norm on the
        kernels, as the stack takes its own (in bf16 mode rounded as there, and the lm_head rounds: bf16 logits,
        widened)."""
        if self.native:
            rows = hidden.reshape(-1, self.cfg.hidden_size).float()
            normed = cpu.rms_norm(rows, self.norm.weight, self.cfg.rms_eps, self.bf16_activations)
            return self.lm_head(normed.view(hidden.shape)).float()
        return self.lm_head(self.norm(hidden)).float()

    def forward(
        self, tokens: Tensor, positions: Tensor, cache: KVCache | PartialKVCache, block_mask: Tensor | None = None,
        logits_rows: Tensor | slice | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Hidden states of all new tokens and the logits of `logits_rows` (default: all rows)."""
        n = tokens.shape[0]
        last_only = isinstance(logits_rows, slice) and logits_rows == slice(-1, None)  # a prefill's
        first = 0 if logits_rows is None else (n - 1 if last_only else None)
        if self.native and isinstance(cache, KVCache) and first is not None and isinstance(self.lm_head, NativeLinear):
            cache.begin(n)
            h, logits = self._native_stack(tokens, positions, cache, block_mask, first)
            return logits, h
        h = self.hidden(tokens, positions, cache, block_mask)
        rows = h if logits_rows is None else h[logits_rows]
        return self.logits(rows), h


HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.o_proj.weight": "wo.weight",
    "self_attn.o_proj.bias": "wo.bias",
    "mlp.down_proj.weight": "w_down.weight",
    "mlp.down_proj.bias": "w_down.bias",
}


def convert_hf_state_dict(cfg: ModelConfig, sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Map Hugging Face parameter names onto ours, fusing q/k/v and gate/up."""
    out: dict[str, Tensor] = {
        "embed.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
    }
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        for hf_name, ours in HF_LAYER_NAMES.items():
            if p + hf_name in sd:
                out[f"layers.{i}.{ours}"] = sd[p + hf_name]
        out[f"layers.{i}.wqkv.weight"] = torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        if cfg.qkv_bias:
            out[f"layers.{i}.wqkv.bias"] = torch.cat([sd[p + f"self_attn.{x}_proj.bias"] for x in "qkv"])
        out[f"layers.{i}.w_gate_up.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        if cfg.mlp_bias:
            out[f"layers.{i}.w_gate_up.bias"] = torch.cat([sd[p + "mlp.gate_proj.bias"], sd[p + "mlp.up_proj.bias"]])
    return out


def build_model(cfg: ModelConfig, hf_state_dict: dict[str, Tensor], device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Instantiate the decoder and load Hugging Face-named weights into it."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(convert_hf_state_dict(cfg, hf_state_dict), strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {', '.join(missing[:5])}")
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.inv_freq = rope_frequencies(cfg)[0].to(device)  # stays fp32 whatever the weights' dtype
    return model
