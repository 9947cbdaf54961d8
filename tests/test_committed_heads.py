"""The committed heads of the default model: they load, they match the model, and they predict far better than
chance or a frequency baseline on a fixed text."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from core.heads import HeadsError, load_heads, model_fingerprint

# A fixed passage in the style the model writes (not from the training data).
TEXT = (
    "The morning fog rolled slowly over the harbor as Elena walked down to the docks. She had lived in the small "
    "fishing village all her life, and she knew every boat by the sound of its engine. Today, however, something "
    "was different. A ship she had never seen before was tied to the old pier, its sails patched and its hull "
    "covered in barnacles. The fishermen stood at a distance, whispering to each other. Elena stepped closer and "
    "read the name painted on the bow: The Silver Promise. Her heart began to race. It was the name of the ship "
    "her grandfather had sailed on fifty years ago, the ship that had disappeared in a storm and was never found. "
    "She looked around for the captain, but the deck was empty. The only sound was the creaking of the ropes and "
    "the cry of the gulls above. Slowly, she climbed the ladder and stepped onto the deck."
)
# Chance for a top-3 guess over the heads' 8192 ids is 0.04%; always guessing the three most frequent tokens of
# this very text scores the frequency baseline computed below (~10%). The heads must beat it by a wide margin.
MIN_HEAD1_TOP3 = 0.30


@pytest.fixture(scope="module")
def heads(smol_engine):
    path = smol_engine.loaded.default_heads_path()
    assert path is not None and path.is_file(), f"committed heads missing: {path}"
    return load_heads(path, smol_engine.model, smol_engine.loaded.name)


def test_card_describes_the_heads(smol_engine, heads) -> None:
    card = json.loads(smol_engine.loaded.default_heads_path().with_suffix(".json").read_text())
    assert card["base_model"] == "smollm2-135m" == heads.meta["base_model"]
    assert heads.meta["fingerprint"] == model_fingerprint(smol_engine.model)
    assert card["data"]["generated_tokens"] > 100_000 and "train-heads" in card["command"]
    for k in (1, 2, 3):
        assert 0 < card["held_out_accuracy"][f"head{k} (t+{k + 1})"]["top3"] <= 1


@torch.inference_mode()
def test_heads_beat_chance_and_frequency_by_a_wide_margin(smol_engine, heads) -> None:
    model = smol_engine.model
    ids = smol_engine.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    cache = model.new_cache(len(ids))
    _, h = model(torch.tensor(ids), torch.arange(len(ids)), cache)
    target = torch.tensor(ids[2:])  # head 1 at position t predicts token t + 2
    ids_top, _ = zip(*(heads.topk(h[t], model, 3) for t in range(len(ids) - 2)))
    head1 = torch.stack([x[0] for x in ids_top])  # [positions, 3]
    acc = float((head1 == target[:, None]).any(-1).float().mean())
    frequent = [t for t, _ in Counter(ids).most_common(3)]
    baseline = float(sum(t in frequent for t in target.tolist()) / len(target))
    assert acc >= MIN_HEAD1_TOP3 and acc >= 2.5 * baseline, (acc, baseline)


def test_heads_refuse_another_model(smol_engine, tiny_model_dir) -> None:
    from core.loading import load_model

    other = load_model(str(tiny_model_dir), device="cpu")
    with pytest.raises(HeadsError, match="not for this model"):
        load_heads(smol_engine.loaded.default_heads_path(), other.model, other.name)
