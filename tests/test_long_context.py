"""Long contexts: the KV cache refused up front when the GPU's free memory cannot hold it (CUDA only; a CPU allocates
as before), and the long-context profile (`python -m core long-profile`) running on a tiny random model. That the
per-step n-gram work does not scan the history is tests/test_ngram.py's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.runtime import kv_cache
from core.runtime.kv_cache import GIB, KVCache, KVCacheTooLarge, cache_tokens_that_fit
from core.tools.cli import main

LLAMA_8B_BF16 = 2 * 32 * 8 * 128 * 2  # bytes of keys and values per token: 128 KiB


def test_a_cache_too_large_for_the_free_gpu_memory_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(kv_cache, "free_memory", lambda device: (10 * GIB, 80 * GIB))
    # 80 GiB keeps 4 GiB spare for the forwards: 6 GiB of caches, 49,152 tokens of an 8B Llama
    assert cache_tokens_that_fit(LLAMA_8B_BF16, "cuda") == 6 * GIB // LLAMA_8B_BF16 == 49152
    with pytest.raises(KVCacheTooLarge, match=r"100000 tokens needs 12\.2 GiB .* room for 49152 tokens"):
        KVCache(32, 8, 128, 100_000, torch.bfloat16, "cuda")  # refused before anything is allocated


def test_a_cpu_cache_is_not_checked(monkeypatch) -> None:
    monkeypatch.setattr(kv_cache, "free_memory", lambda device: pytest.fail("a CPU has no free-memory check"))
    assert cache_tokens_that_fit(LLAMA_8B_BF16, "cpu") is None
    assert KVCache(2, 2, 16, 1000, torch.float32, "cpu").max_len == 1000


def test_the_long_context_profile_runs(tmp_path: Path, capsys) -> None:
    """The profile's rows, and a step's n-gram work bounded by the tree at 100K tokens: there a frequent token has
    far more continuations than a CPU tree's 3 nodes below the root, and each of the two keys proposes at most 3."""
    out = tmp_path / "profile.json"
    assert main(["long-profile", "--lengths", "300,100000", "--steps", "6", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["length"]) for r in rows] == [("ar", 300), ("ar", 100000), ("tokenswift", 300),
                                                          ("tokenswift", 100000)]
    assert all(r["steps"] == 6 and r["overhead_ms_median"] > 0 and r["python_calls_per_step"] > 0 for r in rows)
    assert 3 < rows[-1]["ngram_chains_per_step"] <= 2 * 3
    assert "at 100000 tokens a step's median overhead is" in capsys.readouterr().out
