"""The engine: one loaded model (plus its drafting heads) and the forward pass every decoder calls.

It is the object the CLI, the worker and the benchmark hold: `engine.generate(prompt_ids, config)` runs vanilla or
TokenSwift decoding on it. The forward runs eagerly, or through fixed-size compiled graphs (core/compiled.py) when
`compile=True`; both compute the same function.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from core import attention_kernel
from core.decoding import Generation, GenerationConfig, Step, generate
from core.heads import DraftHeads, HeadsError, load_heads
from core.kv_cache import KVCache, PartialKVCache
from core.loading import LoadedModel, load_model
from core.model import Transformer
from core.tokenswift import (
    TokenSwiftOptions,
    default_draft_depth,
    default_min_draft_score,
    default_tree_budget,
    tokenswift_steps,
)

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, loaded: LoadedModel, heads: DraftHeads | None = None,
                 options: TokenSwiftOptions | None = None, compile: bool = False):
        self.loaded = loaded
        self.model: Transformer = loaded.model
        self.tokenizer = loaded.tokenizer
        self.heads = heads
        options = options or TokenSwiftOptions()
        if options.tree_budget is None:
            options = replace(options, tree_budget=default_tree_budget(self.model.device, compile))
        if options.min_draft_score is None:
            options = replace(options, min_draft_score=default_min_draft_score(self.model.device, compile))
        if options.draft_depth is None:
            chain = heads.root_chain if heads is not None and heads.root is not None else 1
            levels = chain + (1 if options.draft_mode == "separate" else 0)  # the backbone drafts level 1 there
            options = replace(options, draft_depth=default_draft_depth(self.model.device, compile, levels))
        self.options = options
        self.runner = None
        self.notices: list[str] = []  # things the user should be told once (e.g. no heads)
        if self.model.device.type == "cpu" and self.model.dtype == torch.float32:
            attention_kernel.kernel()  # build or load it now, not inside the first generation
            # compiled graphs run inductor's GEMMs on the [out, in] weights (faster inside a graph)
            if not compile and self.model.pack_for_decoding() and heads is not None:
                heads.pack_for_decoding(self.model)
        if compile:
            from core.compiled import CompiledRunner

            self.runner = CompiledRunner(self.model, heads if self.graph_heads else None,
                                         root=heads if self.root_drafting else None)

    @classmethod
    def load(cls, spec: str | None = None, heads: str | Path | None = "default", device: str | None = None,
             options: TokenSwiftOptions | None = None, compile: bool = False) -> "Engine":
        """Load a model and its heads: `heads="default"` takes the committed heads for known models if present,
        None runs without heads (n-gram drafting only), a path loads that file (and must match the model)."""
        loaded = load_model(spec, device=device)
        head_model = None
        if heads == "default":
            path = loaded.default_heads_path()
            if path is not None and path.is_file():
                head_model = load_heads(path, loaded.model, loaded.name)
        elif heads is not None:
            head_model = load_heads(Path(heads), loaded.model, loaded.name)
        return cls(loaded, head_model, options, compile)

    @property
    def root_drafting(self) -> bool:
        """Whether the root head drafts: in fused mode the first token after the root, in separate mode the one
        after the backbone's draft (heads with a root head, not switched off)."""
        return self.options.root_head and self.heads is not None and self.heads.root is not None

    @property
    def backbone_levels(self) -> int:
        """Tree levels the draft pass's backbone logits fill: the first, in separate mode."""
        return 1 if self.options.draft_mode == "separate" else 0

    @property
    def root_levels(self) -> int:
        """Tree levels the root head drafts, below the backbone's: as many as it chains, within draft_levels."""
        if not self.root_drafting:
            return 0
        assert self.heads is not None
        return max(0, min(self.heads.root_chain, self.draft_levels - self.backbone_levels))

    @property
    def chained_drafting(self) -> bool:
        """Whether the root head drafts more than one level, reading its own state back (DraftHeads.root_step)."""
        return self.root_levels > 1

    @property
    def graph_heads(self) -> bool:
        """Whether the compiled forward computes the heads' logits for every row. Not when the backbone and the root
        head draft every level the model drafts (a 2-node tree, a draft depth of 1, or a chained root head, which
        leaves the heads no level: draft_candidates): reading the heads' lm_head rows would cost ~3% of a CPU step
        for nothing (drafting computes them from the hidden state if a variant needs them)."""
        if self.heads is None or self.chained_drafting:
            return False
        return self.draft_levels > self.backbone_levels + self.root_levels

    @property
    def draft_levels(self) -> int:
        """Tree levels below the root that the model's drafters fill (deeper ones only n-gram chains)."""
        opt = self.options
        assert opt.tree_budget is not None and opt.draft_depth is not None  # resolved in __init__
        return min(opt.tree_budget - 1, opt.draft_depth)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def max_context(self) -> int:
        return self.model.cfg.max_position

    @property
    def max_block(self) -> int:
        """The most tokens one forward appends beyond the committed sequence (compiled graphs pad up to a size)."""
        budget = self.options.tree_budget
        if self.runner is None:
            return budget + 1
        # a tree pads to the graph warm_up compiles for it, or to a larger one that is already ready
        return max(budget, self.runner.bucket(budget) or 0, self.runner.graph_size(budget) or 0) + 1

    def warm_up(self, progress: Callable[[str], None] | None = None) -> float:
        """Compile the graphs this engine's decoding uses (one token, one tree, the root head); seconds spent."""
        if self.runner is None:
            return 0.0
        return self.runner.warm_up(self._graph_sizes(), progress, root=True)

    def warm_up_plan(self) -> list[tuple[str, Callable[[], None]]]:
        """`warm_up` as separate steps, one graph each (CompiledRunner.plan); empty for an eager engine."""
        return [] if self.runner is None else self.runner.plan(self._graph_sizes(), root=True)

    def _graph_sizes(self) -> tuple[int, ...]:
        """One token, and the tree: on a GPU one graph of the tree's size (padding rows cost next to nothing there);
        on a CPU every size up to it, since gated trees vary in size and a padded row costs as much as a real one."""
        assert self.runner is not None
        top = self.runner.bucket(self.options.tree_budget) or 1
        if self.device.type == "cuda":
            return tuple(sorted({1, top}))
        return tuple(s for s in self.runner.sizes if s <= top)

    def forward(self, tokens: Tensor, positions: Tensor, cache: KVCache | PartialKVCache,
                block_mask: Tensor | None = None, logits_rows: Tensor | slice | None = None) -> tuple[Tensor, Tensor]:
        """Logits (of `logits_rows`, default all) and hidden states of new tokens; see Transformer.forward."""
        if self.runner is not None and logits_rows is None:
            out = self.runner.forward(tokens, positions, cache, block_mask)
            if out is not None:
                return out[0], out[1]
        return self.model(tokens, positions, cache, block_mask, logits_rows)

    def forward_with_heads(self, tokens: Tensor, positions: Tensor, cache: KVCache | PartialKVCache,
                           block_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Like `forward` (all rows), plus the drafting heads' logits [n_heads, n, V'] of every row where a compiled
        graph computes them (one small matrix product more there, not another pass; Engine.graph_heads). None
        otherwise: drafting reads the heads at one row only (the last accepted node) and computes them for it (eagerly
        2.1 ms a step on this project's Zen 3 against 3.3 for every row of a 4-node tree)."""
        if self.runner is not None:
            out = self.runner.forward(tokens, positions, cache, block_mask)
            if out is not None:
                return out
        logits, hidden = self.model(tokens, positions, cache, block_mask)
        return logits, hidden, None

    def root_step(self, h0: Tensor, roots: Tensor) -> tuple[Tensor, Tensor]:
        """The root head's state and logits (DraftHeads.root_step), through its compiled graph when there is one."""
        if self.runner is not None:
            out = self.runner.root_step(h0, roots)
            if out is not None:
                return out
        assert self.heads is not None
        return self.heads.root_step(h0, roots, self.model)

    def generate(self, prompt_ids: list[int], config: GenerationConfig, cancel: Callable[[], bool] | None = None,
                 resume_ids: list[int] = ()) -> Generation:  # type: ignore[assignment]
        """See core.decoding.generate."""
        return generate(self, prompt_ids, config, cancel, resume_ids)

    def tokenswift_steps(self, gen: Generation) -> Iterator[Step]:
        return tokenswift_steps(self, gen)


__all__ = ["Engine", "HeadsError", "Any"]
