"""The compiled runner computes what the eager model computes: one-token steps and padded tree blocks."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from conftest import make_tiny_checkpoint
from core.engine import Engine
from core.generation.decoding import GenerationConfig
from core.generation.sampling import PRESETS
from core.runtime.compiled import CompiledRunner, configure_inductor
from core.runtime.kernels.build import isa_level
from core.runtime.loading import cache_root, load_model
from core.tokenswift.heads import DraftHeads
from core.tokenswift.options import CPU_GATES, TORCH_CPU_GATE, TokenSwiftOptions
from core.tokenswift.tree import TreeBuilder


def test_compiled_graphs_match_eager(tmp_path: Path) -> None:
    loaded = load_model(str(make_tiny_checkpoint(tmp_path / "m", vocab_size=512)), device="cpu", native=False)
    model = loaded.model
    heads = DraftHeads.initial(model)
    torch.nn.init.normal_(heads.proj[0].weight, std=0.05)
    runner = CompiledRunner(model, sizes=(1, 8), extra=lambda x: heads.logits(x, model))
    runner.warm_up()
    prefix = torch.randint(512, (20,), generator=torch.Generator().manual_seed(0))
    b = TreeBuilder(root=3)
    b.add([5, 6, 7], [0.9, 0.8, 0.7], 1)
    b.add([5, 9], [0.9, 0.6], 1)
    tree = b.build(8)  # 5 nodes: padded to the 8-token graph
    def eager(tokens, positions, cache, mask=None):
        logits, hidden = model(tokens, positions, cache, mask)
        return logits, hidden, heads.logits(hidden, model)

    with torch.inference_mode():
        assert runner.forward(prefix, torch.arange(20), model.new_cache(64)) is None  # no 20-token graph
        results = []
        for fwd in (eager, runner.forward):
            cache = model.new_cache(64)
            model(prefix, torch.arange(20), cache)
            cache.commit()
            one = fwd(torch.tensor([3]), torch.tensor([20]), cache)
            cache.rollback()
            block = fwd(torch.tensor(tree.tokens), tree.positions(20), cache, tree.mask())
            cache.keep([0, 1, 2])
            nxt = fwd(torch.tensor([11]), torch.tensor([23]), cache)
            results.append((one, block, nxt, cache.length))
    (a1, ab, an, al), (c1, cb, cn, cl) = results
    n = len(tree)
    assert al == cl == 23 and cb[0].shape == ab[0].shape == (n, 512) and cb[2].shape == ab[2].shape == (3, n, 512)
    for x, y in [(a1, c1), (ab, cb), (an, cn)]:
        for u, v in zip(x, y):
            assert torch.allclose(u, v, atol=1e-4, rtol=1e-4)


def test_compiled_engine_is_lossless(tmp_path: Path) -> None:
    loaded = load_model(str(make_tiny_checkpoint(tmp_path / "m", vocab_size=512, initializer_range=0.3)), device="cpu",
                        native=False)
    engine = Engine(loaded, None, TokenSwiftOptions(tree_budget=8), compile=True)
    engine.runner.sizes = (1, 8)
    engine.warm_up()
    assert engine.runner.ready == {1, 8}
    ids = torch.randint(512, (25,), generator=torch.Generator().manual_seed(1)).tolist()
    config = GenerationConfig(max_new_tokens=200, sampling=PRESETS["greedy"], ignore_eos=True)
    from lossless import assert_lossless

    assert_lossless(engine, ids, config)


def test_a_cpu_engine_gates_trees_of_up_to_four_with_the_root_heads_levels_only(tmp_path: Path) -> None:
    loaded = load_model(str(make_tiny_checkpoint(tmp_path / "m", vocab_size=512)), device="cpu", native=False)
    heads = DraftHeads.initial(loaded.model, root_width=16)
    engine = Engine(loaded, heads, compile=True)
    opt = engine.options
    assert (opt.tree_budget, opt.draft_depth, opt.min_draft_score) == (4, 1, 0.25)
    assert engine.plan.root_drafting and not engine.plan.graph_heads  # the heads' logits stay out of every forward
    # gated trees vary in size, and on a CPU a padded row costs like a real one: a graph for each size
    graphs = [what for what, _ in engine.warm_up_plan()]
    assert graphs == ["the root head"] + [f"the {n}-token graph" for n in (1, 2, 3, 4)]
    eager = Engine(loaded, heads).options  # a CPU engine's defaults, compiled or not
    assert (eager.tree_budget, eager.draft_depth, eager.min_draft_score) == (4, 1, 0.25)
    heads.root_chain = 3  # a chained root head drafts its levels, still without the heads
    chained = Engine(loaded, heads, compile=True)
    assert chained.options.draft_depth == 3 and chained.plan.chained_drafting and not chained.plan.graph_heads
    # in separate mode the draft pass's backbone drafts the first level and the chain the levels below it, as
    # many as the 4-node tree holds
    separate = Engine(loaded, heads, TokenSwiftOptions(draft_mode="separate"), compile=True)
    assert separate.options.draft_depth == 4 and (separate.plan.backbone_levels, separate.plan.root_levels) == (1, 2)
    assert separate.plan.chained_drafting and not separate.plan.graph_heads


def test_an_engine_on_our_cpu_kernels_takes_its_kernel_levels_draft_gate(smol_engine) -> None:
    # the default model runs on our kernels: its gate is their level's, higher where a second token costs more
    assert smol_engine.model.native
    assert smol_engine.options.min_draft_score == CPU_GATES[isa_level()]
    assert CPU_GATES["generic"] > CPU_GATES["avx2"] > CPU_GATES["avx512"] == CPU_GATES["avx512bf16"] == TORCH_CPU_GATE
    cpu = torch.device("cpu")
    for level, gate in CPU_GATES.items():
        assert TokenSwiftOptions().resolved(cpu, None, level).min_draft_score == gate
    assert TokenSwiftOptions(min_draft_score=0.1).resolved(cpu, None, "avx2").min_draft_score == 0.1  # asked for


def test_compiled_root_head_matches_eager_and_keeps_decoding_lossless(tmp_path: Path) -> None:
    loaded = load_model(str(make_tiny_checkpoint(tmp_path / "m", vocab_size=512, initializer_range=0.3)), device="cpu",
                        native=False)
    model = loaded.model
    heads = DraftHeads.initial(model, root_width=32)
    torch.nn.init.normal_(heads.root.down.weight, std=0.2)  # a root head that differs from the model's prediction
    heads.keep_root_ids(torch.arange(0, 512, 3))
    engine = Engine(loaded, heads, TokenSwiftOptions(tree_budget=2, min_draft_score=0.0), compile=True)
    assert engine.plan.root_drafting and not engine.plan.graph_heads  # a 2-node tree drafts from the root head alone
    engine.runner.sizes = (1, 2)
    assert engine.runner.side_step(torch.zeros(1, model.cfg.hidden_size), torch.tensor([1])) is None  # not compiled
    engine.warm_up()
    assert engine.runner.side_ready and engine.runner.ready == {1, 2}
    h, roots = torch.randn(1, model.cfg.hidden_size), torch.tensor([7])
    with torch.inference_mode():
        compiled = engine.runner.side_step(h, roots)
        assert compiled is not None and compiled[1].shape == (1, len(heads.root_ids))
        for got, want in zip(compiled, heads.root_step(h, roots, model)):
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    calls = []
    graph = engine.runner._side_fn
    engine.runner._side_fn = lambda *a: calls.append(1) or graph(*a)
    ids = torch.randint(512, (25,), generator=torch.Generator().manual_seed(2)).tolist()
    from lossless import assert_lossless

    _, ts = assert_lossless(engine, ids, GenerationConfig(max_new_tokens=120, sampling=PRESETS["studio"],
                                                         ignore_eos=True))
    assert len(calls) == len(ts.steps) - 1  # every step after the first drafts through the root head's graph
    assert all(s.tree_size == 2 for s in ts.steps[1:])


def test_compiled_code_is_cached_under_the_model_cache(tmp_path: Path, monkeypatch) -> None:
    """Loading a model makes torch write its default cache folder (a temp folder) into TORCHINDUCTOR_CACHE_DIR:
    the runner still caches its graphs under TOKENSWIFT_CACHE, and keeps a folder the user chose."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    load_model(str(make_tiny_checkpoint(tmp_path / "m", vocab_size=512)), device="cpu", native=False)
    cache_dir()  # what torch does on its first compile-related call
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.abspath(default_cache_dir())
    configure_inductor()
    assert cache_dir() == str(cache_root() / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    configure_inductor()
    assert cache_dir() == str(tmp_path / "mine")


def test_inductor_parses_each_kernel_template_once() -> None:
    """configure_inductor makes inductor reuse a parsed Jinja template (it re-parsed one per GEMM it lowered, a
    quarter of a warm-up); a second call does not wrap it twice, and a shared template still renders."""
    from torch._inductor.codegen.common import KernelTemplate

    configure_inductor()
    configure_inductor()
    parse = KernelTemplate._template_from_string
    source = "{{ a }} + {{ b }}"
    assert parse(source) is parse(source) and parse(source).render(a=1, b=2) == "1 + 2"
    assert hasattr(parse, "cache_info") and not hasattr(parse.__wrapped__, "cache_info")
