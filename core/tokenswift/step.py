"""TokenSwift decoding: draft a token tree, verify it in one forward, accept exactly what the model would write.

Each step:
1. **Draft** (drafting.py). `fused` (default): the heads read the hidden state of the last accepted node from the
   previous verification, and the root head reads it with the root itself, so a step costs one forward. `separate`
   (the paper's): a one-token forward of the root over the partial KV cache gives the backbone's next-token top-1
   and, through the root head (reading the root's state with that draft) or the heads, the tokens after it.
2. **Reuse.** The n-gram table proposes continuations keyed by the root and by the first draft token.
3. **Tree.** All drafts merge into one trie under a node budget (tree.py).
4. **Verify.** One forward of the whole tree over the full cache with a tree mask. Then walk from the root: at each
   node draw the model's token exactly as vanilla decoding would at that position (same penalty window of committed +
   path tokens, same position-keyed randomness), and move to the child holding it; stop where no child does. The
   walked path and the drawn token after it are the output, so it equals vanilla decoding token for token.
5. **Commit.** The accepted path's keys/values are compacted in place; the rest of the tree is dropped.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from core.generation.decoding import Generation, Step
from core.runtime.kv_cache import PartialKVCache
from core.tokenswift.drafting import Drafters, TokenSwiftEngine, draft_tree
from core.tokenswift.ngram import NGramTable
from core.tokenswift.tree import NGRAM, TreeInputs

NO_HEADS_NOTICE = "no trained drafting heads for this model: TokenSwift drafts from n-grams only"


def tokenswift_steps(engine: TokenSwiftEngine, gen: Generation) -> Iterator[Step]:
    """TokenSwift decoding on `engine` (the engine registers it as "tokenswift")."""
    drafters = Drafters.of(engine, gen.sampler)
    plan = drafters.plan
    opt = plan.options.validate()
    if plan.heads is None:
        engine.notice(NO_HEADS_NOTICE)
    device = engine.device
    cache = gen.new_cache()
    logits, h = gen.prefill(cache)
    # the hidden state the heads read, row h_row of h_last [n, hidden]: the last position the model has processed
    h_last, h_row = h[None], 0
    head_logits = None  # their logits, if a forward computed them; else drafting computes them when it needs them
    table = NGramTable(opt.ngram_n)
    table.extend(gen.tokens, len(gen.tokens) - opt.ngram_lag)
    partial = PartialKVCache(cache, opt.kv_budget) if opt.draft_mode == "separate" else None
    inputs = TreeInputs(opt.tree_budget, device)

    # The first token comes from the prefill, like vanilla decoding's.
    t0 = time.perf_counter()
    step = gen.emit([gen.draw(logits)], t0)
    if step is not None:
        yield step

    while not gen.stop_reason and not gen.cancelled():
        t0 = time.perf_counter()
        table.extend(gen.tokens, len(gen.tokens) - opt.ngram_lag)  # the last step's tokens, in this step's time
        root, root_pos = gen.tokens[-1], len(gen.tokens) - 1
        backbone = None
        forward_s = 0.0
        if partial is not None:
            t1 = time.perf_counter()
            draft_logits, draft_hidden, draft_heads = engine.forward_with_heads(
                torch.tensor([root], device=device), torch.tensor([root_pos], device=device), partial)
            forward_s += time.perf_counter() - t1
            partial.commit()
            # the backbone drafts the token after the root; the heads, read at the root, the ones after that
            backbone, h_last, h_row = draft_logits[0], draft_hidden, 0
            head_logits = None if draft_heads is None else draft_heads[:, 0]
        tree = draft_tree(drafters, gen, head_logits, h_last, h_row, backbone, table)
        ids, positions, mask = inputs(tree, root_pos)
        t1 = time.perf_counter()
        logits, hidden, tree_heads = engine.forward_with_heads(ids, positions, cache, mask)
        forward_s += time.perf_counter() - t1
        accepted_nodes, token = gen.walk(logits, tree.tokens, tree.parents)
        path = [tree.tokens[i] for i in accepted_nodes]
        node = accepted_nodes[-1] if accepted_nodes else 0
        cache.keep([0] + accepted_nodes)
        drafters.trees.observe(path + [token])  # each draft whose parent was drawn: was it drawn too?
        # fused mode drafts the next step from the last accepted node
        h_last, h_row, head_logits = hidden, node, None if tree_heads is None else tree_heads[:, node]
        from_ngram = sum(1 for i in accepted_nodes if tree.sources[i] & NGRAM)
        step = gen.emit(path + [token], t0, accepted=len(path), from_ngram=from_ngram,
                        from_heads=len(path) - from_ngram, tree_size=len(tree), forward_s=forward_s)
        if partial is not None:
            gen.stats["partial_selections"] = partial.selections
        if step is not None:
            yield step

