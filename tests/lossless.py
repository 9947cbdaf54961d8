"""The losslessness check shared by the tests: TokenSwift's ids must equal vanilla decoding's, and where they ever
differ the first difference must be a numerical near-tie of the two candidates, never a real disagreement."""
from __future__ import annotations

from dataclasses import replace

import torch

from core.engine import Engine
from core.generation.decoding import GenerationConfig, Result
from core.generation.sampling import Sampler

NEAR_TIE = 1e-4


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def tie_gap(engine: Engine, prompt_ids: list[int], out: list[int], i: int, other: int, config: GenerationConfig) -> float:
    """Gap between the two candidate tokens' (perturbed) processed logits at output position i, recomputed by a
    plain causal forward of the common prefix."""
    seq = prompt_ids + out[:i]
    cache = engine.model.new_cache(len(seq) + 1)
    logits, _ = engine.model(torch.tensor(seq), torch.arange(len(seq)), cache, logits_rows=slice(-1, None))
    banned = engine.model.cfg.eos_token_ids if config.ignore_eos else ()
    sampler = Sampler(config.sampling, engine.model.cfg.vocab_size, banned)
    window = torch.tensor(seq[-config.sampling.penalty_window:])[None]
    scores = sampler.scores(logits, window)[0]
    if not config.sampling.greedy:
        scores = scores + sampler.noise(len(seq), scores.device)
    return float((scores[out[i]] - scores[other]).abs())


def check_against(engine: Engine, prompt_ids: list[int], config: GenerationConfig, ar: Result) -> Result:
    """Run TokenSwift and fail unless its ids equal vanilla decoding's `ar` (up to a near-tie)."""
    ts = engine.generate(prompt_ids, replace(config, method="tokenswift")).run()
    i = first_divergence(ar.token_ids, ts.token_ids)
    if i is not None:
        assert i < min(len(ar.token_ids), len(ts.token_ids)), f"lengths differ: {ar.n_tokens} vs {ts.n_tokens}"
        gap = tie_gap(engine, prompt_ids, ar.token_ids, i, ts.token_ids[i], config)
        assert gap < NEAR_TIE, (f"TokenSwift diverged from vanilla decoding at output token {i}: "
                                f"{ar.token_ids[i]} vs {ts.token_ids[i]}, gap {gap:.3g} is not a near-tie")
        print(f"note: near-tie at output token {i} (gap {gap:.2e}); sequences equal up to it")
    return ts


def assert_lossless(engine: Engine, prompt_ids: list[int], config: GenerationConfig) -> tuple[Result, Result]:
    """Run vanilla and TokenSwift decoding with the same settings and compare them."""
    ar = engine.generate(prompt_ids, replace(config, method="ar")).run()
    return ar, check_against(engine, prompt_ids, config, ar)
