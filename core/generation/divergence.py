"""Vanilla decoding's draw where two runs of the same prompt and settings first differ, recomputed.

This module owns `explain_divergence` and its record, `Divergence`: the position, both runs' tokens there, and the
top two of the sampler's final scores there with their gap (how close a call the draw was). The benchmark, the GPU
check and the studio's worker (for the Compare view) report a divergence through it; core/generation/agreement.py
finds the position and writes the gap.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import Tensor

from core.generation.agreement import first_divergence
from core.generation.decoding import Decoder, Generation, GenerationConfig, vanilla_steps


@dataclass(frozen=True)
class Divergence:
    """Vanilla decoding's draw at the first output position where two runs differ, as recomputed.

    `gap` is the top-1 score minus the top-2 score of the sampler's final scores there (processed logits plus the
    position's Gumbel noise; greedy: the processed logits), None when the filters left a single token (the draw had
    no runner-up: an infinite gap, which JSON cannot hold). `logit_gap` is the same gap in the model's raw logits,
    before any processing.
    """

    position: int  # output token index (0: the first generated token)
    vanilla_token: int | None  # None: that run ended before `position`
    tokenswift_token: int | None
    top1: int
    top2: int | None
    gap: float | None
    logit_gap: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Divergence:
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__})


def explain_divergence(decoder: Decoder, prompt_ids: Sequence[int], config: GenerationConfig,
                       vanilla_ids: Sequence[int], tokenswift_ids: Sequence[int]) -> Divergence | None:
    """Vanilla decoding's view of the first position p where `vanilla_ids` and `tokenswift_ids` differ (None if
    they do not): both runs' tokens at p and the top two of the sampler's final scores there.

    `decoder` is the engine (core/engine.py) that loaded the model; `config` the runs' generation config (its
    sampling settings, seed, `ignore_eos` and `max_new_tokens`; its method is ignored). The shared prefix
    (`vanilla_ids[:p]`) goes through the model the way vanilla decoding resumes a run: a `Generation` with the
    prefix as resumed output, its chunked prefill into its own cache (one forward per 256 tokens), then the draw's
    own processing (banned ids, the penalty over the window, temperature, top-k, top-p, min-p: `Sampler.scores`)
    and the Gumbel noise of (seed, prompt length + p). ValueError when p is not a position the config could have
    generated.

    The recomputation is a third float path: a prefill, where the runs computed position p with a one-token step
    (vanilla) or inside a token tree (TokenSwift). On our CPU kernels all three give the same floats; elsewhere
    (PyTorch's operators, bf16, CUDA) they may not, so the gap is indicative: a tiny gap means a near-tie that
    rounding flipped, a large one a real bug. `top1` is the token vanilla decoding draws from these scores.
    """
    p = first_divergence(vanilla_ids, tokenswift_ids)
    if p is None:
        return None
    if p >= config.max_new_tokens:
        raise ValueError(f"the runs differ at output token {p}, past max new tokens ({config.max_new_tokens})")
    # the generation is only set up and prefilled: its steps are never iterated
    steps = functools.partial(vanilla_steps, decoder)
    gen = Generation(decoder, list(prompt_ids), replace(config, method="ar"), steps, resume_ids=list(vanilla_ids[:p]))
    with torch.inference_mode():
        logits, _ = gen.prefill(gen.new_cache())
        sampler = gen.sampler
        scores = sampler.scores(logits[None], gen.window())[0]
        if not sampler.s.greedy:
            # as Sampler.choose: noise on the tokens the filters left, the others stay at -inf
            alive = torch.isfinite(scores).nonzero()[:, 0]
            scores[alive] = scores[alive] + sampler.noise(len(gen.tokens), alive, scores.device)
        top1, top2, gap = _top2(scores)
        _, _, logit_gap = _top2(logits[:sampler.vocab].float())
    assert logit_gap is not None  # the raw logits are finite

    def at(ids: Sequence[int]) -> int | None:
        return int(ids[p]) if p < len(ids) else None

    return Divergence(p, at(vanilla_ids), at(tokenswift_ids), top1, top2, gap, logit_gap)


def _top2(scores: Tensor) -> tuple[int, int | None, float | None]:
    """The best and second-best index of a 1-d score tensor (the lowest index first among equals, as the draw's
    argmax) and their difference in the tensor's own dtype; no second when only one score is finite."""
    first = int(scores.argmax())
    rest = scores.clone()
    rest[first] = float("-inf")
    second = int(rest.argmax())
    if not bool(torch.isfinite(rest[second])):
        return first, None, None
    return first, second, float(scores[first] - scores[second])
