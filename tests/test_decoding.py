"""Vanilla decoding: greedy output equals transformers' generate token for token on the real model (with and
without the repetition penalty); stopping on EOS, length, stop strings and cancel; resume; bad requests."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from core.engine import Engine
from core.generation.decoding import GenerationConfig
from core.generation.sampling import PRESETS, SamplingSettings
from core.generation.text import encode_prompt
from core.runtime.loading import load_model, resolve

PROMPT = "Write a detailed story about an old clockmaker who repairs a clock that runs backwards."


@pytest.fixture(scope="module")
def hf_model():
    folder, _ = resolve("smollm2-135m")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("penalty", [1.0, 1.2])
def test_greedy_equals_transformers_generate(smol_fp32, hf_model, penalty: float) -> None:
    smol_engine = smol_fp32
    ids = encode_prompt(smol_engine.tokenizer, PROMPT)
    n = 256
    # W covers the whole sequence, so our windowed penalty and HF's whole-history penalty mean the same
    s = SamplingSettings(temperature=0, top_p=1.0, penalty=penalty, penalty_window=4096)
    ours = smol_engine.generate(ids, GenerationConfig(max_new_tokens=n, sampling=s, ignore_eos=True)).run()
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, repetition_penalty=penalty,
                                suppress_tokens=[2], pad_token_id=2)[0, len(ids):].tolist()
    assert ours.n_tokens == n and ours.token_ids == ref


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Engine:
    # full vocabulary: its random text is made of whole tokens (a byte-sized vocabulary writes invalid UTF-8)
    return Engine(load_model(str(tiny_model_dir), device="cpu"))


def test_stops_on_end_of_sequence(smol_engine) -> None:
    ids = encode_prompt(smol_engine.tokenizer, "Reply with exactly one word: yes or no. Is water wet?")
    r = smol_engine.generate(ids, GenerationConfig(max_new_tokens=100, sampling=PRESETS["greedy"])).run()
    assert r.stop_reason == "eos" and r.token_ids[-1] in smol_engine.model.cfg.eos_token_ids
    assert r.n_tokens < 100 and "<|im_end|>" not in r.text


@pytest.mark.parametrize("method", ["ar", "tokenswift"])
def test_length_stop_strings_and_ignore_eos(tiny: Engine, method: str) -> None:
    ids = list(range(10, 40))
    config = GenerationConfig(max_new_tokens=77, method=method, sampling=PRESETS["studio"], ignore_eos=True)
    full = tiny.generate(ids, config).run()
    assert full.n_tokens == 77 and full.stop_reason == "length"
    assert not set(full.token_ids) & set(tiny.model.cfg.eos_token_ids)
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = tiny.generate(ids, replace(config, stop_strings=(stop,))).run()
    assert cut.stop_reason == "stop_string"
    assert cut.text == full.text[:full.text.find(stop)]
    assert stop not in cut.text and cut.token_ids == full.token_ids[:cut.n_tokens]


def test_a_stop_string_over_several_steps_cuts_where_it_begins(tiny: Engine) -> None:
    """Stop strings of several lengths, cut out of the text anywhere (so most straddle two or more steps' deltas):
    the text stops in the first of them to be complete, before its end, with none of them whole in it; what a delta
    had shown of it before it was complete stays shown."""
    ids = list(range(10, 40))
    config = GenerationConfig(max_new_tokens=160, method="tokenswift", sampling=PRESETS["studio"], ignore_eos=True)
    text = tiny.generate(ids, config).run().text
    assert len(text) > 100
    for start in range(0, len(text) - 12, len(text) // 12):
        stops = ("\x00never", text[start:start + 9], text[start + 4:start + 6])
        cut = tiny.generate(ids, replace(config, stop_strings=stops)).run()
        first = min((text.find(s), s) for s in stops[1:])
        assert cut.stop_reason == "stop_string" and text.startswith(cut.text), start
        assert first[0] <= len(cut.text) < first[0] + len(first[1]) and not any(s in cut.text for s in stops), start


@pytest.mark.parametrize("method", ["ar", "tokenswift"])
def test_cancel_is_checked_every_step(tiny: Engine, method: str) -> None:
    steps = []
    gen = tiny.generate(list(range(5, 25)), GenerationConfig(max_new_tokens=500, method=method, ignore_eos=True),
                        cancel=lambda: len(steps) >= 5)
    for step in gen:
        steps.append(step)
    assert gen.result.stop_reason == "cancelled" and len(steps) == 5
    assert gen.result.token_ids == [t for s in steps for t in s.token_ids]


@pytest.mark.parametrize("method", ["ar", "tokenswift"])
def test_resume_continues_exactly(tiny: Engine, method: str) -> None:
    ids = list(range(50, 80))
    config = GenerationConfig(max_new_tokens=120, method=method, sampling=PRESETS["paper"].with_(seed=4),
                              ignore_eos=True)
    whole = tiny.generate(ids, config).run()
    resumed = tiny.generate(ids, config, resume_ids=whole.token_ids[:45]).run()
    assert resumed.token_ids == whole.token_ids and resumed.n_resumed == 45
    assert resumed.text == whole.text


def test_bad_requests_are_refused(tiny: Engine) -> None:
    with pytest.raises(ValueError, match="context"):
        tiny.generate([1] * 100, GenerationConfig(max_new_tokens=tiny.max_context))
    with pytest.raises(ValueError, match="max new tokens"):
        tiny.generate([1], GenerationConfig(max_new_tokens=0))
    with pytest.raises(ValueError, match="unknown method"):
        tiny.generate([1], GenerationConfig(method="magic"))
    with pytest.raises(ValueError, match="no tokens"):
        tiny.generate([], GenerationConfig())
