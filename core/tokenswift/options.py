"""TokenSwift's settings, their per-device defaults, and the draft plan: which drafter fills which tree level."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch

from core.runtime.kv_cache import PartialKVCache
from core.tokenswift.heads import DraftHeads

DRAFT_MODES = ("fused", "separate")
GAMMA = 4  # draft depth the paper's acceptance rate is normalised by
MAX_TREE = 256  # nodes


@dataclass(frozen=True)
class TokenSwiftOptions:
    draft_mode: str = "fused"
    tree_budget: int | None = None  # tree nodes (root included) verified per step; None: the device's default
    min_draft_score: float | None = None  # drafts less likely than this are not verified; None: the device's default
    head_topk: int = 3  # candidates per head
    root_head: bool = True  # the root head (if the heads have one) drafts below the root (or the backbone's draft)
    backbone_topk: int = 1  # depth-1 candidates from the draft pass (separate mode)
    ngram_n: int = 4
    ngram_topk: int = 20  # continuations proposed per key, at most (drafting: never more than the tree holds)
    ngram_lag: int = 0  # index all but the last `ngram_lag` tokens (the paper lags by its penalty window, 1024)
    ngram_weight: float = 1.0  # scales the n-gram chains' acceptance estimate against the heads'
    calibrate: bool = True  # score drafts by their measured rate of being drawn (core/tokenswift/calibration.py)
    draft_depth: int | None = None  # tree levels the model's drafters fill, deeper ones n-grams; None: the device's
    kv_budget: int = 4096  # partial KV cache of the separate draft pass

    def validate(self) -> "TokenSwiftOptions":
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"draft mode must be one of {', '.join(DRAFT_MODES)}, got {self.draft_mode!r}")
        if self.tree_budget is not None and not 1 <= self.tree_budget <= MAX_TREE:
            raise ValueError(f"tree budget must be between 1 and {MAX_TREE} nodes, got {self.tree_budget}")
        if self.min_draft_score is not None and not 0 <= self.min_draft_score <= 1:
            raise ValueError(f"minimum draft score must be between 0 and 1, got {self.min_draft_score}")
        if self.kv_budget <= PartialKVCache.SINKS + 1:
            raise ValueError(f"partial KV budget must exceed {PartialKVCache.SINKS + 1}, got {self.kv_budget}")
        if self.draft_depth is not None and self.draft_depth < 1:
            raise ValueError(f"draft depth must be at least 1, got {self.draft_depth}")
        if self.ngram_n < 2 or self.ngram_topk < 0 or self.head_topk < 1 or self.ngram_lag < 0:
            raise ValueError("n-gram size must be >= 2, top-k values >= 0 (head top-k >= 1), lag >= 0")
        return self

    def resolved(self, device: torch.device, heads: DraftHeads | None,
                 kernels: str | None = None) -> "TokenSwiftOptions":
        """These options with every device default (None) filled in, for an engine on `device` with `heads`, its
        model run by our CPU kernels built for the instruction-set level `kernels` (None: by PyTorch's operators)."""
        opt = self
        if opt.tree_budget is None:
            opt = replace(opt, tree_budget=default_tree_budget(device))
        if opt.min_draft_score is None:
            opt = replace(opt, min_draft_score=default_min_draft_score(device, kernels))
        if opt.draft_depth is None:
            chain = heads.root_chain if heads is not None and heads.root is not None else 1
            levels = chain + (1 if opt.draft_mode == "separate" else 0)  # the backbone drafts level 1 there
            opt = replace(opt, draft_depth=default_draft_depth(device, levels))
        return opt


def default_tree_budget(device: torch.device) -> int:
    """The most nodes verified a step: where verifying n tokens costs about one (a GPU), a large tree is nearly free;
    on a CPU each extra token costs a share of a step, so the trees stay small there, gated
    (default_min_draft_score) and drafted by the cheap drafters only (default_draft_depth). The values are the
    fastest measured with the benchmark's variants (README, Performance)."""
    return 16 if device.type == "cuda" else 4


def default_draft_depth(device: torch.device, levels: int = 1) -> int:
    """Tree levels the model's drafters fill: on a CPU the `levels` of its cheap drafters only (the root head's, more
    than one if it is chained, below the backbone's draft in separate mode), since heads 2 and 3 are rarely right;
    deeper nodes come from n-gram chains. On a GPU every level."""
    return levels if device.type == "cpu" else MAX_TREE


# The CPU draft gate per level of our kernels (core/runtime/kernels/build.py). AVX-512's tiles verify a second token
# for little (c(2) - 1 near 0.1); AVX2 has half the vector width and no 8-bit dot product, so a few rows' arithmetic
# outweighs reading the weights (c(2) - 1 near 0.3); plain C++ loops verify n tokens for about n times one, so only a
# certain draft pays there.
CPU_GATES: dict[str, float] = {"avx512bf16": 0.25, "avx512": 0.25, "avx2": 0.45, "generic": 1.0}
TORCH_CPU_GATE = 0.25  # a CPU model on PyTorch's operators


def default_min_draft_score(device: torch.device, kernels: str | None = None) -> float:
    """The least calibrated chance of acceptance for which verifying a draft pays, on `device` with our CPU kernels
    built for `kernels` (None: PyTorch's operators).

    A 2-node tree yields 1 + p tokens for a cost c(2) against 1 token for 1, so a draft pays iff p > c(2) - 1
    (`python -m core cost-curve`); further nodes must pay for more, since on a CPU c(n) climbs faster past two nodes
    and the step spends on each outside the forward too. So a CPU's gate sits where the benchmark's studio runs on
    such a CPU were fastest, above c(2) - 1; with a low acceptance (the paper's sampling) verifying every draft
    loses. On a GPU, where extra tokens are nearly free, every draft the budget allows is verified.
    """
    if device.type != "cpu":
        return 0.0
    return CPU_GATES[kernels] if kernels is not None else TORCH_CPU_GATE


@dataclass(frozen=True)
class DraftPlan:
    """Which drafter fills which level of the tree below the root, from resolved options and the heads.

    Levels are counted from the root's children. In separate mode the draft pass's backbone fills level 1; the root
    head (if any, and not switched off) fills the next `root_levels`, reading its own state back when chained; the
    three heads fill what is left of `draft_levels`; n-gram chains go deeper. Each derived value is worked out once:
    a plan is a snapshot of the options and the heads (Engine.plan makes a fresh one), read at every step.
    """

    options: TokenSwiftOptions
    heads: DraftHeads | None

    @cached_property
    def draft_levels(self) -> int:
        """Tree levels below the root that the model's drafters fill (deeper ones only n-gram chains)."""
        opt = self.options
        assert opt.tree_budget is not None and opt.draft_depth is not None, "options not resolved"
        return min(opt.tree_budget - 1, opt.draft_depth)

    @cached_property
    def root_drafting(self) -> bool:
        """Whether the root head drafts: in fused mode the first token after the root, in separate mode the one
        after the backbone's draft."""
        return self.options.root_head and self.heads is not None and self.heads.root is not None

    @cached_property
    def backbone_levels(self) -> int:
        """Tree levels the draft pass's backbone logits fill: the first, in separate mode."""
        return 1 if self.options.draft_mode == "separate" else 0

    @cached_property
    def root_levels(self) -> int:
        """Tree levels the root head drafts, below the backbone's: as many as it chains, within draft_levels."""
        if not self.root_drafting:
            return 0
        assert self.heads is not None
        return max(0, min(self.heads.root_chain, self.draft_levels - self.backbone_levels))

    @cached_property
    def chained_drafting(self) -> bool:
        """Whether the root head drafts more than one level, reading its own state back (DraftHeads.root_step)."""
        return self.root_levels > 1

    @cached_property
    def graph_heads(self) -> bool:
        """Whether a compiled forward should compute the three heads' logits for every row: only when they fill a
        level. Otherwise reading their lm_head rows costs every step for nothing (drafting computes them from the
        hidden state if a variant needs them)."""
        if self.heads is None or self.chained_drafting:
            return False
        return self.draft_levels > self.backbone_levels + self.root_levels
