"""The native candidate trees (core/tokenswift/trees.cpp) equal the Python reference (tree.py: TreeDrafts, over
TreeBuilder and DraftCalibrator): the same trees, chances and learning, exactly, step after step."""
from __future__ import annotations

import random

import pytest

from core.engine import Engine
from core.generation.decoding import GenerationConfig
from core.generation.sampling import PRESETS
from core.tokenswift import drafting
from core.tokenswift.heads import load_heads
from core.tokenswift.ngram import NGramTable
from core.tokenswift.options import CPU_GATES, TokenSwiftOptions
from core.tokenswift.tree import HEADS, NGRAM, TreeDrafts, native_trees, tree_drafts

pytestmark = pytest.mark.skipif(native_trees() is None, reason="the kernels are not built here")


def random_levels(rng: random.Random, vocab: int) -> list[list[tuple[int, float]]]:
    """A drafter's levels: a few tokens a level from a small vocabulary (so paths merge with the n-grams'), chances
    that tie, vanish or are tiny now and then."""
    levels = []
    for _ in range(rng.randint(0, 3)):
        chances = [rng.choice([0.0, 1e-9, 0.25, 0.5, 1.0, rng.random()]) for _ in range(rng.randint(1, 3))]
        levels.append([(rng.randrange(vocab), p) for p in sorted(chances, reverse=True)])
    return levels


@pytest.mark.parametrize("chained", [True, False])
@pytest.mark.parametrize("calibrate", [True, False])
@pytest.mark.parametrize("budget", [1, 4, 10, 16])
@pytest.mark.parametrize("gate", ["low", "avx2"])  # low: every draft with a chance; avx2: that CPU's default gate
def test_native_trees_equal_the_reference(chained: bool, calibrate: bool, budget: int, gate: str) -> None:
    rng = random.Random(budget * 4 + 2 * chained + calibrate)
    vocab, n = 12, 4
    min_score = CPU_GATES["avx2"] if gate == "avx2" else 0.05 if budget > 4 else 0.0
    args = (budget, min_score, 1.0 + 0.5 * calibrate, chained, calibrate)
    native, reference = tree_drafts(*args), TreeDrafts(*args)
    assert not isinstance(native, TreeDrafts)
    table, text = NGramTable(n), [rng.randrange(vocab) for _ in range(8)]
    nonempty = 0
    for _ in range(300):
        table.extend(text)
        root = text[-1]
        levels = random_levels(rng, vocab)
        keys = [root, levels[0][0][0]] if levels else [root]
        ngrams = [(table.total(key), table.topk(key, min(20, budget - 1))) for key in keys]
        got, want = native.build(root, levels, ngrams), reference.build(root, levels, ngrams)
        assert got == want
        nonempty += len(got[0]) > 1
        for score in (0.0, 0.05, 0.31, 0.5, 0.99, 1.0, rng.random()):
            for source in (HEADS, NGRAM, HEADS | NGRAM):
                for depth in (1, 2, 5):
                    assert native.chance(score, source, depth) == reference.chance(score, source, depth)
        # the tokens drawn after the root: down the tree's first path as far as a coin says, then anything
        tokens, parents = got[0], got[1]
        drawn, node = [], 0
        while rng.random() < 0.7:
            children = [i for i in range(len(tokens)) if parents[i] == node]
            if not children:
                break
            node = rng.choice(children)
            drawn.append(tokens[node])
        drawn.append(rng.randrange(vocab))
        native.observe(drawn)
        reference.observe(drawn)
        text += drawn
    if budget == 1:  # a budget of one verifies the root alone
        assert nonempty == 0
    else:  # AVX2's gate leaves some trees their drafts and cuts others' (both sides compared)
        assert nonempty > 200 if gate == "low" else 50 < nonempty < 250


# a CPU's defaults with AVX-512's gate on any CPU (the same trees everywhere: AVX2's gate verifies fewer), and large
# trees
@pytest.mark.parametrize("options", [TokenSwiftOptions(min_draft_score=CPU_GATES["avx512"]),
                                     TokenSwiftOptions(tree_budget=10, min_draft_score=0.0)],
                         ids=["avx512-defaults", "large-trees"])
def test_a_generation_steps_alike_on_either_trees(smol_engine, monkeypatch, options: TokenSwiftOptions) -> None:
    """The whole decode loop on the real model and its heads takes the same steps (tree sizes, accepted drafts and
    their sources) with the native trees as with the Python reference, and writes the same tokens."""
    heads_path = smol_engine.loaded.default_heads_path()
    heads = load_heads(heads_path, smol_engine.model, smol_engine.loaded.name) if heads_path else None
    engine = Engine(smol_engine.loaded, heads, options)
    ids = engine.tokenizer.encode("Write a short story about a lighthouse keeper and her brother.")
    config = GenerationConfig(max_new_tokens=200, method="tokenswift", sampling=PRESETS["studio"].with_(seed=4),
                              ignore_eos=True)

    def run(native: bool) -> list[tuple]:
        monkeypatch.setattr(drafting, "tree_drafts", lambda *a: tree_drafts(*a, native=native))
        gen = engine.generate(ids, config)
        steps = [(s.token_ids, s.accepted, s.from_ngram, s.from_heads, s.tree_size) for s in gen]
        assert gen.result.token_ids == [t for s in steps for t in s[0]]
        return steps

    native, reference = run(True), run(False)
    assert native == reference
    assert sum(s[1] for s in native) > 10 and sum(s[4] for s in native) > 2 * len(native), "few trees verified"
