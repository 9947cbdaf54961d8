"""TokenSwift decoding: draft a token tree, verify it in one forward, accept exactly what the model would write.

Each step:
1. **Draft.** `fused` (default): the heads read the hidden state of the last accepted node from the previous
   verification, and the root head reads it with the root itself, so a step costs one forward. `separate` (the
   paper's): a one-token forward of the root over the partial KV cache gives the backbone's next-token top-1 and,
   through the root head (reading the root's state with that draft) or the heads, the tokens after it. Drafts for
   a position are ranked by the drafter's logits, processed as the sampler processes the model's
   (Sampler.draft_scores), plus the Gumbel noise the sampler will add at that position (it depends only on the
   seed and the position, so it is known now).
2. **Reuse.** The n-gram table proposes continuations keyed by the root and by the first draft token.
3. **Tree.** All drafts merge into one trie under a node budget (core/tree.py).
4. **Verify.** One forward of the whole tree over the full cache with a tree mask. Then walk from the root: at each
   node draw the model's token exactly as vanilla decoding would at that position (same penalty window of committed +
   path tokens, same position-keyed randomness), and move to the child holding it; stop where no child does. The
   walked path and the drawn token after it are the output, so it equals vanilla decoding token for token.
5. **Commit.** The accepted path's keys/values are compacted in place; the rest of the tree is dropped.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch
from torch import Tensor

from core.calibration import DraftCalibrator, Proposal
from core.heads import rank_drafts
from core.kv_cache import PartialKVCache
from core.ngram import NGramTable
from core.tree import HEADS, NGRAM, Tree, TreeBuilder

if TYPE_CHECKING:
    from core.decoding import Generation, Step
    from core.engine import Engine

log = logging.getLogger(__name__)
DRAFT_MODES = ("fused", "separate")
GAMMA = 4  # draft depth the paper's acceptance rate is normalised by
MAX_TREE = 256  # nodes


@dataclass(frozen=True)
class TokenSwiftOptions:
    draft_mode: str = "fused"
    tree_budget: int | None = None  # tree nodes (root included) verified per step; None: the device's default
    min_draft_score: float | None = None  # drafts less likely than this are not verified; None: the device's default
    head_topk: int = 3  # candidates per head
    root_head: bool = True  # fused mode: the root head (if the heads have one) drafts the first token
    backbone_topk: int = 1  # depth-1 candidates from the draft pass (separate mode)
    ngram_n: int = 4
    ngram_topk: int = 20
    ngram_lag: int = 0  # index all but the last `ngram_lag` tokens (the paper lags by its penalty window, 1024)
    ngram_weight: float = 1.0  # scales the n-gram chains' acceptance estimate against the heads'
    calibrate: bool = True  # score drafts by their measured rate of being drawn (core/calibration.py)
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


def default_tree_budget(device: torch.device, compiled: bool) -> int:
    """The tree size that gave the most tokens/s where it was measured (README, Performance).

    On a CPU every extra verified token costs (compiled, 2 tokens ~1.15x one and 4 ~1.4x), so the compiled CPU's
    trees are gated (default_min_draft_score) and drafted by the root head's levels only (see default_draft_depth):
    most steps verify 1-2 tokens, and a loop the n-gram table knows verifies 4 (greedy 2.15-2.35x `ar` to 8000
    tokens against 1.52-1.63x with at most 2 nodes; studio 1.21-1.24x / 1.19-1.25x `ar` at 1024 / 4096 tokens
    with the chained root head, 1.14x / 1.04x with at most 2 nodes; Zen 3). Eagerly, 4 nodes with every draft verified (the
    sweep's best before the root head; now studio 1.15x `ar` at 1.62 tokens per step). On a GPU verifying tens of tokens costs about one
    step, so a larger tree is nearly free (not measured here: no GPU).
    """
    return 16 if device.type == "cuda" else 4


def default_draft_depth(device: torch.device, compiled: bool, levels: int = 1) -> int:
    """Tree levels the model's drafters fill: on a compiled CPU the `levels` of its cheap drafters only (the root
    head's, more than one if it is chained, below the backbone's draft in separate mode); deeper nodes come from
    n-gram chains (heads 2 and 3 are right 10% and 8% of the time and would put their logits into every forward, ~3%
    of a step; a chained root head's deeper drafts are right about a third of the time and cost ~0.5 ms a level);
    elsewhere every level."""
    return levels if device.type == "cpu" and compiled else MAX_TREE


def default_min_draft_score(device: torch.device, compiled: bool) -> float:
    """The least estimated chance of acceptance for which verifying a draft pays.

    A 2-node tree yields 1 + p tokens for a cost c(2) against 1 token for 1, so a draft pays iff p > c(2) - 1: on
    this CPU, compiled, c(2) - 1 is 0.12 at 1024 cached tokens and 0.23 at 7000 (README, cost curve), and 0.25 is
    the top of that range (p is the calibrated chance, core/calibration.py). Gating at the measured c(2) - 1 instead
    lost with the paper's sampling (README): the calibrated chances of low-scored drafts still run high, so a gate
    at the break-even verifies drafts that do not pay. Eagerly the 4-node tree did best verifying every draft (see
    default_tree_budget), and on a GPU extra tokens are nearly free: there, every draft the budget allows is verified.
    """
    return 0.25 if device.type == "cpu" and compiled else 0.0


def draft_tree(engine: "Engine", gen: "Generation", head_logits: Tensor | None, h_last: Tensor | None,
               backbone: Tensor | None, table: NGramTable,
               calibrator: DraftCalibrator | None = None) -> tuple[Tree, list[Proposal]]:
    """Merge the model's drafts (draft_candidates) and the n-gram table's continuations below the root (the last
    token of `gen`) into one budgeted trie, scored by the calibrator's chances if given. Also returns the drafts as
    proposed, for the calibrator to learn from once the step is drawn."""
    opt = engine.options
    root = gen.tokens[-1]
    depth = opt.tree_budget - 1  # no deeper draft fits the tree
    candidates = draft_candidates(engine, gen, head_logits, h_last, backbone, engine.draft_levels, calibrator)
    builder = TreeBuilder(root)
    if engine.chained_drafting:  # deeper drafts hold only under the top draft above them
        builder.add_chain(candidates, HEADS)
    else:
        builder.add_product(candidates, HEADS)
    # n-gram chains keyed by the root, and by the most likely first draft (as the paper keys them)
    keys = [(root, [], 1.0)]
    if candidates:
        first, chance = candidates[0][0]
        keys.append((first, [first], chance))
    for key, prefix, base in keys:
        # a continuation seen c times among `total` scores c / (total + 1): one seen once is right ~1 time in 4 with
        # the studio settings, not always (as c / total would claim); measured on generated text
        total = table.total(key)
        for cont, count in table.topk(key, opt.ngram_topk):
            score = base * min(1.0, opt.ngram_weight * count / (total + 1))
            builder.add(prefix + list(cont)[:depth - len(prefix)], [base] * len(prefix) + [score] * len(cont), NGRAM)
    proposed = builder.recalibrate(calibrator.chance) if calibrator is not None else []
    return builder.build(opt.tree_budget, opt.min_draft_score or 0.0), proposed


def draft_candidates(engine: "Engine", gen: "Generation", head_logits: Tensor | None, h_last: Tensor | None,
                     backbone: Tensor | None, depth: int,
                     calibrator: DraftCalibrator | None = None) -> list[list[tuple[int, float]]]:
    """[(token, estimated chance), ...] for each of the first `depth` positions after the root, from the backbone
    (separate mode), the root head and the heads, each ranked as the sampler will draw there (heads.candidates).

    `h_last` is the hidden state the heads read (fused mode: the position before the root, head k predicts the k-th
    token after the root, and the root head reads it with the root; separate mode: the root, everything one
    further, and the root head reads it with the backbone's top draft);
    `head_logits` [n_heads, V'] their predictions if the forward computed them (None: computed here if needed);
    `backbone` the draft pass's next-token logits (separate mode only). A chained root head stops where the path
    of its top drafts is less likely than the draft gate (by `calibrator`'s chances, if given): no node below could
    be verified, since none is more likely than its parent.
    """
    opt, heads, device = engine.options, engine.heads, engine.device
    root, root_pos = gen.tokens[-1], len(gen.tokens) - 1
    settings, sampler = gen.config.sampling, gen.sampler

    def noise(first: int, n: int) -> Tensor | None:
        """The draws' Gumbel noise at positions first .. first + n - 1 (none when decoding greedily)."""
        if settings.greedy:
            return None
        return torch.stack([sampler.noise(first + i, device) for i in range(n)])

    candidates: list[list[tuple[int, float]]] = []
    if backbone is not None and depth > 0:
        # the backbone's logits are the model's own (over a partial cache): processed exactly as the draw will be
        ids, p = rank_drafts(sampler.scores(backbone[None], gen.window()), opt.backbone_topk, noise(root_pos + 1, 1))
        candidates.append(list(zip(ids[0].tolist(), p[0].tolist())))
    if heads is None or h_last is None:
        return candidates
    if engine.root_drafting:
        # the root head predicts head 1's token knowing the token before it: nearly twice as often right. A chained
        # one then reads its own state back with its top draft, a level deeper each time (heads.root_step). In fused
        # mode it reads the state before the root with the root; in separate mode the root's own state (the draft
        # pass's) with the backbone's top draft, so it drafts from the second level on
        state, token, chance = h_last[None], root, 1.0
        if candidates:
            token, top = candidates[0][0]
            chance = calibrator.chance(top, HEADS, 1) if calibrator is not None else top
        first = len(candidates)
        for level in range(first, min(depth, first + heads.root_chain)):
            if chance < (opt.min_draft_score or 0.0):
                break
            state, logits = engine.root_step(state, torch.tensor([token], device=device))
            ids, p = heads.candidates(sampler.draft_scores(logits, heads.root_ids), opt.head_topk,
                                      noise(root_pos + 1 + level, 1), heads.root_ids)
            candidates.append(list(zip(ids[0].tolist(), p[0].tolist())))
            token, top = int(ids[0, 0]), float(p[0, 0])
            chance *= calibrator.chance(top, HEADS, level + 1) if calibrator is not None else top
        if engine.chained_drafting:  # its levels only: heads that know neither token above add nothing worth it
            return candidates
    # in fused mode head k predicts the k-th token after the root, in separate mode the (k+1)-th
    skip = len(candidates) - (1 if backbone is not None else 0)
    more = min(depth - len(candidates), heads.n_heads - skip)
    if more > 0:
        if head_logits is None:  # no forward computed them (eager, or a graph without them: Engine.graph_heads)
            head_logits = heads.logits(h_last[None], engine.model)[:, 0]
        ids, p = heads.candidates(sampler.draft_scores(head_logits[skip:skip + more], heads.vocab), opt.head_topk,
                                  noise(root_pos + 1 + len(candidates), more))
        candidates += [list(zip(i.tolist(), q.tolist())) for i, q in zip(ids, p)]
    return candidates


def tokenswift_steps(engine: "Engine", gen: "Generation") -> Iterator["Step"]:
    opt = engine.options.validate()
    if engine.heads is None:
        warn_once(engine, "no trained drafting heads for this model: TokenSwift drafts from n-grams only")
    device = engine.device
    cache = gen.new_cache()
    logits, h = gen.prefill(cache)
    h_last = h  # the hidden state the heads read: the last position the model has processed
    head_logits = None  # their logits, if a forward computed them; else drafting computes them when it needs them
    table = NGramTable(opt.ngram_n)
    table.extend(gen.tokens, len(gen.tokens) - opt.ngram_lag)
    partial = PartialKVCache(cache, opt.kv_budget) if opt.draft_mode == "separate" else None
    calibrator = DraftCalibrator() if opt.calibrate else None

    # The first token comes from the prefill, like vanilla decoding's.
    t0 = time.perf_counter()
    step = gen.emit([gen.draw(logits)], time.perf_counter() - t0)
    if step is not None:
        yield step

    while not gen.stop_reason and not gen.cancelled():
        t0 = time.perf_counter()
        root, root_pos = gen.tokens[-1], len(gen.tokens) - 1
        backbone = None
        if partial is not None:
            draft_logits, draft_hidden, draft_heads = engine.forward_with_heads(
                torch.tensor([root], device=device), torch.tensor([root_pos], device=device), partial)
            partial.commit()
            # the backbone drafts the token after the root; the heads, read at the root, the ones after that
            backbone, h_last = draft_logits[0], draft_hidden[0]
            head_logits = None if draft_heads is None else draft_heads[:, 0]
        tree, proposed = draft_tree(engine, gen, head_logits, h_last, backbone, table, calibrator)
        logits, hidden, tree_heads = engine.forward_with_heads(
            torch.tensor(tree.tokens, device=device), tree.positions(root_pos, device), cache, tree.mask(device))
        node, path, accepted_nodes = 0, [], []
        while True:
            token = gen.draw(logits[node], path)
            child = tree.children[node].get(token)
            if child is None:
                break
            node = child
            path.append(token)
            accepted_nodes.append(node)
        cache.keep([0] + accepted_nodes)
        if calibrator is not None:  # every draft whose parent was drawn learns whether it was drawn too
            calibrator.observe(proposed, path + [token])
        # fused mode drafts the next step from the last accepted node
        h_last, head_logits = hidden[node], None if tree_heads is None else tree_heads[:, node]
        from_ngram = sum(1 for i in accepted_nodes if tree.sources[i] & NGRAM)
        step = gen.emit(path + [token], time.perf_counter() - t0, accepted=len(path), from_ngram=from_ngram,
                        from_heads=len(path) - from_ngram, tree_size=len(tree))
        table.extend(gen.tokens, len(gen.tokens) - opt.ngram_lag)
        if partial is not None:
            gen.stats["partial_selections"] = partial.selections
        if step is not None:
            yield step


def warn_once(engine: "Engine", message: str) -> None:
    if message not in engine.notices:
        engine.notices.append(message)
        log.info(message)
