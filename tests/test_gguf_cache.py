"""The GGUF conversion cache: an entry made from the same file at another path (another checkout's environment, since
deleted) is reused and made to name this path, so the default model still runs its own 4-bit blocks."""
from __future__ import annotations

import json
import os
import shutil

from core.runtime.loading import MANIFEST, converted_gguf, gguf_source, load_model, resolve


def test_a_cache_entry_from_a_moved_gguf_still_runs_the_blocks_as_stored(tmp_path, monkeypatch):
    folder, _ = resolve("smollm2-135m")  # the shared cache entry, converted once per machine
    gguf = gguf_source(folder)
    assert gguf is not None
    cache = tmp_path / "cache"
    shutil.copytree(folder, cache / "models" / folder.name)
    monkeypatch.setenv("TOKENSWIFT_CACHE", str(cache))
    copy = cache / "models" / folder.name
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["source"] = str(tmp_path / "gone" / gguf.name)  # made from a file that no longer exists there
    (copy / MANIFEST).write_text(json.dumps(manifest))
    assert gguf_source(copy) is None

    assert converted_gguf(gguf, name="smollm2-135m") == copy  # reused, not converted again
    assert gguf_source(copy) == gguf
    assert not [p for p in os.listdir(copy) if p.endswith(".tmp")]
    model = load_model("smollm2-135m", device="cpu").model
    assert model.native and model.layers[0].wqkv.packed.fmt == "q4_1"
