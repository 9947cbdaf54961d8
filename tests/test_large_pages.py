"""The weights and the KV cache on huge pages: where this Linux grants them on request, the default model's packed
weights and a cache are backed by 2 MiB pages (as /proc/self/smaps reports them) and hold the same numbers as
ordinary tensors."""
from __future__ import annotations

import pytest
import torch

from core.runtime import large_pages
from core.runtime.kv_cache import KVCache
from core.runtime.weights import pack

GRANTED = large_pages.huge_pages_mode() in ("madvise", "always")
needs_huge_pages = pytest.mark.skipif(not GRANTED, reason="this system does not grant transparent huge pages")


def huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds `address`."""
    mapping = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                mapping = lo <= address < hi
            elif mapping and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_huge_pages
def test_a_large_buffer_starts_on_a_huge_page_and_is_backed_by_them() -> None:
    t = large_pages.zeros((4, 1024, 1024), torch.float32)  # 16 MiB
    assert t.data_ptr() % large_pages.HUGE_PAGE == 0
    assert bool((t == 0).all())
    assert huge_kib_at(t.data_ptr()) >= 2048


def test_a_small_buffer_is_an_ordinary_tensor() -> None:
    t = large_pages.zeros((16, 16), torch.float32)
    assert t.shape == (16, 16) and bool((t == 0).all()) and t.is_contiguous()


@needs_huge_pages
def test_the_default_models_weights_and_cache_are_on_huge_pages(smol_engine) -> None:
    model = smol_engine.model
    for layer in (model.lm_head, model.layers[0].wqkv, model.layers[-1].w_down):
        assert huge_kib_at(layer.packed.data.data_ptr()) >= 2048
    cache = KVCache(model.cfg.n_layers, model.cfg.n_kv_heads, model.cfg.head_dim, 4096, torch.float32, "cpu")
    assert huge_kib_at(cache.k.data_ptr()) >= 2048 and huge_kib_at(cache.v.data_ptr()) >= 2048
    assert cache.tiled and bool((cache.k == 0).all()) and bool((cache.v == 0).all())


def test_packed_weights_in_the_arena_hold_the_same_numbers(monkeypatch) -> None:
    w = torch.randn(200, 256, generator=torch.Generator().manual_seed(0))
    for fmt in ("f32", "bf16", "q8_0", "q4_1"):
        arena = pack(w, fmt)
        with monkeypatch.context() as no_huge_pages:  # ordinary tensors
            no_huge_pages.setattr(large_pages, "reserve", lambda nbytes: None)
            plain = pack(w, fmt)
        for a, b in ((arena.data, plain.data), (arena.d, plain.d), (arena.m, plain.m)):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.is_contiguous() and a.dtype == b.dtype and torch.equal(a, b)
        assert torch.equal(arena.dequantize(), plain.dequantize())
