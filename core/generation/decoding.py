"""The decode loop shared by every decoding method: prefill, steps, stopping, streaming and counting.

A `Generation` runs a step function (`StepFunction`: vanilla decoding's `vanilla_steps` here, TokenSwift's in
core/tokenswift/step.py, each bound to its engine; the engine keeps the registry) over a `Decoder` (the model and one
forward): iterate it for
`Step` events (new token ids, text delta, accepted drafts, tree size, timings); afterwards `.result` holds the
summary. Every method goes through the same `emit`, so all stop, stream and count alike.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from core.generation.sampling import Sampler, SamplingSettings
from core.generation.text import TextStream
from core.runtime.kv_cache import KVCache, PartialKVCache
from core.runtime.model import Transformer

PREFILL_CHUNK = 256
MAX_NEW_TOKENS = 1_000_000


class Decoder(Protocol):
    """What the decode loop needs of an engine: the model, its tokenizer and a forward pass."""

    model: Transformer
    tokenizer: Any

    @property
    def device(self) -> torch.device: ...

    @property
    def max_context(self) -> int: ...

    @property
    def max_block(self) -> int:
        """The most tokens one forward appends beyond the committed sequence."""

    def forward(self, tokens: Tensor, positions: Tensor, cache: KVCache | PartialKVCache,
                block_mask: Tensor | None = None, logits_rows: Tensor | slice | None = None
                ) -> tuple[Tensor, Tensor]: ...


@dataclass
class GenerationConfig:
    max_new_tokens: int = 512
    method: str = "ar"  # a name in the engine's registry of decoding methods (core/engine.py)
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False  # suppress end-of-sequence so exactly max_new_tokens come out

    def validate(self) -> "GenerationConfig":
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max new tokens must be an integer between 1 and {MAX_NEW_TOKENS}, "
                             f"got {self.max_new_tokens}")
        self.sampling.validate()
        return self


@dataclass
class Step:
    index: int
    token_ids: list[int]  # tokens this step added to the output
    text: str  # text delta (may lag a token behind when a character spans two tokens)
    accepted: int  # draft tokens accepted (the model's own token each step is not counted)
    from_ngram: int  # accepted drafts proposed by the n-gram table
    from_heads: int  # accepted drafts proposed by the heads only
    tree_size: int  # tokens verified in this step's forward (1 for vanilla decoding)
    seconds: float  # wall time of the step
    n_tokens: int  # output tokens so far
    tokens_per_s: float  # decode throughput so far
    forward_s: float = 0.0  # of `seconds`, the model's forwards; the rest is the step's own work (drafting, draws)


@dataclass
class Result:
    token_ids: list[int]
    text: str
    n_prompt: int
    prefill_s: float
    decode_s: float
    stop_reason: str  # eos | length | stop_string | cancelled
    steps: list[Step]
    n_resumed: int = 0  # leading output tokens that came from an earlier, resumed generation

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput of this generation (resumed tokens not counted)."""
        return (self.n_tokens - self.n_resumed) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Output tokens per decoding step (the model's own token included)."""
        return (self.n_tokens - self.n_resumed) / len(self.steps) if self.steps else 0.0

    def alpha(self, gamma: int = 4) -> float:
        """Acceptance rate as the paper defines it: accepted drafts / (gamma * steps)."""
        return sum(s.accepted for s in self.steps) / (gamma * len(self.steps)) if self.steps else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "text": self.text, "token_ids": self.token_ids, "n_tokens": self.n_tokens, "prefill_s": self.prefill_s,
            "decode_s": self.decode_s, "tokens_per_s": self.tokens_per_s, "stop_reason": self.stop_reason,
            "mean_accepted": self.mean_accepted, "alpha": self.alpha(),
            "steps": [{"new_tokens": len(s.token_ids), "accepted": s.accepted, "from_ngram": s.from_ngram,
                       "tree_size": s.tree_size, "seconds": s.seconds} for s in self.steps],
        }


class Generation:
    """One generation: prefill, then the steps of a decoding method, with shared stopping and streaming.

    `resume_ids`: output of an earlier, interrupted generation with the same prompt and settings; it counts towards
    `max_new_tokens` and the continuation equals what the uninterrupted generation would have produced.
    """

    def __init__(self, decoder: Decoder, prompt_ids: list[int], config: GenerationConfig, steps: StepFunction,
                 cancel: Callable[[], bool] | None = None, resume_ids: list[int] = ()):  # type: ignore[assignment]
        self.decoder = decoder
        self.step_function = steps
        self.config = config.validate()
        self.cancel = cancel or (lambda: False)
        if not prompt_ids:
            raise ValueError("the prompt has no tokens")
        limit = decoder.max_context
        if len(resume_ids) >= config.max_new_tokens:
            raise ValueError(f"nothing to resume: {len(resume_ids)} of {config.max_new_tokens} tokens already written")
        if len(prompt_ids) + config.max_new_tokens > limit:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max new tokens ({config.max_new_tokens}) exceeds "
                             f"the model's context of {limit} tokens")
        self.prompt_ids = list(prompt_ids)
        # The whole sequence: prompt, then output. A resumed generation starts with its earlier output already in
        # place; positions (and so the position-keyed draws) continue where they stopped, so the tokens that follow
        # are the ones an uninterrupted run would have written.
        self.tokens = list(prompt_ids) + list(resume_ids)
        # the same sequence as an array, for penalty windows without a list-to-tensor copy per draw (on the CPU,
        # where the draw reads them; numpy's indexing costs a fraction of a tensor's on these few ids)
        self.token_buf = np.zeros(len(prompt_ids) + config.max_new_tokens + 1, dtype=np.int64)
        self.token_buf[:len(self.tokens)] = self.tokens
        self.token_tensor = torch.from_numpy(self.token_buf)  # the same memory, for the kernels' walk
        cfg = decoder.model.cfg
        self.eos_ids = frozenset(cfg.eos_token_ids)
        banned = cfg.eos_token_ids if config.ignore_eos else ()
        self.sampler = Sampler(config.sampling, cfg.vocab_size, banned)
        self.stream = TextStream(decoder.tokenizer)
        self.steps: list[Step] = []
        self.n_resumed = len(resume_ids)
        self._text: list[str] = []  # the output text so far, as streamed, in pieces (`text` joins them)
        # its last characters, as many as a stop string can have before a step's delta (all of one but its last)
        self._straddle = max(map(len, self.config.stop_strings), default=1) - 1
        self._recent = ""
        self._append(self.stream.push(list(resume_ids)))
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.stop_reason = ""
        self.result: Result | None = None
        self.stats: dict[str, int] = {}  # method-specific counters (e.g. partial KV cache selections)

    # -- shared pieces ---------------------------------------------------------------------------------------------

    @property
    def n_out(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    def window(self, extra: list[int] = ()) -> Tensor:  # type: ignore[assignment]
        """Penalty window (token ids, [1, W] on the CPU) for the draw after the sequence followed by `extra`."""
        return self._window_ids(extra)[None]

    def _window_ids(self, extra: list[int]) -> Tensor:
        W, end = self.config.sampling.penalty_window, len(self.tokens)
        base = self.token_buf[max(0, end - max(0, W - len(extra))):end]
        if extra:
            tail = np.asarray(list(extra)[-W:], dtype=np.int64)
            base = np.concatenate([base, tail]) if len(extra) < W else tail
        return torch.from_numpy(base)  # a view: the ids before `end` never change

    def draw(self, logits_row: Tensor, extra: list[int] = ()) -> int:  # type: ignore[assignment]
        """Draw the token after the sequence (+ `extra` path tokens) from one row of logits."""
        if not extra:
            return self.sampler.draw_after(logits_row, self.token_tensor, len(self.tokens))
        return self.sampler.draw(logits_row, self._window_ids(extra), len(self.tokens) + len(extra))

    def walk(self, logits: Tensor, tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
        """The walk of a verified tree (nodes `tokens`, `parents` first; row i of logits [n, V] is node i's): from
        the root, draw the node's next token as `draw` would after the sequence and the path so far, and move to the
        child holding it; stop where none does. Returns the accepted nodes (the path) and the token drawn after them.
        One call of the kernels where they are built (Sampler.walk)."""
        walked = self.sampler.walk(logits, tokens, parents, self.token_tensor, len(self.tokens))
        if walked is not None:
            return walked
        node, path, nodes = 0, [], []
        while True:
            token = self.draw(logits[node], path)
            child = next((i for i in range(node + 1, len(tokens)) if parents[i] == node and tokens[i] == token), None)
            if child is None:
                return nodes, token
            node = child
            nodes.append(node)
            path.append(token)

    def new_cache(self) -> KVCache:
        # room for the prompt, the output and one verification block beyond it
        need = len(self.prompt_ids) + self.config.max_new_tokens + self.decoder.max_block
        return self.decoder.model.new_cache(need)

    def prefill(self, cache: KVCache) -> tuple[Tensor, Tensor]:
        """Run the prompt (and any resumed output) through the model in chunks; returns the last position's logits
        and hidden state."""
        t0 = time.perf_counter()
        ids = torch.tensor(self.tokens, dtype=torch.long, device=self.decoder.device)
        for start in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[start:start + PREFILL_CHUNK]
            positions = torch.arange(start, start + len(chunk), device=ids.device)
            logits, hidden = self.decoder.forward(chunk, positions, cache, logits_rows=slice(-1, None))
            cache.commit()
        self.prefill_s = time.perf_counter() - t0
        return logits[-1], hidden[-1]

    def emit(self, new_ids: list[int], started: float, accepted: int = 0, from_ngram: int = 0, from_heads: int = 0,
             tree_size: int = 1, forward_s: float = 0.0) -> Step | None:
        """Append a step's tokens, cutting at end-of-sequence, the token limit or a stop string.

        `started` is the step's time.perf_counter() at its start: the step's seconds run to the end of this call, so
        its bookkeeping (detokenising, stop strings) counts in the decode time like its forwards.
        Returns the step, or None if nothing was added. Sets `stop_reason` when the generation is over.
        """
        cfg, eos = self.config, self.eos_ids
        kept: list[int] = []
        for t in new_ids:
            if self.n_out + len(kept) >= cfg.max_new_tokens:
                self.stop_reason = "length"
                break
            kept.append(t)
            if t in eos and not cfg.ignore_eos:
                self.stop_reason = "eos"
                break
        if self.n_out + len(kept) >= cfg.max_new_tokens and not self.stop_reason:
            self.stop_reason = "length"
        accepted = min(accepted, max(0, len(kept) - 1))
        self.tokens.extend(kept)
        self.token_buf[len(self.tokens) - len(kept):len(self.tokens)] = kept
        text = self.stream.push(kept)
        if self.stop_reason:
            text += self.stream.flush()
        text = self._cut_at_stop_string(text)
        self._append(text)
        seconds = time.perf_counter() - started
        self.decode_s += seconds
        if not kept:
            return None
        new = self.n_out - self.n_resumed
        step = Step(len(self.steps), kept, text, accepted, min(from_ngram, accepted), min(from_heads, accepted),
                    tree_size, seconds, self.n_out, new / self.decode_s if self.decode_s > 0 else 0.0, forward_s)
        self.steps.append(step)
        return step

    @property
    def text(self) -> str:
        """The output text so far, as streamed. Kept in pieces, joined when read: appending to one string would copy
        all of it every step, a cost that grows with the text."""
        if len(self._text) > 1:
            self._text[:] = ["".join(self._text)]
        return self._text[0] if self._text else ""

    def _append(self, delta: str) -> None:
        if not delta:
            return
        self._text.append(delta)
        if self._straddle:
            tail = self._recent + delta
            self._recent = tail[max(0, len(tail) - self._straddle):]

    def _cut_at_stop_string(self, delta: str) -> str:
        """The delta up to (not including) the first stop string that the text now contains."""
        stops = self.config.stop_strings
        if not stops or not delta:
            return delta
        # a stop string may straddle the old text and the delta: search from where it could begin
        window = self._recent + delta
        hits = [window.find(s) for s in stops if s and s in window]
        if not hits:
            return delta
        self.stop_reason = "stop_string"
        return window[:min(hits)][len(self._recent):]

    def finish(self) -> Result:
        # The result's text is whole: it adds a character held back when the loop ended early (cancel, error),
        # which no step's text holds (the worker leaves it out of a resumable run's stored text).
        if self.stop_reason != "stop_string":
            self._append(self.stream.flush())
        self.result = Result(self.tokens[len(self.prompt_ids):], self.text, len(self.prompt_ids), self.prefill_s,
                             self.decode_s, self.stop_reason or "length", self.steps, self.n_resumed)
        return self.result

    # -- iteration -------------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Step]:
        steps = self.step_function(self)
        try:
            with torch.inference_mode():
                yield from steps
        finally:
            self.finish()

    def run(self) -> Result:
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def cancelled(self) -> bool:
        if self.cancel():
            self.stop_reason = "cancelled"
            return True
        return False


StepFunction = Callable[[Generation], Iterator[Step]]


def vanilla_steps(decoder: Decoder, gen: Generation) -> Iterator[Step]:
    """Vanilla decoding: one forward and one draw per token."""
    cache = gen.new_cache()
    logits, _ = gen.prefill(cache)
    eos = decoder.model.cfg.eos_token_ids
    # a step's token and position written into one buffer held for the whole generation: between two forwards, with
    # the caches cold, making two tensors costs more than writing two ids (as TreeInputs does for a tree)
    device = decoder.device
    on_cpu = device.type == "cpu"
    inputs = torch.zeros(2, 1, dtype=torch.long)
    rows, token_in, position_in = inputs.numpy(), inputs[0], inputs[1]
    while not gen.cancelled():
        t0 = time.perf_counter()
        token = gen.draw(logits)
        done = gen.n_out + 1 >= gen.config.max_new_tokens or token in eos
        forward_s = 0.0
        if not done:
            rows[:, 0] = token, len(gen.tokens)
            ids, pos = (token_in, position_in) if on_cpu else (token_in.to(device), position_in.to(device))
            t1 = time.perf_counter()
            logits, _ = decoder.forward(ids, pos, cache)
            forward_s = time.perf_counter() - t1
            logits = logits[0]
            cache.commit()
        step = gen.emit([token], t0, forward_s=forward_s)
        if step is not None:
            yield step
        if gen.stop_reason:
            return
