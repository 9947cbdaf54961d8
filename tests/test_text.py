"""Prompts and incremental detokenisation: streamed deltas add up to the decoded text, also across a resume, by
bytes (a byte-level tokenizer's) and by re-decoded windows (any other's)."""
from __future__ import annotations

import random

import pytest

from core.generation.text import MAX_PROMPT_CHARS, TextStream, byte_pieces, encode_prompt
from core.runtime.loading import load_tokenizer, resolve


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve("smollm2-135m")[0])


TEXT = "Héllo wörld — ünïcödé ☃ 日本語のテキスト 🎉🎉 done. " * 4


@pytest.mark.parametrize("by_bytes", [True, False])
def test_deltas_add_up_to_the_text_whatever_the_chunking(tokenizer, by_bytes: bool) -> None:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert (TextStream(tokenizer, by_bytes).pieces is not None) == by_bytes  # SmolLM2's BPE is byte-level
    for trial in range(50):
        rnd = random.Random(trial)
        stream, out, i = TextStream(tokenizer, by_bytes), "", 0
        while i < len(ids):
            k = rnd.randint(1, 5)
            delta = stream.push(ids[i:i + k])
            assert "\ufffd" not in delta  # never a broken character on screen
            out += delta
            i += k
        out += stream.flush()
        assert out == tokenizer.decode(ids)


@pytest.mark.parametrize("by_bytes", [True, False])
def test_a_bulk_push_holds_back_only_an_incomplete_character(tokenizer, by_bytes: bool) -> None:
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    for cut in range(1, len(ids)):
        stream = TextStream(tokenizer, by_bytes)
        out = stream.push(ids[:cut])  # what a resumed generation already wrote
        for t in ids[cut:]:
            out += stream.push([t])
        assert out + stream.flush() == tokenizer.decode(ids)


def test_any_ids_stream_to_what_the_tokenizer_decodes(tokenizer) -> None:
    """Random ids, special tokens among them, and byte sequences that are no UTF-8 at all (a lone continuation
    byte, a lead byte cut short): the streamed text is the tokenizer's own decoding, U+FFFD where it puts one."""
    vocab = len(tokenizer)
    specials = tokenizer.all_special_ids
    lone = [i for i in range(vocab) if byte_pieces(tokenizer)[i] in (b"\x80", b"\xe6")]
    assert len(lone) == 2
    for trial in range(300):
        rnd = random.Random(trial)
        ids = [rnd.choice([rnd.randrange(vocab), rnd.choice(specials), rnd.choice(lone)]) for _ in range(40)]
        stream, out = TextStream(tokenizer), ""
        for i in range(0, len(ids), 3):
            out += stream.push(ids[i:i + 3])
        assert out + stream.flush() == tokenizer.decode(ids, skip_special_tokens=True)
    stream = TextStream(tokenizer)  # an id past the tokenizer's vocabulary (a padded embedding's) writes nothing
    assert stream.push([vocab + 5, *tokenizer("ok", add_special_tokens=False)["input_ids"]]) == "ok"


def test_chat_template_and_bad_prompts(tokenizer) -> None:
    ids = encode_prompt(tokenizer, "Write a poem.")
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    plain = encode_prompt(tokenizer, "Write a poem.", chat=False)
    assert len(plain) < len(ids)
    with pytest.raises(ValueError, match="empty"):
        encode_prompt(tokenizer, "   ")
    with pytest.raises(ValueError, match="limit"):
        encode_prompt(tokenizer, "x" * (MAX_PROMPT_CHARS + 1))
