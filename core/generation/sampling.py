"""Sampling settings, logits processing (contextual penalty, temperature, top-k, top-p, min-p) and the
position-keyed draw.

Every decoder turns logits into a token the same way: `choose(process(logits, window), position)`. The random
part of a draw at sequence position t depends only on (seed, t): Gumbel noise, a hash of (seed, t, token id) for
each token, added to the processed logits, then argmax (the Gumbel-max trick samples exactly softmax(logits / T)
over the tokens that survive filtering; only those need their noise). So any decoder that computes the same logits
at position t emits the same token: vanilla decoding and TokenSwift's tree verification agree token for token
wherever the model gives a verified row the floats of a one-token step (what the CPU kernels guarantee,
core/runtime/kernels/cpu.cpp).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from core.runtime.kernels.cpu import kernel

MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.7  # 0 means greedy
    top_p: float = 0.9  # 1 disables
    top_k: int = 0  # 0 disables
    min_p: float = 0.0  # 0 disables
    penalty: float = 1.1  # contextual penalty θ; 1 disables
    penalty_window: int = 1024  # W: the penalty covers the distinct tokens among the last W
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> "SamplingSettings":
        """Raise ValueError with a readable message for out-of-range settings; return self otherwise."""
        checks = [
            (0 <= self.temperature <= 5, f"temperature must be between 0 and 5 (0 = greedy), got {self.temperature}"),
            (0 < self.top_p <= 1, f"top-p must be in (0, 1], got {self.top_p}"),
            (isinstance(self.top_k, int) and 0 <= self.top_k <= 100_000,
             f"top-k must be an integer >= 0, got {self.top_k}"),
            (0 <= self.min_p < 1, f"min-p must be in [0, 1), got {self.min_p}"),
            (1 <= self.penalty <= 3, f"penalty θ must be between 1 and 3 (1 = off), got {self.penalty}"),
            (isinstance(self.penalty_window, int) and 1 <= self.penalty_window <= 1_000_000,
             f"penalty window must be an integer between 1 and 1000000, got {self.penalty_window}"),
            (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED,
             f"seed must be an integer in [0, 2^63), got {self.seed}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingSettings":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d and d[k] is not None}
        return cls(**known)

    def with_(self, **changes: Any) -> "SamplingSettings":
        return replace(self, **changes)


# Named presets. "studio" is the default for writing: on the small default model the paper's settings soon degenerate
# into non-words, while these stay readable over long texts.
PRESETS: dict[str, SamplingSettings] = {
    "studio": SamplingSettings(temperature=0.7, top_p=0.9, top_k=0, min_p=0.0, penalty=1.1, penalty_window=1024),
    "paper": SamplingSettings(temperature=1.0, top_p=1.0, top_k=0, min_p=0.1, penalty=1.2, penalty_window=1024),
    "greedy": SamplingSettings(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, penalty=1.0, penalty_window=1024),
}


def apply_penalty(logits: Tensor, windows: Tensor, theta: float) -> Tensor:
    """Contextual penalty in place: for each row, every distinct token id in its window row is penalised once.

    `windows` is [rows, W] of token ids; a row shorter than W is padded by repeating one of its own ids, which is
    harmless because gathering and scattering the same id twice writes the same value (as CTRL/HF do).
    """
    if theta == 1.0 or windows.numel() == 0:
        return logits
    windows = windows.to(logits.device)
    picked = logits.gather(1, windows)
    picked = torch.where(picked > 0, picked / theta, picked * theta)
    return logits.scatter_(1, windows, picked)


def filter_logits(logits: Tensor, s: SamplingSettings) -> Tensor:
    """Temperature, top-k, top-p, min-p on [rows, V] fp32 logits (in Hugging Face's order); in place where possible."""
    if s.greedy:
        return logits
    if s.temperature != 1.0:
        logits.div_(s.temperature)
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[:, -1:]
        logits.masked_fill_(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        logits.masked_fill_(~nucleus(logits, s.top_p), float("-inf"))
    if s.min_p > 0:
        probs = logits.softmax(dim=-1)
        drop = probs < s.min_p * probs.max(dim=-1, keepdim=True).values
        logits.masked_fill_(drop, float("-inf"))
    return logits


def nucleus(logits: Tensor, top_p: float) -> Tensor:
    """Mask of the top-p set: the fewest most likely tokens whose probabilities sum to at least `top_p`.

    The same set as Hugging Face's top-p, which sorts the whole vocabulary every draw; here it is found from a top-k
    that grows until it covers `top_p`: usually a few dozen ids do.
    """
    probs = logits.softmax(dim=-1)
    vocab = logits.shape[-1]
    k = min(64, vocab)
    while True:
        top, idx = probs.topk(k, dim=-1)
        cum = top.cumsum(dim=-1)
        if k == vocab or bool((cum[:, -1] >= top_p).all()):
            break
        k = min(k * 8, vocab)
    # rank j is kept iff the mass ranked above it is still short of top_p; the most likely token always is
    kept_here = torch.cat([torch.ones_like(cum[:, :1], dtype=torch.bool), cum[:, :-1] < top_p], dim=-1)
    return torch.zeros_like(logits, dtype=torch.bool).scatter_(1, idx, kept_here)


def _cpu_float(t: Tensor) -> Tensor:
    """t as the kernels read it: float32 on the CPU. A tensor already so is passed as it is: between two forwards
    every operator called costs more than its work, the caches cold."""
    return t if t.dtype == torch.float32 and t.device.type == "cpu" else t.float().cpu()


def _mix(seed: int, position: int) -> int:
    # splitmix64 of (seed, position): neighbouring positions get unrelated generator seeds.
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & (2**63 - 1)


def gumbel_noise(seed: int, position: int, ids: Tensor | int) -> Tensor:
    """The Gumbel noise of token `ids` (or of every id below an int) at sequence position `position`: a pure function
    of (seed, position, id), float32 on the CPU. Each id's uniform draw is splitmix64 of (seed, position)'s key and the
    id (counter-based, so any subset of ids costs only its own size)."""
    ids = torch.arange(ids) if isinstance(ids, int) else ids
    z = np.uint64(_mix(seed, position)) + ids.cpu().numpy().astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53  # in (0, 1)
    return torch.from_numpy((-np.log(-np.log(u))).astype(np.float32))


def rank_drafts(scores: Tensor, k: int, noise: Tensor | None = None,
                ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Top-k token ids and their estimated chance of being drawn, per row of a drafter's scores [rows, V'] (its
    logits processed as the sampler processes the model's: Sampler.draft_scores): [rows, k] each. Column j scores
    token ids[j] (None or empty: token j).

    With `noise` [rows, V'] (the sampler's Gumbel noise at each row's position, for the columns' tokens), the
    drafts are ranked as the sampler will draw there: scores + noise. Sampling draws argmax(scores + noise) with
    noise fixed by (seed, position, token), so if the drafter matched the model its top-1 would be exactly the drawn
    token; an inexact drafter's top-1 is drawn more often so too.
    """
    subset = ids is not None and ids.numel() > 0
    x = scores.float()
    if noise is not None:
        x = x + noise
    p, idx = x.softmax(-1).nan_to_num_(0.0).topk(k, dim=-1)  # (a row the filters emptied proposes nothing likely)
    return (ids[idx] if subset else idx), p


class Sampler:
    """Processes logits and draws tokens for one generation (fixed settings, fixed vocabulary)."""

    def __init__(self, settings: SamplingSettings, vocab: int, banned: tuple[int, ...] = ()):
        self.s = settings
        self.vocab = vocab
        self.banned = list(banned)  # e.g. end-of-sequence ids when writing to full length
        self._banned_ids = torch.tensor(self.banned, dtype=torch.long)
        self._no_ids = torch.empty(0, dtype=torch.long)  # rank_drafts' columns where column j is token j

    def noise(self, position: int, ids: Tensor | None = None, device: torch.device | str = "cpu") -> Tensor:
        """The draw's Gumbel noise at `position` for token `ids` (None: the whole vocabulary), on `device`."""
        return gumbel_noise(self.s.seed, position, self.vocab if ids is None else ids).to(device)

    def scores(self, logits: Tensor, windows: Tensor) -> Tensor:
        """Processed logits [rows, V] (a fresh tensor) for rows whose penalty windows are `windows` [rows, W]."""
        out = self._without_banned(logits[:, : self.vocab])
        apply_penalty(out, windows, self.s.penalty)
        return filter_logits(out, self.s)

    def draft_scores(self, logits: Tensor, ids: Tensor | None = None) -> Tensor:
        """A drafting head's logits [rows, V'] over token `ids` (None: the whole vocabulary) processed as `scores`
        processes the model's, less the penalty: banned ids out, then temperature and filters (over the head's own
        mass, so a draft the nucleus would cut is not proposed). The penalty is left out: a head's logits are flatter
        than the model's, so the penalty would move its drafts off repeated tokens far more often than it moves the
        model's draws, and the drafts would be drawn less often (core/README.md)."""
        return filter_logits(self._without_banned(logits, ids), self.s)

    def rank_drafts(self, logits: Tensor, k: int, first: int, ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The k most likely drafts of each row of a drafter's logits [rows, V'] (column j: token ids[j]; None or
        empty: token j), row i for sequence position first + i, ranked as the draw will draw there: `draft_scores`
        plus the position's Gumbel noise (rank_drafts). Token ids and chances, [rows, k] each. One call of our CPU
        kernel where it is built (the draw's own filters: kernels/draw.h), else PyTorch's operators."""
        subset = ids if ids is not None and ids.numel() else None
        native = kernel() if logits.device.type == "cpu" else None
        if native is None:
            noise = None if self.s.greedy else torch.stack(
                [self.noise(first + i, subset, logits.device) for i in range(logits.shape[0])])
            return rank_drafts(self.draft_scores(logits, subset), k, noise, subset)
        s = self.s
        keys = [_mix(s.seed, first + i) for i in range(logits.shape[0])]
        columns = subset if subset is not None else self._no_ids
        ranked, p = native.rank_drafts(_cpu_float(logits), columns, self._banned_ids, s.temperature, s.top_p, s.top_k,
                                       s.min_p, keys, k)
        return ranked, p

    def _without_banned(self, logits: Tensor, ids: Tensor | None = None) -> Tensor:
        """An fp32 copy of logits [rows, V'] with the banned ids at -inf; column j scores token ids[j] (None or
        empty: token j)."""
        out = logits.float().clone()
        if self.banned:
            if ids is not None and ids.numel():
                out[:, torch.isin(ids, torch.tensor(self.banned, device=ids.device))] = float("-inf")
            else:
                out[:, self.banned] = float("-inf")
        return out

    @functools.cached_property
    def native(self) -> Any | None:
        """This sampler's draw on our CPU kernels, its settings bound once (kernels/draw.h: Draw; it defines the
        draw wherever it runs, both decoders calling it alike); None where the kernels are not built."""
        native, s = kernel(), self.s
        return None if native is None else native.Draw(self.vocab, self._banned_ids, s.temperature, s.top_p, s.top_k,
                                                      s.min_p, s.penalty, s.penalty_window, s.seed)

    def draw(self, logits: Tensor, window: Tensor, position: int) -> int:
        """The token drawn at sequence `position` from one row of logits [V] whose penalty window is `window` [W]:
        `choose(scores(...))` in one pass of our CPU kernel where it is built, else PyTorch's operators."""
        native = self.native
        if native is None:
            return int(self.choose(self.scores(logits[None], window[None]), [position])[0])
        return native.draw(logits, window if window.device.type == "cpu" else window.cpu(), position)

    def draw_after(self, logits: Tensor, history: Tensor, length: int) -> int:
        """`draw` after the sequence `history[:length]` (int64 on the CPU: the buffer itself, not a slice of it), at
        position `length`: the window is the sequence's last ids."""
        native = self.native
        if native is None:
            return self.draw(logits, history[max(0, length - self.s.penalty_window):length], length)
        return native.next(logits, history, length)  # (the kernel takes logits of any float type and device)

    def walk(self, logits: Tensor, tokens: list[int], parents: list[int], history: Tensor,
             length: int) -> tuple[list[int], int] | None:
        """Generation.walk in one call of our CPU kernel (kernels/draw.h: Draw.walk, each draw its `draw`) after the
        sequence `history[:length]` (as `draw_after` takes it); None where the kernels are not built."""
        native = self.native
        return None if native is None else native.walk(logits, tokens, parents, history, length)

    def choose(self, scores: Tensor, positions: list[int]) -> Tensor:
        """The token drawn at each row; row i is the draw for sequence position positions[i]: the argmax of the
        scores plus the noise, over the tokens the filters left (the others score -inf whatever their noise)."""
        if self.s.greedy:
            return scores.argmax(dim=-1)
        drawn = []
        for row, position in zip(scores, positions):
            alive = torch.isfinite(row).nonzero()[:, 0]
            drawn.append(alive[(row[alive] + self.noise(position, alive, row.device)).argmax()])
        return torch.stack(drawn)
