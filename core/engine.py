"""The engine: one loaded model, its drafting heads, the forward every decoding method calls, and the registry of
decoding methods.

It is the object the CLI, the worker and the benchmark hold: `engine.generate(prompt_ids, config)` runs the method
`config.method` names (METHODS) on it. The forward runs eagerly, or through fixed-size compiled graphs
(core/runtime/compiled.py) when `compile=True`; both compute the same function.
"""
from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import Tensor

from core.generation.decoding import Generation, GenerationConfig, Step, StepFunction, vanilla_steps
from core.generation.sampling import Sampler
from core.generation.text import byte_pieces
from core.runtime.compiled import CompiledRunner
from core.runtime.kernels.build import isa_level
from core.runtime.kv_cache import KVCache, PartialKVCache
from core.runtime.loading import LoadedModel, load_model, release_freed_memory, resolve
from core.runtime.model import Transformer
from core.tokenswift.heads import DraftHeads, HeadsError, RootDraft, load_heads
from core.tokenswift.options import DraftPlan, TokenSwiftOptions
from core.tokenswift.published import is_published_checkpoint, load_published_heads
from core.tokenswift.step import tokenswift_steps
from core.tokenswift.tree import native_trees

log = logging.getLogger(__name__)

# The decoding methods, by the name GenerationConfig.method gives: each yields a generation's steps on an engine.
METHODS: dict[str, Callable[[Engine, Generation], Iterator[Step]]] = {
    "ar": vanilla_steps,
    "tokenswift": tokenswift_steps,
}

# The formats of a native model's drafting heads and of its root head, by its lm_head's: the model's own, but a
# quantized model's heads are q8_0 and its root head q4_1 (DraftHeads.to_native says why).
HEADS_FORMAT = {"f32": ("f32", "f32"), "bf16": ("bf16", "bf16")}
QUANTIZED_HEADS_FORMAT = ("q8_0", "q4_1")


def find_heads(loaded: LoadedModel, heads: str | Path | None) -> DraftHeads | None:
    """The drafting heads `Engine.load` names by `heads` ("default", None, a file, a checkpoint folder or hub id)."""
    if heads is None:
        return None
    if heads == "default":
        path = loaded.default_heads_path()
        if path is not None and path.is_file():
            return load_heads(path, loaded.model, loaded.name)
        if loaded.folder is not None and is_published_checkpoint(loaded.folder):  # the paper's heads, inside
            return load_published_heads(loaded.folder, loaded.model, loaded.name, same_model=True)
        return None
    path = Path(heads).expanduser()
    if path.is_file():
        return load_heads(path, loaded.model, loaded.name)
    if not path.is_dir() and str(heads).count("/") == 1 and not str(heads).startswith((".", "/", "~")):
        path, _ = resolve(str(heads))  # a hub id: fetched where a hub is reachable, else a one-line error
    if is_published_checkpoint(path):
        same = loaded.folder is not None and path.resolve() == loaded.folder.resolve()
        return load_published_heads(path, loaded.model, loaded.name, same_model=same)
    raise HeadsError(f"heads {heads!r}: neither a heads file nor a TokenSwift checkpoint folder with heads inside")


class Engine:
    def __init__(self, loaded: LoadedModel, heads: DraftHeads | None = None,
                 options: TokenSwiftOptions | None = None, compile: bool = False):
        self.loaded = loaded
        self.model: Transformer = loaded.model
        self.tokenizer = loaded.tokenizer
        self.heads = heads
        self.runner: CompiledRunner | None = None
        self.notices: list[str] = []  # things the user should be told once (e.g. no heads)
        if self.model.native:
            if heads is not None:
                heads.to_native(*HEADS_FORMAT.get(self.model.lm_head.packed.fmt, QUANTIZED_HEADS_FORMAT))
            if compile:  # the native decoder is one call of our kernels: no graph would run it faster
                self.notice("a CPU model runs on its native kernels; compiled graphs are for CUDA")
                compile = False
        kernels = isa_level() if self.model.native else None
        self.options = (options or TokenSwiftOptions()).resolved(self.model.device, heads, kernels)
        if self.model.native and heads is not None:
            # the lm_head rows drafting scores, packed now: their transient copies go back with the load's below,
            # where built at the first step they would stay in the heap for good
            if self.plan.root_drafting:
                heads.scorer(self.model, "root_lm")
            if self.plan.graph_heads:  # (the three heads fill a level)
                heads.scorer(self.model, "lm")
        if compile:
            self.runner = self._compiled_runner()
        byte_pieces(self.tokenizer)  # the streaming detokeniser's table, built once, here rather than mid-generation
        native_trees()  # TokenSwift's trees (built once per machine): loaded now, not at a writer's first run
        # Everything loaded so far (torch, transformers, the tokenizer: millions of objects) lives as long as the
        # engine: kept out of the garbage collector's passes, which would otherwise walk it during generation.
        gc.collect()
        gc.freeze()
        release_freed_memory()

    @classmethod
    def load(cls, spec: str | None = None, heads: str | Path | None = "default", device: str | None = None,
             options: TokenSwiftOptions | None = None, compile: bool = False, weights: str = "auto") -> "Engine":
        """Load a model (`weights`: see load_model) and its heads: `heads="default"` takes the committed heads for
        known models if present, or the heads inside a published TokenSwift checkpoint (core/tokenswift/published.py);
        None runs without heads (n-gram drafting only); a heads file, or a published checkpoint (a folder, or a hub
        id) whose backbone is this model, loads those heads (and must match the model)."""
        loaded = load_model(spec, device=device, weights=weights)
        return cls(loaded, find_heads(loaded, heads), options, compile)

    def _compiled_runner(self) -> CompiledRunner:
        """Graphs for the decoder, with the three heads' logits inside when they draft a level, and the root head's
        step as a graph of its own when it drafts. The lm_head rows they read are built first."""
        plan, heads, model = self.plan, self.heads, self.model
        extra = side = None
        if heads is not None and plan.graph_heads:
            heads.scorer(model, "lm")
            extra = lambda x: heads.logits(x, model)  # noqa: E731
        if heads is not None and plan.root_drafting:
            heads.scorer(model, "root_lm")
            side = lambda h, roots: heads.root_step(h, roots, model)  # noqa: E731
        return CompiledRunner(model, extra=extra, side=side, side_name="the root head")

    @property
    def plan(self) -> DraftPlan:
        """Which drafter fills which tree level, from the options and the heads."""
        return DraftPlan(self.options, self.heads)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def max_context(self) -> int:
        return self.model.cfg.max_position

    @property
    def max_block(self) -> int:
        """The most tokens one forward appends beyond the committed sequence (compiled graphs pad up to a size)."""
        budget = self.options.tree_budget
        assert budget is not None  # resolved in __init__
        if self.runner is None:
            return budget + 1
        # a tree pads to the graph warm_up compiles for it, or to a larger one that is already ready
        return max(budget, self.runner.bucket(budget) or 0, self.runner.graph_size(budget) or 0) + 1

    def warm_up(self, progress: Callable[[str], None] | None = None) -> float:
        """Compile the graphs this engine's decoding uses (one token, one tree, the root head); seconds spent."""
        if self.runner is None:
            return 0.0
        return self.runner.warm_up(self._graph_sizes(), progress, side=True)

    def warm_up_plan(self) -> list[tuple[str, Callable[[], None]]]:
        """`warm_up` as separate steps, one graph each (CompiledRunner.plan); empty for an eager engine."""
        return [] if self.runner is None else self.runner.plan(self._graph_sizes(), side=True)

    def _graph_sizes(self) -> tuple[int, ...]:
        """One token, and the tree: on a GPU one graph of the tree's size (padding rows cost next to nothing there);
        on a CPU every size up to it, since gated trees vary in size and a padded row costs as much as a real one."""
        assert self.runner is not None and self.options.tree_budget is not None
        top = self.runner.bucket(self.options.tree_budget) or 1
        if self.device.type == "cuda":
            return tuple(sorted({1, top}))
        return tuple(s for s in self.runner.sizes if s <= top)

    def forward(self, tokens: Tensor, positions: Tensor, cache: KVCache | PartialKVCache,
                block_mask: Tensor | None = None, logits_rows: Tensor | slice | None = None) -> tuple[Tensor, Tensor]:
        """Logits (of `logits_rows`, default all) and hidden states of new tokens; see Transformer.forward."""
        if self.runner is not None and logits_rows is None:
            out = self.runner.forward(tokens, positions, cache, block_mask)
            if out is not None:
                return out[0], out[1]
        return self.model(tokens, positions, cache, block_mask, logits_rows)

    def forward_with_heads(self, tokens: Tensor, positions: Tensor, cache: KVCache | PartialKVCache,
                           block_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Like `forward` (all rows), plus the drafting heads' logits [n_heads, n, V'] of every row where a compiled
        graph computes them (one small matrix product more there, not another pass; DraftPlan.graph_heads). None
        otherwise: drafting reads the heads at one row only (the last accepted node) and computes them for it, which
        costs less eagerly than computing them for every row."""
        if self.runner is not None:
            out = self.runner.forward(tokens, positions, cache, block_mask)
            if out is not None:
                return out
        logits, hidden = self.model(tokens, positions, cache, block_mask)
        return logits, hidden, None

    def root_drafter(self, sampler: Sampler, k: int) -> RootDraft:
        """One drafted level of the root head (DraftHeads.root_drafter) for a generation drawing with `sampler`, its
        step through its compiled graph when there is one."""
        heads = self.heads
        assert heads is not None
        eager = heads.root_drafter(self.model, sampler, k)
        runner = self.runner
        if runner is None:
            return eager

        def draft(h0: Tensor, row: int, token: int, position: int) -> tuple[Tensor, list[int], list[float]]:
            out = runner.side_step(h0[row:row + 1], torch.tensor([token], device=h0.device))
            return eager(h0, row, token, position) if out is None else heads.ranked(*out, sampler, k, position)
        return draft

    def notice(self, message: str) -> None:
        """Something the user should be told once (the CLI prints them, the worker shows them in the header)."""
        if message not in self.notices:
            self.notices.append(message)
            log.info(message)

    def generate(self, prompt_ids: list[int], config: GenerationConfig, cancel: Callable[[], bool] | None = None,
                 resume_ids: list[int] = ()) -> Generation:  # type: ignore[assignment]
        """Start a generation with the method `config.method` names; iterate the result for steps, then read
        `.result`. `resume_ids`: see Generation."""
        method = METHODS.get(config.method)
        if method is None:
            raise ValueError(f"unknown method {config.method!r}; choose one of {', '.join(METHODS)}")
        steps: StepFunction = functools.partial(method, self)
        return Generation(self, prompt_ids, config, steps, cancel, resume_ids)
