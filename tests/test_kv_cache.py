"""KV cache: compaction of an accepted tree path, rollback, and the partial cache's selection and refresh."""
from __future__ import annotations

import pytest
import torch
import transformers

from core.runtime.kv_cache import KEY_TILE, KVCache, PartialKVCache, key_slots, put_key_slots, tile_keys
from core.runtime.model import ModelConfig, Transformer, build_model
from core.tokenswift.tree import TreeBuilder


@pytest.fixture(scope="module")
def model() -> Transformer:
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    return build_model(ModelConfig.from_hf(hf.config), hf.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_in_tiles_read_back_as_written_across_tiles(dtype: torch.dtype) -> None:
    """A CPU cache keeps its keys in tiles of 64 slots: slots written from anywhere (inside a tile, across two or
    three of them) read back as written, each key's elements where the kernels look for them (key_offset: tile,
    element, slot in the tile), and nothing else moves."""
    c = KVCache(n_layers=2, n_kv_heads=3, head_dim=16, max_len=200, dtype=dtype, device="cpu")
    assert c.tiled and c.k.shape == (2, 3, 4, 16, KEY_TILE)
    gen = torch.Generator().manual_seed(5)
    expected = torch.zeros(2, 3, 200, 16, dtype=dtype)
    for start, n in ((0, 1), (5, 3), (60, 10), (100, 90), (199, 1)):
        new = torch.randn(3, n, 16, generator=gen).to(dtype)
        put_key_slots(c.k[1], start, new)
        expected[1, :, start:start + n] = new
        assert torch.equal(key_slots(c.k[1], start, start + n), new)
    assert torch.equal(c.keys(), expected)
    assert torch.equal(tile_keys(expected), c.k)
    slot, j = 130, 7  # element j of the key in `slot`, as the kernels address it
    flat = c.k[1, 2].reshape(-1)
    assert flat[slot // KEY_TILE * 16 * KEY_TILE + j * KEY_TILE + slot % KEY_TILE] == expected[1, 2, slot, j]


def test_keep_compacts_rows_in_place() -> None:
    c = KVCache(n_layers=2, n_kv_heads=1, head_dim=2, max_len=16, dtype=torch.float32, device="cpu")
    c.length = 3
    c.begin(5)
    for layer in range(2):
        k = torch.arange(10, dtype=torch.float32).view(1, 5, 2) + 100 * layer
        c.write(layer, k, k, -k)
    c.keep([0, 2, 4])
    assert c.length == 6
    assert c.keys()[1, 0, 3:6, 0].tolist() == [100.0, 104.0, 108.0]
    assert c.v[0, 0, 3:6, 1].tolist() == [-1.0, -5.0, -9.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_keep_moves_the_rows_torchs_indexing_moves(monkeypatch: pytest.MonkeyPatch,
                                                              dtype: torch.dtype) -> None:
    """The kernel's compaction (every layer in one call, keys stored in tiles) leaves the cache exactly as PyTorch's
    advanced indexing does, a block across two tiles of keys; rows out of order or outside the block are refused."""
    caches = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr("core.runtime.kv_cache.cpu.kernel", lambda: None)
        c = KVCache(n_layers=3, n_kv_heads=2, head_dim=16, max_len=80, dtype=dtype, device="cpu")
        assert c.tiled == native  # keys in tiles where the kernel reads them
        gen = torch.Generator().manual_seed(3)
        keys = torch.randn(c.v.shape, generator=gen).to(dtype)
        c.k.copy_(tile_keys(keys) if native else keys)
        c.v.copy_(torch.randn(c.v.shape, generator=gen))
        c.length = 60
        c.begin(8)
        before = (c.keys().clone(), c.v.clone())
        c.keep([0, 3, 4, 7])
        caches.append(c)
    assert caches[0].length == caches[1].length == 64
    assert torch.equal(caches[0].keys(), caches[1].keys()) and torch.equal(caches[0].v, caches[1].v)
    for d, r in enumerate([0, 3, 4, 7]):
        assert torch.equal(caches[0].keys()[:, :, 60 + d], before[0][:, :, 60 + r])
        assert torch.equal(caches[0].v[:, :, 60 + d], before[1][:, :, 60 + r])
    for rows in ([0, 2, 1], [0, 8], [1, 1], list(range(9))):
        c = caches[0]
        c.begin(8)
        with pytest.raises(ValueError, match="rows to keep"):
            c.keep(rows)


@torch.no_grad()
def test_verified_then_compacted_cache_equals_a_plain_causal_cache(model: Transformer) -> None:
    prefix = torch.randint(128, (20,), generator=torch.Generator().manual_seed(1))
    b = TreeBuilder(root=5)
    b.add([7, 8, 9], [0.9, 0.8, 0.7], 1)
    b.add([7, 3], [0.9, 0.85], 1)
    b.add([11], [0.5], 1)
    tree = b.build(10)
    accepted = [tree.children[0][7], tree.children[tree.children[0][7]][3]]  # root -> 7 -> 3
    tree_cache = model.new_cache(64)
    model(prefix, torch.arange(20), tree_cache)
    tree_cache.commit()
    model(torch.tensor(tree.tokens), tree.positions(20), tree_cache, tree.mask())
    tree_cache.keep([0] + accepted)
    plain = model.new_cache(64)
    seq = torch.cat([prefix, torch.tensor([5, 7, 3])])
    model(seq, torch.arange(23), plain)
    plain.commit()
    assert tree_cache.length == plain.length == 23
    nxt = torch.tensor([42])
    a, _ = model(nxt, torch.tensor([23]), tree_cache)
    b_, _ = model(nxt, torch.tensor([23]), plain)
    assert torch.allclose(a, b_, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_rollback_forgets_the_last_forward(model: Transformer) -> None:
    cache = model.new_cache(32)
    model(torch.tensor([1, 2, 3]), torch.arange(3), cache)
    cache.commit()
    model(torch.tensor([4, 5]), torch.arange(3, 5), cache)
    cache.rollback()
    assert cache.length == 3
    cache.rollback(1)
    assert cache.length == 1
    with pytest.raises(ValueError):
        cache.rollback(5)


def test_capacity_is_checked(model: Transformer) -> None:
    cache = model.new_cache(4)
    with pytest.raises(ValueError, match="KV cache full"):
        model(torch.arange(5), torch.arange(5), cache)


@torch.no_grad()
def test_partial_cache_is_the_full_cache_below_budget(model: Transformer) -> None:
    cache = model.new_cache(128)
    ids = torch.randint(128, (30,), generator=torch.Generator().manual_seed(2))
    model(ids, torch.arange(30), cache)
    cache.commit()
    partial = PartialKVCache(cache, budget=64)
    a, _ = model(torch.tensor([9]), torch.tensor([30]), partial)
    partial.commit()
    b, _ = model(torch.tensor([9]), torch.tensor([30]), cache)
    cache.rollback()
    assert torch.equal(a, b)
    assert cache.length == 30 and partial.selections == 0


@torch.no_grad()
def test_partial_cache_selects_sinks_and_top_scored_then_refreshes(model: Transformer) -> None:
    budget = 24
    cache = model.new_cache(256)
    ids = torch.randint(128, (100,), generator=torch.Generator().manual_seed(3))
    model(ids, torch.arange(100), cache)
    cache.commit()
    partial = PartialKVCache(cache, budget=budget)
    model(torch.tensor([7]), torch.tensor([100]), partial)
    assert partial.selections == 1 and partial.selected_at == 100
    # the 16 sink tokens sit first in every layer and head
    assert torch.equal(partial.keys()[:, :, :16], cache.keys()[:, :, :16])
    # every selected key is one of the full cache's keys (a real token, not noise)
    sel = partial.keys()[0, 0, 16:budget]
    full = cache.keys()[0, 0, :100]
    assert all(((full - row).abs().sum(-1) == 0).any() for row in sel)
    # tokens committed later overwrite the lowest-scored slots, newest last-but-closest to the end
    model(torch.tensor([1, 2, 3]), torch.arange(100, 103), cache)
    cache.commit()
    model(torch.tensor([7]), torch.tensor([103]), partial)
    assert torch.equal(partial.keys()[:, :, budget - 3:budget], cache.keys()[:, :, 100:103].flip(2))
    # once the recent tokens would reach the sinks, the whole sequence is scored again
    n_more = budget - 16
    model(torch.arange(n_more), torch.arange(103, 103 + n_more), cache)
    cache.commit()
    model(torch.tensor([7]), torch.tensor([103 + n_more]), partial)
    assert partial.selections == 2 and partial.selected_at == 103 + n_more
