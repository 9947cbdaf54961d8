"""The few-row CPU linear kernel: the same function as nn.Linear, a row's result independent of the rows that come
with it, and, with the attention kernel, a whole decoder whose logits for a token are the same floats whether the
token is verified inside a tree or decoded alone (what makes TokenSwift's output vanilla decoding's, bit for bit)."""
from __future__ import annotations

import pytest
import torch

from core.runtime.kernels import linear as linear_kernel


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if linear_kernel.kernel() is None:
        pytest.fail("the linear kernel did not build (a C++ compiler and ninja are requirements)")


@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (50, 64), (7, 33), (16, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_a_float64_product(n: int, k: int, bias: bool) -> None:
    torch.manual_seed(n + k)
    w, b = torch.randn(n, k) / k**0.5, torch.randn(n) if bias else None
    x = torch.randn(linear_kernel.MAX_ROWS, k)
    packed = linear_kernel.pack(w)
    assert packed.shape == ((n + 15) // 16, k, 16)
    reference = x.double() @ w.double().T + (b.double() if bias else 0)
    for rows in (1, 2, 5, 6, 7, 8, 13, 32):  # one block, the block sizes, and blocks split near-equally
        out = linear_kernel.linear(x[:rows], packed, b, n)
        assert out.shape == (rows, n)
        torch.testing.assert_close(out.double(), reference[:rows], rtol=0, atol=2e-5 * k**0.5)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    torch.manual_seed(0)
    w, b = torch.randn(200, 96), torch.randn(200)
    packed = linear_kernel.pack(w)
    x = torch.randn(linear_kernel.MAX_ROWS, 96)
    together = linear_kernel.linear(x, packed, b, 200)
    for rows in range(1, linear_kernel.MAX_ROWS + 1):
        part = linear_kernel.linear(x[:rows], packed, b, 200)
        assert torch.equal(part, together[:rows]), rows  # bit for bit, whatever the blocks were
        alone = linear_kernel.linear(x[rows - 1:rows], packed, b, 200)
        assert torch.equal(alone[0], together[rows - 1]), rows


def test_fallbacks_leave_the_product_to_the_library() -> None:
    w = torch.randn(32, 64)
    packed = linear_kernel.pack(w)
    x = torch.randn(3, 64)
    assert linear_kernel.linear(torch.randn(linear_kernel.MAX_ROWS + 1, 64), packed, None, 32) is None  # a prefill
    assert linear_kernel.linear(x.bfloat16(), packed, None, 32) is None
    assert linear_kernel.linear(x, packed, None, 32) is not None


def test_pack_round_trips() -> None:
    w = torch.randn(50, 24)
    assert torch.equal(linear_kernel.unpack(linear_kernel.pack(w), 50), w)


def test_packed_model_matches_the_library_path(tiny_model_dir) -> None:
    from core.runtime.loading import load_model
    from core.runtime.model import PackedLinear

    with torch.inference_mode():
        for n in (3, linear_kernel.MAX_ROWS + 8):  # a decoding step (the kernel) and a prefill (unpacked weights)
            model = load_model(str(tiny_model_dir), device="cpu").model
            tokens, positions = torch.randint(1000, (n,)), torch.arange(n)
            cache = model.new_cache(64)
            library, _ = model(tokens, positions, cache)
            cache.rollback()
            assert model.pack_for_decoding()
            packed, _ = model(tokens, positions, cache)
            torch.testing.assert_close(packed, library, rtol=1e-5, atol=1e-5)
    block = model.layers[0]
    assert isinstance(block.wqkv, PackedLinear) and block.wqkv.weight is None  # one copy of the weights, packed
    assert block.wqkv.packed.shape == (block.wqkv.out_features // 16, 64, 16)
    assert model.lm_head.weight is model.embed.weight  # still tied: the embedding reads the same rows


def test_real_model_logits_in_a_tree_equal_decoding_alone(smol_engine) -> None:
    """Each row of a verified chain of drafts gets the logits its token would get as a one-token step, bit for bit:
    verification shares every float of vanilla decoding, so equal noise draws equal tokens. (A token on a side
    branch sits at another cache slot than it would alone, which changes the order of attention's sums: equal to
    float rounding, not bit for bit.)"""
    model, tok = smol_engine.model, smol_engine.tokenizer
    prompt = torch.tensor(tok.encode("The lighthouse keeper wrote in his log that night"))
    # a tree: the root, a chain of 3 drafts after it, and a side branch of 2 drafts after the root
    tree = torch.cat([prompt[-1:], torch.tensor(tok.encode(" the storm had")[:3] + tok.encode(" a ship")[:2])])
    parents = [-1, 0, 1, 2, 0, 4]
    block = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        j = i
        while j >= 0:
            block[i, j], j = True, parents[j]
    depth = block.sum(1) - 1
    n0 = len(prompt) - 1
    with torch.inference_mode():
        cache = model.new_cache(64)
        model(prompt[:-1], torch.arange(n0), cache)
        cache.commit()
        together, _ = model(tree, n0 + depth, cache, block)
        cache.rollback()
        for path, exact in (([0, 1, 2, 3], True), ([0, 4, 5], False)):
            for step, node in enumerate(path):  # vanilla decoding of this branch, one token per forward
                alone, _ = model(tree[node:node + 1], torch.tensor([n0 + step]), cache)
                cache.commit()
                if exact:
                    assert torch.equal(alone[0], together[node]), node
                else:
                    torch.testing.assert_close(alone[0], together[node], rtol=0, atol=1e-4)
            cache.rollback(n0)


def test_engines_pack_for_eager_decoding_only(tiny_model_dir) -> None:
    from core.engine import Engine
    from core.runtime.model import PackedLinear

    assert isinstance(Engine.load(str(tiny_model_dir), heads=None, device="cpu").model.layers[0].wqkv, PackedLinear)
    compiled = Engine.load(str(tiny_model_dir), heads=None, device="cpu", compile=True)
    assert type(compiled.model.layers[0].wqkv) is torch.nn.Linear  # its graphs run inductor's GEMMs


@pytest.mark.parametrize("vocab", [True, False])
def test_eager_engines_pack_the_heads_too(tiny_model_dir, vocab: bool) -> None:
    """An eager engine stores its heads' matrices and the lm_head rows they score as kernel tiles; their logits
    are the plain products' to float rounding, for a handful of rows (the kernel) and for more (plain rows)."""
    from core.engine import Engine
    from core.runtime.loading import load_model
    from core.runtime.model import PackedLinear
    from core.tokenswift.heads import DraftHeads

    loaded = load_model(str(tiny_model_dir), device="cpu")
    model = loaded.model
    ids = torch.arange(0, model.cfg.vocab_size, 3) if vocab else None
    heads = DraftHeads.initial(model, vocab=ids, root_width=32)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.05)
    if vocab:
        heads.keep_root_ids(ids[::2])
    h = torch.randn(linear_kernel.MAX_ROWS // 3 + 4, model.cfg.hidden_size)
    roots = torch.randint(model.cfg.vocab_size, (len(h),))
    with torch.inference_mode():
        plain = [(heads.logits(h[:n], model), heads.root_logits(h[:n], roots[:n], model)) for n in (4, len(h))]
        engine = Engine(loaded, heads)
        assert isinstance(heads.proj[0], PackedLinear) and isinstance(heads.root.up, PackedLinear)
        # the whole-vocabulary heads reuse the model's packed lm_head instead of a second copy
        assert (heads._packed["lm"] is engine.model.lm_head) == (not vocab)
        for n, (logits, root) in zip((4, len(h)), plain):
            torch.testing.assert_close(heads.logits(h[:n], model), logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(heads.root_logits(h[:n], roots[:n], model), root, rtol=1e-5, atol=1e-5)
