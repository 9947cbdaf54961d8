"""The losslessness check shared by the tests: TokenSwift's ids must equal vanilla decoding's, every one of them.

No tolerance: on the paths we ship every row of a verified tree is computed with the floats of a one-token step
(core/runtime/kernels/), so a single differing id is a bug, reported with where it happened and the top-2 gap
of the processed logits there (which says how close a call it was, not that it is forgiven)."""
from __future__ import annotations

from dataclasses import replace

import torch

from core.engine import Engine
from core.generation.agreement import first_divergence
from core.generation.decoding import GenerationConfig, Result
from core.generation.sampling import Sampler


@torch.inference_mode()
def top2_gap(engine: Engine, prompt_ids: list[int], out: list[int], i: int, config: GenerationConfig) -> float:
    """The gap between the two best (perturbed) processed logits at output position i, by a one-token step."""
    seq = prompt_ids + out[:i]
    cache = engine.model.new_cache(len(seq) + 1)
    logits, _ = engine.model(torch.tensor(seq), torch.arange(len(seq)), cache, logits_rows=slice(-1, None))
    banned = engine.model.cfg.eos_token_ids if config.ignore_eos else ()
    sampler = Sampler(config.sampling, engine.model.cfg.vocab_size, banned)
    scores = sampler.scores(logits, torch.tensor(seq[-config.sampling.penalty_window:])[None])[0]
    if not config.sampling.greedy:
        scores = scores + sampler.noise(len(seq), device=scores.device)
    top = scores.topk(2).values
    return float(top[0] - top[1])


def check_against(engine: Engine, prompt_ids: list[int], config: GenerationConfig, ar: Result) -> Result:
    """Run TokenSwift and fail unless its ids equal vanilla decoding's `ar`, all of them."""
    ts = engine.generate(prompt_ids, replace(config, method="tokenswift")).run()
    i = first_divergence(ar.token_ids, ts.token_ids)
    if i is not None:
        where = "lengths differ" if i >= min(ar.n_tokens, ts.n_tokens) else (
            f"{ar.token_ids[i]} vs {ts.token_ids[i]}, top-2 gap there "
            f"{top2_gap(engine, prompt_ids, ar.token_ids, i, config):.3g}")
        raise AssertionError(f"TokenSwift diverged from vanilla decoding at output token {i} of {ar.n_tokens}: {where}")
    return ts


def assert_lossless(engine: Engine, prompt_ids: list[int], config: GenerationConfig) -> tuple[Result, Result]:
    """Run vanilla and TokenSwift decoding with the same settings and compare them."""
    ar = engine.generate(prompt_ids, replace(config, method="ar")).run()
    return ar, check_against(engine, prompt_ids, config, ar)
