"""The compiled runner computes what the eager model computes: one-token steps and padded tree blocks."""
from __future__ import annotations

from pathlib import Path

import torch

from core.compiled import CompiledRunner
from core.decoding import GenerationConfig
from core.engine import Engine
from core.loading import load_model
from core.sampling import PRESETS
from core.tokenswift import TokenSwiftOptions
from core.tree import TreeBuilder
from conftest import make_tiny_checkpoint


def test_compiled_graphs_match_eager(tmp_path: Path) -> None:
    loaded = load_model(str(make_tiny_checkpoint(tmp_path / "m", vocab_size=512)), device="cpu")
    model = loaded.model
    runner = CompiledRunner(model, sizes=(1, 8))
    runner.warm_up()
    prefix = torch.randint(512, (20,), generator=torch.Generator().manual_seed(0))
    b = TreeBuilder(root=3)
    b.add([5, 6, 7], [0.9, 0.8, 0.7], 1)
    b.add([5, 9], [0.9, 0.6], 1)
    tree = b.build(8)  # 6 nodes: padded to the 8-token graph
    with torch.inference_mode():
        results = []
        for fwd in (model, runner.forward):
            cache = model.new_cache(64)
            fwd(prefix, torch.arange(20), cache)  # prefill: eager in both (no graph of that size)
            cache.commit()
            one, _ = fwd(torch.tensor([3]), torch.tensor([20]), cache)
            cache.rollback()
            block, hidden = fwd(torch.tensor(tree.tokens), tree.positions(20), cache, tree.mask())
            cache.keep([0, 1, 2])
            nxt, _ = fwd(torch.tensor([11]), torch.tensor([23]), cache)
            results.append((one, block, hidden, nxt, cache.length))
    (a1, ab, ah, an, al), (c1, cb, ch, cn, cl) = results
    assert cb.shape == ab.shape and ch.shape == ah.shape and al == cl == 23
    for x, y in [(a1, c1), (ab, cb), (an, cn)]:
        assert torch.allclose(x, y, atol=1e-4, rtol=1e-4)


def test_compiled_engine_is_lossless(tmp_path: Path) -> None:
    loaded = load_model(str(make_tiny_checkpoint(tmp_path / "m", vocab_size=512, initializer_range=0.3)), device="cpu")
    engine = Engine(loaded, None, TokenSwiftOptions(tree_budget=8), compile=True)
    engine.runner.sizes = (1, 8)
    engine.warm_up()
    assert engine.runner.ready == {1, 8}
    ids = torch.randint(512, (25,), generator=torch.Generator().manual_seed(1)).tolist()
    config = GenerationConfig(max_new_tokens=200, sampling=PRESETS["greedy"], ignore_eos=True)
    from lossless import assert_lossless

    assert_lossless(engine, ids, config)
