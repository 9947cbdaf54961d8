"""core/generation/divergence.py: the recomputed draw at the first differing position, against a hand computation
on the real default model (one plain forward of the whole run, the draw's processing written out here), for
greedy, studio and paper sampling; and core/generation/agreement.py's pure helpers."""
from __future__ import annotations

import pytest
import torch

from core.generation.agreement import first_divergence, format_gap
from core.generation.decoding import GenerationConfig, Result
from core.generation.divergence import Divergence, explain_divergence
from core.generation.sampling import PRESETS, SamplingSettings, gumbel_noise
from core.generation.text import encode_prompt

N = 64
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def hand_scores(logits: torch.Tensor, seq: list[int], s: SamplingSettings, banned: tuple[int, ...]) -> torch.Tensor:
    """The draw's final scores for the token after `seq`, from one row of raw logits, written out step by step:
    banned ids out, the penalty once per distinct id of the window, temperature, top-p by a full sort (the fewest
    most likely tokens whose mass reaches top_p), min-p, then the Gumbel noise of (seed, position) on the survivors."""
    v = logits.float().clone()
    v[list(banned)] = float("-inf")
    if s.penalty != 1.0:
        ids = torch.tensor(sorted(set(seq[-s.penalty_window:])))
        x = v[ids]
        v[ids] = torch.where(x > 0, x / s.penalty, x * s.penalty)
    if s.temperature == 0:
        return v
    v = v / s.temperature
    assert s.top_k == 0
    if s.top_p < 1.0:
        probs, order = v.softmax(-1).sort(descending=True, stable=True)
        above = torch.cat([torch.zeros(1), probs.cumsum(-1)[:-1]])  # the mass ranked above each token
        keep = torch.zeros_like(v, dtype=torch.bool)
        keep[order[above < s.top_p]] = True
        v[~keep] = float("-inf")
    if s.min_p > 0:
        probs = v.softmax(-1)
        v[probs < s.min_p * probs.max()] = float("-inf")
    alive = torch.isfinite(v).nonzero()[:, 0]
    v[alive] = v[alive] + gumbel_noise(s.seed, len(seq), alive)
    return v


def hand_top2(scores: torch.Tensor) -> tuple[int, int | None, float | None]:
    values, order = scores.sort(descending=True, stable=True)
    if not bool(torch.isfinite(values[1])):
        return int(order[0]), None, None
    return int(order[0]), int(order[1]), float(values[0] - values[1])


@pytest.fixture(scope="module")
def prompt_ids(smol_engine) -> list[int]:
    return encode_prompt(smol_engine.tokenizer, PROMPT)


@pytest.mark.parametrize("preset", ["greedy", "studio", "paper"])
def test_the_recomputed_draw_is_vanillas_and_its_gap_the_hand_computed_one(smol_engine, prompt_ids, preset):
    engine = smol_engine
    config = GenerationConfig(max_new_tokens=N, method="ar", sampling=PRESETS[preset].with_(seed=11),
                              ignore_eos=True)
    ar: Result = engine.generate(prompt_ids, config).run()
    assert ar.n_tokens == N
    seq = prompt_ids + ar.token_ids
    vocab, banned = engine.model.cfg.vocab_size, engine.model.cfg.eos_token_ids
    with torch.inference_mode():  # one plain forward of the whole run: every position's logits in one call
        cache = engine.model.new_cache(len(seq))
        logits, _ = engine.model(torch.tensor(seq), torch.arange(len(seq)), cache)
    logits = logits[len(prompt_ids) - 1:-1, :vocab]  # row i: the logits that output token i was drawn from
    hand = [hand_top2(hand_scores(logits[i], seq[:len(prompt_ids) + i], config.sampling, banned)) for i in range(N)]
    # the hand computation is the draw: its top-1 is the token vanilla decoding drew, at every position
    assert [top1 for top1, _, _ in hand] == ar.token_ids

    picked = {0, next(i for i in range(5, N) if hand[i][1] is not None)}
    if preset != "greedy":  # a nucleus of one token: a draw without a runner-up
        picked.add(next(i for i in range(N) if hand[i][1] is None))
    for p in sorted(picked):
        other = (ar.token_ids[p] + 1) % vocab
        tokenswift = ar.token_ids[:p] + [other] + ar.token_ids[p + 1:]
        d = explain_divergence(engine, prompt_ids, config, ar.token_ids, tokenswift)
        top1, top2, gap = hand[p]
        raw = logits[p].sort(descending=True).values
        assert d == Divergence(position=p, vanilla_token=ar.token_ids[p], tokenswift_token=other, top1=top1,
                               top2=top2, gap=gap, logit_gap=float(raw[0] - raw[1])), (p, d, hand[p])
        assert d.top1 == ar.token_ids[p]
        if preset == "greedy":
            assert d.gap == d.logit_gap > 0  # no penalty, no noise: the raw logits' gap
        else:
            assert gap is None or gap > 0


def test_runs_that_end_apart_or_not_at_all(smol_engine, prompt_ids):
    config = GenerationConfig(max_new_tokens=12, method="ar", sampling=PRESETS["greedy"])
    ar = smol_engine.generate(prompt_ids, config).run().token_ids
    assert explain_divergence(smol_engine, prompt_ids, config, ar, list(ar)) is None
    shorter = explain_divergence(smol_engine, prompt_ids, config, ar, ar[:7])
    assert (shorter.position, shorter.vanilla_token, shorter.tokenswift_token, shorter.top1) == (7, ar[7], None, ar[7])
    with pytest.raises(ValueError, match="past max new tokens"):
        explain_divergence(smol_engine, prompt_ids, config, ar[:12], ar[:12] + [5])


def test_first_divergence() -> None:
    assert first_divergence([], []) is None
    assert first_divergence([1, 2], [1, 2]) is None
    assert first_divergence([], [1]) == 0
    assert first_divergence([1, 2], [1, 3, 4]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_format_gap() -> None:
    assert [format_gap(g) for g in (3.14159e-6, 0.0099, 0.034, 0.5, 1.9517, 2.345, 12.5, 123.4, 0.0, None)] == [
        "3.1e-06", "9.9e-03", "0.034", "0.50", "2.0", "2.3", "12", "123", "0", "∞"]


def test_a_divergence_round_trips_as_a_dict() -> None:
    d = Divergence(position=3, vanilla_token=7, tokenswift_token=None, top1=7, top2=None, gap=None, logit_gap=0.25)
    assert Divergence.from_dict(d.to_dict()) == d
    assert d.to_dict() == {"position": 3, "vanilla_token": 7, "tokenswift_token": None, "top1": 7, "top2": None,
                           "gap": None, "logit_gap": 0.25}
