"""The CPU attention kernel: the same function as two matrix products, a row's result independent of the rows and
masked keys that come with it (what keeps a verified tree's rows equal to vanilla steps), and the fallbacks."""
from __future__ import annotations

import pytest
import torch

from core.runtime.kernels import attention as attention_kernel
from core.runtime.kv_cache import KVCache, PartialKVCache
from core.runtime.model import attention


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    scores = q.double() @ keys.double().transpose(1, 2) * q.shape[-1] ** -0.5
    if bias is not None:
        scores = scores + bias.double()
    return (scores.softmax(-1) @ values.double()).float()


def transposed_keys(kv: int, length: int, d: int, slots: int | None = None) -> torch.Tensor:
    """Keys laid out as the CPU cache stores them: [kv, d, slots] underneath a [kv, length, d] view."""
    return torch.randn(kv, d, slots or length).transpose(1, 2)[:, :length]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if attention_kernel.kernel() is None:
        pytest.fail("the attention kernel did not build (a C++ compiler and ninja are requirements)")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("rows", [1, 3, 5, 6, 9, 24])
@pytest.mark.parametrize("length", [1, 63, 64, 255, 257, 1000])
def test_kernel_matches_softmax_attention(d: int, rows: int, length: int) -> None:
    torch.manual_seed(rows * 1000 + length)
    q, keys = torch.randn(3, rows, d), transposed_keys(3, length, d, slots=length + 40)
    values = torch.randn(3, length + 40, d)[:, :length]
    bias = torch.zeros(rows, length)
    bias[:, torch.rand(length) < 0.3] = float("-inf")  # a random mask, the newest key always visible
    bias[:, -1] = 0
    for b in (None, bias):
        out = attention_kernel.attend(q, keys, values, b, d**-0.5)
        assert out is not None
        torch.testing.assert_close(out, reference(q, keys, values, b), atol=2e-5, rtol=2e-5)


def test_a_row_is_the_same_alone_with_other_rows_and_with_masked_keys_after_it() -> None:
    # Vanilla decoding attends one query over L keys; a verified tree computes the same row among others, over
    # L + n keys of which the tree's other branches are masked. The results must be bit-identical.
    torch.manual_seed(0)
    d, length, extra = 64, 700, 5
    keys, values = transposed_keys(3, length + extra, d), torch.randn(3, length + extra, d)
    q = torch.randn(3, 12, d)
    alone = attention_kernel.attend(q[:, 4:5], keys[:, :length], values[:, :length], None, d**-0.5)
    bias = torch.zeros(12, length + extra)
    bias[4, length:] = float("-inf")
    bias[:, length - 1] = float("-inf")
    bias[4, length - 1] = 0
    together = attention_kernel.attend(q, keys, values, bias, d**-0.5)
    assert together is not None and alone is not None
    assert torch.equal(together[:, 4:5], alone)


def test_rows_whose_whole_chunk_is_masked() -> None:
    # A sliding window hides whole chunks of keys from some rows: those chunks must contribute nothing.
    torch.manual_seed(1)
    d, length = 64, 900
    q, keys, values = torch.randn(3, 4, d), transposed_keys(3, length, d), torch.randn(3, length, d)
    bias = torch.zeros(4, length)
    bias[:2, :600] = float("-inf")
    out = attention_kernel.attend(q, keys, values, bias, d**-0.5)
    assert out is not None
    torch.testing.assert_close(out, reference(q, keys, values, bias), atol=2e-5, rtol=2e-5)


def test_where_the_kernel_does_not_apply_attention_uses_matrix_products() -> None:
    torch.manual_seed(2)
    q, keys, values = torch.randn(3, 2, 64), torch.randn(3, 50, 64), torch.randn(3, 50, 64)
    assert attention_kernel.attend(q, keys, values, None, 0.125) is None  # keys not stored transposed
    assert attention_kernel.attend(q.bfloat16(), keys.bfloat16(), values.bfloat16(), None, 0.125) is None
    assert attention_kernel.attend(q[..., :48], keys[..., :48], values[..., :48], None, 0.125) is None  # head size
    kt = transposed_keys(3, 50, 64)
    assert attention_kernel.attend(q, kt, values, None, 0.125) is not None
    with attention_kernel.disabled():  # the cost curve's side-by-side switch
        assert attention_kernel.attend(q, kt, values, None, 0.125) is None
    assert attention_kernel.attend(q, kt, values, None, 0.125) is not None
    out = attention(q.reshape(6, 1, 64), keys, values, None)  # GQA: 6 query heads over 3 KV heads
    torch.testing.assert_close(out, reference(q, keys, values, None).reshape(6, 1, 64), atol=2e-5, rtol=2e-5)


def test_cpu_float32_caches_store_keys_transposed_and_attention_reads_them() -> None:
    cache = KVCache(n_layers=2, n_kv_heads=3, head_dim=64, max_len=300, dtype=torch.float32, device="cpu")
    assert cache.k.shape == (2, 3, 300, 64) and cache.k.stride(2) == 1
    partial = PartialKVCache(cache, budget=100)
    assert partial.k.stride(2) == 1
    assert KVCache(2, 3, 64, 300, torch.bfloat16, "cpu").k.stride(3) == 1  # other dtypes: row-major as before
    torch.manual_seed(3)
    q, k, v = torch.randn(9, 4, 64), torch.randn(3, 4, 64), torch.randn(3, 4, 64)
    cache.begin(4)
    keys, values = cache.write(0, q, k, v)
    assert torch.equal(keys, k) and torch.equal(values, v)
    out = attention(q, keys, values, None)
    expected = reference(q.reshape(3, 12, 64), k, v, None).reshape(9, 4, 64)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
