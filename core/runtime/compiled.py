"""Compiled forward passes: the decoder as a few fixed-size graphs (torch.compile, inductor, weights frozen).

Inductor's own micro-GEMMs and fused elementwise kernels remove eager PyTorch's per-op overhead. Graphs specialise on
shapes, so a forward of n tokens is padded up to the next size in `SIZES`; padding rows attend only to themselves and
are never kept in the cache. Attention stays outside the graph, as a custom op that reads and writes the KV cache:
its length changes every step and would otherwise force a recompilation each time. The kernels' compiled code is
cached on disk under TOKENSWIFT_CACHE, but every start lowers the graphs again (about a minute per graph on a
2-core CPU; configure_inductor says why).
Prefill chunks and any size beyond the largest graph run eagerly; both paths compute the same function.
"""
from __future__ import annotations

import functools
import os
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from core.runtime.kv_cache import KVCache, PartialKVCache
from core.runtime.model import Transformer, Visibility, attention, rotate
from core.runtime.paths import cache_root

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)

# The cache and visibility of the forward in progress. The graph cannot take them as inputs (a Python object,
# and a tensor whose shape changes every step), so the attention op reads them here. One forward runs at a time per
# process.
_ACTIVE: dict[str, object] = {}


@torch.library.custom_op("tokenswift::cached_attention", mutates_args=())
def cached_attention(q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
    cache = _ACTIVE["cache"]
    keys, values = cache.write(layer, q, k, v)  # type: ignore[attr-defined]
    out = attention(q, keys, values, _ACTIVE["seen"])  # type: ignore[arg-type]
    return out.transpose(0, 1).reshape(q.shape[1], -1)


@cached_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
    return q.new_empty(q.shape[1], q.shape[0] * q.shape[2])


# A function of the hidden states computed inside every graph, its rows along the second-to-last dimension (the
# drafting heads' logits); a one-row function of a hidden state and a token compiled as a graph of its own (the
# root head's step).
ExtraOutput = Callable[[Tensor], Tensor]
SideStep = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


def dense_forward(model: Transformer, extra: ExtraOutput | None, tokens: Tensor, cos: Tensor,
                  sin: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """The decoder with attention delegated to the custom op; returns the logits of all rows, the hidden states and
    `extra` of the hidden states (None without it)."""
    cfg = model.cfg
    n = tokens.shape[0]
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    x = model.embed(tokens)
    for i, block in enumerate(model.layers):
        q, k, v = block.wqkv(block.attn_norm(x)).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = rotate(q.view(n, cfg.n_heads, cfg.head_dim).transpose(0, 1), cos, sin)
        k = rotate(k.view(n, cfg.n_kv_heads, cfg.head_dim).transpose(0, 1), cos, sin)
        v = v.view(n, cfg.n_kv_heads, cfg.head_dim).transpose(0, 1)
        x = x + block.wo(cached_attention(q, k, v, i))
        gate, up = block.w_gate_up(block.mlp_norm(x)).chunk(2, dim=-1)
        x = x + block.w_down(F.silu(gate) * up)
    return model.logits(x), x, (extra(x) if extra is not None else None)


def configure_inductor() -> None:
    # inductor's modules are imported only by compiling engines: importing them costs seconds
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # Torch writes its default (a temp folder) into the variable the first time anything asks for it, and loading
    # a model does: so only a value other than that default is a user's choice to keep.
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # weights become constants: prepacked for inductor's own GEMMs
    # The graph cache cannot hold graphs with mkldnn-packed weights (torch bypasses it for them): each start lowers
    # every graph again. Without the packing the cache hits, but a step is several times slower (no GEMM templates),
    # so the packing stays; the cache still serves the compiled kernels' code.
    inductor_config.fx_graph_cache = True
    cache_gemm_templates()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(SIZES))


def cache_gemm_templates() -> None:
    """Parse each of inductor's Jinja kernel templates once per process: it parses the same template source again
    for every GEMM it lowers (hundreds per graph), a large share of a warm-up. A parsed template is immutable, so
    sharing it changes no generated code."""
    from torch._inductor.codegen.common import KernelTemplate

    parse = KernelTemplate.__dict__.get("_template_from_string")
    if isinstance(parse, staticmethod) and not hasattr(parse.__func__, "cache_info"):
        KernelTemplate._template_from_string = staticmethod(functools.cache(parse.__func__))


class CompiledRunner:
    def __init__(self, model: Transformer, sizes: tuple[int, ...] = SIZES, mode: str = "max-autotune",
                 extra: ExtraOutput | None = None, side: SideStep | None = None, side_name: str = "the side step"):
        """`extra`: computed from the hidden states of every row inside every graph (third output of `forward`);
        `side`: a one-row step compiled as a graph of its own (`side_step`; it runs between forwards), called
        `side_name` in the warm-up plan. Whatever they read must be built before: built inside a trace, a tensor
        would force a recompile."""
        configure_inductor()
        self.model = model
        self.sizes = sizes
        self.side_name = side_name
        self._fn = torch.compile(lambda t, c, s: dense_forward(model, extra, t, c, s), mode=mode, fullgraph=True,
                                 dynamic=False)
        # eagerly a small one-row step is mostly per-op overhead: its own graph halves it on a CPU
        self._side_fn = None if side is None else torch.compile(side, mode=mode, fullgraph=True, dynamic=False)
        self.ready: set[int] = set()  # sizes whose graphs are compiled
        self.side_ready = False

    def bucket(self, n: int) -> int | None:
        """The graph size a forward of n tokens should have (the one to warm up for it)."""
        return next((s for s in self.sizes if s >= n), None)

    def graph_size(self, n: int) -> int | None:
        """The compiled graph a forward of n tokens runs in: the smallest ready one that fits (padding a few rows
        costs less than running eagerly), or None (eager)."""
        return min((s for s in self.ready if s >= n), default=None)

    def warm_up(self, sizes: tuple[int, ...] | None = None, progress: Callable[[str], None] | None = None,
                side: bool = False) -> float:
        """Compile the graphs for `sizes` (and the side step's, if `side`) now: minutes, at every start (see
        configure_inductor)."""
        t0 = time.perf_counter()
        for what, compile_graph in self.plan(sizes, side):
            if progress:
                progress(what)
            compile_graph()
        return time.perf_counter() - t0

    def plan(self, sizes: tuple[int, ...] | None = None, side: bool = False) -> list[tuple[str, Callable[[], None]]]:
        """The warm-up as separate steps, one graph each (what it compiles, a call that compiles it), so a caller
        can do other work between them; graphs already compiled are left out."""
        steps: list[tuple[str, Callable[[], None]]] = []
        if side and self._side_fn is not None and not self.side_ready:
            steps.append((self.side_name, self._warm_side))
        steps += [(f"the {size}-token graph", functools.partial(self._warm_graph, size))
                  for size in sizes or self.sizes if size not in self.ready]
        return steps

    def _warm_side(self) -> None:
        self.side_ready = True
        device = self.model.device
        with torch.inference_mode():
            self.side_step(torch.zeros(1, self.model.cfg.hidden_size, dtype=self.model.dtype, device=device),
                           torch.zeros(1, dtype=torch.long, device=device))

    def _warm_graph(self, size: int) -> None:
        cache = self.model.new_cache(size + 1)
        self.ready.add(size)
        with torch.inference_mode():
            self.forward(torch.zeros(size, dtype=torch.long, device=self.model.device),
                         torch.arange(size, device=self.model.device), cache)

    def forward(self, tokens: Tensor, positions: Tensor, cache: KVCache | PartialKVCache,
                block_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """Logits, hidden states and `extra` of all rows; None if no graph of a fitting size is ready (the caller
        runs eagerly: a generation never stalls on a compilation)."""
        n = tokens.shape[0]
        size = self.graph_size(n)
        if size is None:
            return None
        pad = size - n
        if pad:
            # Padding rows: token 0 at the last real position, seeing only themselves.
            tokens = F.pad(tokens, (0, pad))
            positions = torch.cat([positions, positions[-1:].expand(pad)])
            full = torch.eye(size, dtype=torch.bool, device=tokens.device)
            full[:n, :n] = block_mask if block_mask is not None else torch.ones(n, n, dtype=torch.bool,
                                                                                device=tokens.device).tril_()
            block_mask = full
        cache.begin(size)
        seen = Visibility(cache.visible_past(), block_mask, self.model.cfg.sliding_window,
                          self.model.attention_bias(cache, size, block_mask, positions))
        cos, sin = self.model.rope(positions)
        _ACTIVE["cache"], _ACTIVE["seen"] = cache, seen
        try:
            logits, hidden, extra = self._fn(tokens, cos, sin)
        finally:
            _ACTIVE.clear()
        cache.n_new = n  # padding rows were written past the real ones; commit() must not keep them
        return logits[:n], hidden[:n], (extra[..., :n, :] if extra is not None else None)

    def side_step(self, hidden: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor] | None:
        """The side step of one row through its graph; None if that graph is not compiled."""
        if not self.side_ready or self._side_fn is None or hidden.shape[0] != 1:
            return None
        return self._side_fn(hidden, tokens)
