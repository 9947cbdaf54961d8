"""Prompts and incremental detokenisation: streamed deltas add up to the decoded text, also across a resume."""
from __future__ import annotations

import random

import pytest

from core.generation.text import MAX_PROMPT_CHARS, TextStream, encode_prompt
from core.runtime.loading import load_tokenizer, resolve


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve("smollm2-135m")[0])


TEXT = "Héllo wörld — ünïcödé ☃ 日本語のテキスト 🎉🎉 done. " * 4


def test_deltas_add_up_to_the_text_whatever_the_chunking(tokenizer) -> None:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    for trial in range(50):
        rnd = random.Random(trial)
        stream, out, i = TextStream(tokenizer), "", 0
        while i < len(ids):
            k = rnd.randint(1, 5)
            delta = stream.push(ids[i:i + k])
            assert "\ufffd" not in delta  # never a broken character on screen
            out += delta
            i += k
        out += stream.flush()
        assert out == tokenizer.decode(ids)


def test_a_bulk_push_holds_back_only_an_incomplete_character(tokenizer) -> None:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    for cut in range(1, len(ids)):
        stream = TextStream(tokenizer)
        out = stream.push(ids[:cut])  # what a resumed generation already wrote
        for t in ids[cut:]:
            out += stream.push([t])
        assert out + stream.flush() == tokenizer.decode(ids)


def test_chat_template_and_bad_prompts(tokenizer) -> None:
    ids = encode_prompt(tokenizer, "Write a poem.")
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    plain = encode_prompt(tokenizer, "Write a poem.", chat=False)
    assert len(plain) < len(ids)
    with pytest.raises(ValueError, match="empty"):
        encode_prompt(tokenizer, "   ")
    with pytest.raises(ValueError, match="limit"):
        encode_prompt(tokenizer, "x" * (MAX_PROMPT_CHARS + 1))
