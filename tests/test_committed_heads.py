"""The committed heads of the default model: they load, they match the model, and they predict far better than
chance and than two simple baselines on a fixed text."""
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
# Chance for a top-3 guess over the heads' 8192 ids is 0.04%. Two baselines that know far more than chance, computed
# below: the three most frequent tokens of this very text (an in-sample oracle: ~20%, as " the . ," are a fifth of
# English), and the model's own top-3 next-token guess reused for the token after it (~7%). Head 1 (t+2) scored 30%
# top-3 on held-out generated text and 29% here; 25% leaves room for numerics while still failing untrained heads
# (which reproduce the own-next guess) or heads of another model.
MIN_HEAD1_TOP3 = 0.25


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
def test_heads_beat_chance_and_simple_baselines(smol_engine, heads) -> None:
    model = smol_engine.model
    ids = smol_engine.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    cache = model.new_cache(len(ids))
    logits, h = model(torch.tensor(ids), torch.arange(len(ids)), cache)
    head_logits = heads.logits(h, model)  # [3, positions, V']
    frequent = [t for t, _ in Counter(ids).most_common(3)]
    acc = []
    for k in range(3):  # head k + 1 at position t predicts token t + k + 2
        target = torch.tensor(ids[k + 2:])
        n = len(target)
        top3 = heads.vocab[head_logits[k, :n].topk(3, -1).indices]
        acc.append(float((top3 == target[:, None]).any(-1).float().mean()))
        own_next = float((logits[:n].topk(3, -1).indices == target[:, None]).any(-1).float().mean())
        assert acc[k] >= 2 * own_next, (k + 1, acc[k], own_next)
    freq = sum(t in frequent for t in ids[2:]) / len(ids[2:])
    assert acc[0] >= MIN_HEAD1_TOP3 and acc[0] >= 1.3 * freq, (acc[0], freq)
    assert acc[0] >= acc[2], "the nearest head should be the most accurate"


def test_heads_refuse_another_model(smol_engine, tiny_model_dir) -> None:
    from core.loading import load_model

    other = load_model(str(tiny_model_dir), device="cpu")
    with pytest.raises(HeadsError, match="not for this model"):
        load_heads(smol_engine.loaded.default_heads_path(), other.model, other.name)
