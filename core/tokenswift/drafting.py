"""Drafting: the model's drafts (backbone, root head, heads) and the n-gram table's continuations, merged into one
budgeted candidate tree below the root.

Drafts for a position are ranked by the drafter's logits, processed as the sampler processes the model's
(Sampler.draft_scores), plus the Gumbel noise the sampler will add at that position: it depends only on the seed and
the position, so it is known before the model sees the position. Were a drafter exact, its top-1 would be exactly
the token drawn. Which drafts are proposed never changes a token written: verification decides.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from core.generation.decoding import Decoder, Generation
from core.generation.sampling import Sampler, rank_drafts
from core.runtime.kv_cache import KVCache, PartialKVCache
from core.tokenswift.heads import RootDraft
from core.tokenswift.ngram import NGramTable
from core.tokenswift.options import DraftPlan
from core.tokenswift.tree import HEADS, Tree, Trees, tree_drafts


class TokenSwiftEngine(Decoder, Protocol):
    """What TokenSwift needs of an engine beyond the decode loop's forward."""

    @property
    def plan(self) -> DraftPlan:
        """The resolved options and the heads (core/tokenswift/options.py)."""

    def forward_with_heads(self, tokens: Tensor, positions: Tensor, cache: KVCache | PartialKVCache,
                           block_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """`forward` of all rows, plus the heads' logits [n_heads, n, V'] where the forward computed them."""

    def root_drafter(self, sampler: Sampler, k: int) -> RootDraft:
        """One drafted level of the root head, `sampler` and `k` bound: its state and its k drafts with their chances
        (DraftHeads.root_drafter)."""

    def notice(self, message: str) -> None:
        """Tell the user `message`, once."""


@dataclass(frozen=True)
class Drafters:
    """What a generation drafts with, looked up once for all its steps: the engine, its plan, the root head's drafted
    level bound to the generation's sampler (None where the root head does not draft), and the generation's trees
    and draft calibrator."""

    engine: TokenSwiftEngine
    plan: DraftPlan
    root_draft: RootDraft | None
    trees: Trees

    @classmethod
    def of(cls, engine: TokenSwiftEngine, sampler: Sampler) -> "Drafters":
        plan = engine.plan
        opt = plan.options
        root = engine.root_drafter(sampler, opt.head_topk) if plan.root_drafting else None
        trees = tree_drafts(opt.tree_budget, opt.min_draft_score or 0.0, opt.ngram_weight, plan.chained_drafting,
                            opt.calibrate)
        return cls(engine, plan, root, trees)


def draft_tree(drafters: Drafters, gen: Generation, head_logits: Tensor | None, h_last: Tensor | None, h_row: int,
               backbone: Tensor | None, table: NGramTable) -> Tree:
    """Merge the model's drafts (draft_candidates) and the n-gram table's continuations below the root (the last
    token of `gen`) into one budgeted trie, scored by the generation's calibrated chances (drafters.trees)."""
    opt = drafters.plan.options
    root = gen.tokens[-1]
    candidates = draft_candidates(drafters, gen, head_logits, h_last, h_row, backbone, drafters.plan.draft_levels)
    # n-gram chains keyed by the root, and by the most likely first draft (as the paper keys them)
    keys = [root, candidates[0][0][0]] if candidates else [root]
    # a key's continuations past its (budget - 1) most frequent are less likely than those, which alone fill the
    # tree: proposing them would make a step's work grow with the text (a comma's continuations) and verify nothing
    per_key = min(opt.ngram_topk, opt.tree_budget - 1)
    return Tree(*drafters.trees.build(root, candidates, [(table.total(key), table.topk(key, per_key))
                                                         for key in keys]))


def draft_candidates(drafters: Drafters, gen: Generation, head_logits: Tensor | None, h_last: Tensor | None,
                     h_row: int, backbone: Tensor | None, depth: int) -> list[list[tuple[int, float]]]:
    """[(token, estimated chance), ...] for each of the first `depth` positions after the root, from the backbone
    (separate mode), the root head and the heads, each ranked as the sampler will draw there (Sampler.rank_drafts).

    Row `h_row` of `h_last` [n, hidden] is the hidden state the heads read (fused mode: the position before the
    root, head k predicts the k-th token after the root, and the root head reads it with the root; separate mode:
    the root, everything one further, and the root head reads it with the backbone's top draft): the last forward's
    states are passed whole, since cutting a row out is an operator call between two forwards;
    `head_logits` [n_heads, V'] their predictions if the forward computed them (None: computed here if needed);
    `backbone` the draft pass's next-token logits (separate mode only). A chained root head stops where the path
    of its top drafts is less likely than the draft gate (by the calibrated chances, drafters.trees): no node below
    could be verified, since none is more likely than its parent.
    """
    engine, plan = drafters.engine, drafters.plan
    opt, heads = plan.options, plan.heads
    root, root_pos = gen.tokens[-1], len(gen.tokens) - 1
    settings, sampler = gen.config.sampling, gen.sampler

    candidates: list[list[tuple[int, float]]] = []
    if backbone is not None and depth > 0:
        # the backbone's logits are the model's own (over a partial cache): processed exactly as the draw will be
        noise = None if settings.greedy else sampler.noise(root_pos + 1, None, backbone.device)[None]
        ids, p = rank_drafts(sampler.scores(backbone[None], gen.window()), opt.backbone_topk, noise)
        candidates.append(list(zip(ids[0].tolist(), p[0].tolist())))
    if heads is None or h_last is None:
        return candidates
    if drafters.root_draft is not None:
        # the root head predicts head 1's token knowing the token before it: nearly twice as often right. A chained
        # one then reads its own state back with its top draft, a level deeper each time (heads.root_draft). In fused
        # mode it reads the state before the root with the root; in separate mode the root's own state (the draft
        # pass's) with the backbone's top draft, so it drafts from the second level on
        state, row, token, chance = h_last, h_row, root, 1.0
        if candidates:
            token, top = candidates[0][0]
            chance = drafters.trees.chance(top, HEADS, 1)
        first = len(candidates)
        for level in range(first, min(depth, first + heads.root_chain)):
            if chance < (opt.min_draft_score or 0.0):
                break
            state, ids, p = drafters.root_draft(state, row, token, root_pos + 1 + level)
            row = 0
            candidates.append(list(zip(ids, p)))
            token, top = candidates[-1][0]
            chance *= drafters.trees.chance(top, HEADS, level + 1)
        if plan.chained_drafting:  # its levels only: heads that know neither token above add nothing worth it
            return candidates
    # in fused mode head k predicts the k-th token after the root, in separate mode the (k+1)-th
    skip = len(candidates) - (1 if backbone is not None else 0)
    more = min(depth - len(candidates), heads.n_heads - skip)
    if more > 0:
        if head_logits is None:  # no forward computed them (eager, or a graph without them: DraftPlan.graph_heads)
            head_logits = heads.logits(h_last[h_row:h_row + 1], engine.model)[:, 0]
        ids, p = sampler.rank_drafts(head_logits[skip:skip + more], opt.head_topk, root_pos + 1 + len(candidates),
                                     heads.vocab)
        candidates += [list(zip(i.tolist(), q.tolist())) for i, q in zip(ids, p)]
    return candidates
