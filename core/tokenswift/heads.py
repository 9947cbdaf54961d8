"""TokenSwift's multi-token drafting heads, and their files.

Three chained residual heads on the frozen model: h_0 is the pre-final-norm hidden state of the last position,
h_k = h_{k-1} + W_k · RMSNorm_k(h_{k-1}), and logits_k = lm_head(post-norm_k(h_k)) with the model's own lm_head.
Head k predicts the token k+1 places ahead of the model's next token.

The optional root head (Hydra-style) predicts the same token as head 1, the one after the model's next token (the
root), but also reads the root itself: state = h_0 + W_down·SiLU(W_up·[RMSNorm(h_0); RMSNorm(embed(root))]). Knowing
the root, it is right far more often than head 1 (core/README.md has the held-out figures). It runs after the root is
drawn, outside the decoder's forward. Its state before the output norm estimates the model's hidden state at the
root, so a *chained* root head (`root_chain` levels, EAGLE-style) reads that state back with its own top draft to
draft the level after, and so on, where heads 2 and 3 know neither token above theirs.

The heads may score only a subset of the vocabulary (`vocab`, the ids the model actually writes): drafts need only a
top-k, and on a CPU the full lm_head is a large share of a decoder step. The verification always uses the full
vocabulary, so this never changes the output, only which drafts are proposed.

A heads file is safetensors with metadata naming its base model and a fingerprint of that model's config and
embeddings; loading it on another model fails with a clear error.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from core.generation.sampling import Sampler, rank_drafts
from core.runtime.kernels import cpu
from core.runtime.model import ModelConfig, NativeEmbedding, RMSNorm, Transformer
from core.runtime.skeleton import skeleton
from core.runtime.weights import NativeLinear, pack

FORMAT = "tokenswift-heads/1"

# One drafted level of the root head, its model, sampler and k bound (DraftHeads.root_drafter): (states [n, hidden],
# the row it reads, token, sequence position) -> (its state [1, hidden], its k drafts, their chances)
RootDraft = Callable[[Tensor, int, int, int], tuple[Tensor, list[int], list[float]]]


class HeadsError(ValueError):
    """A heads file is missing, malformed or made for another model."""


class RootHead(nn.Module):
    def __init__(self, hidden_size: int, width: int, eps: float = 1e-5, ids: Tensor | None = None):
        super().__init__()
        self.norm_h = RMSNorm(hidden_size, eps)
        self.norm_e = RMSNorm(hidden_size, eps)
        self.up = nn.Linear(2 * hidden_size, width)
        self.down = nn.Linear(width, hidden_size)
        self.norm_out = RMSNorm(hidden_size, eps)
        # The token ids it scores (empty: the heads' vocabulary). Running outside the compiled forward, it pays for
        # every lm_head row it reads, and the most frequent ids hold nearly all its right drafts.
        self.register_buffer("ids", ids if ids is not None else torch.empty(0, dtype=torch.long))

    def forward(self, h0: Tensor, root_embedding: Tensor) -> Tensor:
        """Pre-norm state [n, hidden] from hidden states h0 [n, hidden] and the roots' embeddings [n, hidden]: its
        estimate of the model's hidden state at the root, so a chained root head can read it as it reads h0."""
        x = torch.cat([self.norm_h(h0), self.norm_e(root_embedding)], dim=-1)
        return h0 + self.down(nn.functional.silu(self.up(x)))


class DraftHeads(nn.Module):
    def __init__(self, hidden_size: int, n_heads: int = 3, eps: float = 1e-5, vocab: Tensor | None = None,
                 root_width: int = 0, root_ids: Tensor | None = None):
        super().__init__()
        self.n_heads = n_heads
        self.norm_in = nn.ModuleList(RMSNorm(hidden_size, eps) for _ in range(n_heads))
        self.proj = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=False) for _ in range(n_heads))
        self.norm_out = nn.ModuleList(RMSNorm(hidden_size, eps) for _ in range(n_heads))
        self.root = RootHead(hidden_size, root_width, eps, root_ids) if root_width else None
        self.root_chain = 1  # levels the root head drafts, reading its own state back (trained so: train_heads)
        self.register_buffer("vocab", vocab if vocab is not None else torch.empty(0, dtype=torch.long))
        # "lm" / "root_lm": the model and the lm_head rows each scores there, a layer (native) or a weight [V', hidden]
        self._scorers: dict[str, tuple[Transformer, NativeLinear | Tensor]] = {}
        self.root_format: str | None = None  # the root head's own format on the kernels, if not its model's (to_native)
        # (model, the rows it scores there, the root head bound on the kernels for them): made once, checked each use
        self._root_native: tuple[Transformer, NativeLinear, Any] | None = None

    @classmethod
    def initial(cls, model: Transformer, n_heads: int = 3, vocab: Tensor | None = None,
                root_width: int = 0) -> "DraftHeads":
        """Fresh heads that start out predicting what the model itself predicts (zero residual, model's norm)."""
        cfg = model.cfg
        heads = cls(cfg.hidden_size, n_heads, cfg.rms_eps, vocab)
        for k in range(n_heads):
            nn.init.zeros_(heads.proj[k].weight)
            heads.norm_out[k].weight.data.copy_(model.norm.weight.detach().float())
        heads.add_root_head(model, root_width)
        return heads.to(device=model.device, dtype=model.dtype)

    def add_root_head(self, model: Transformer, width: int) -> None:
        """A fresh root head (none if width is 0) that starts out as the model's own next-token prediction."""
        self.root_chain = 1
        if not width:
            self.root = None
            return
        root = RootHead(model.cfg.hidden_size, width, model.cfg.rms_eps)
        nn.init.zeros_(root.down.weight)
        nn.init.zeros_(root.down.bias)
        root.norm_out.weight.data.copy_(model.norm.weight.detach().float())
        self.root = root.to(device=model.device, dtype=model.dtype)
        self._scorers.pop("root_lm", None)

    def keep_root_ids(self, ids: Tensor) -> None:
        """Restrict the root head to these token ids (sorted, within the heads' vocabulary)."""
        assert self.root is not None, "these heads have no root head"
        self.root.ids = ids.to(self.vocab.device)
        self._scorers.pop("root_lm", None)

    @property
    def root_ids(self) -> Tensor:
        """The token ids the root head scores (empty: the whole vocabulary)."""
        assert self.root is not None, "these heads have no root head"
        return self.root.ids if self.root.ids.numel() else self.vocab

    def states(self, h0: Tensor) -> list[Tensor]:
        """Post-norm states of each head, [n, hidden] each, for hidden states h0 [n, hidden]."""
        out, h = [], h0
        for k in range(self.n_heads):
            h = h + self.proj[k](self.norm_in[k](h))
            out.append(self.norm_out[k](h))
        return out

    def scorer(self, model: Transformer, which: str = "lm") -> NativeLinear | Tensor:
        """The lm_head rows the heads (`lm`) or the root head (`root_lm`) score, built once: on a native model a
        layer of those rows in the lm_head's own format (the same numbers; the root head's rows in its own format
        where to_native gave it one), else a weight [V', hidden]."""
        cached = self._scorers.get(which)
        if cached is not None and cached[0] is model:
            return cached[1]
        ids = self.vocab if which == "lm" else self.root_ids
        if isinstance(model.lm_head, NativeLinear):
            found = model.lm_head.rows(ids) if ids.numel() else model.lm_head
            if which == "root_lm" and self.root_format not in (None, found.packed.fmt):
                found = NativeLinear(pack(found.packed.dequantize(), self.root_format), found.bf16_out)
        else:
            found = model.lm_head.weight[ids].contiguous() if ids.numel() else model.lm_head.weight
        self._scorers[which] = (model, found)
        return found

    def logits(self, h0: Tensor, model: Transformer) -> Tensor:
        """[n_heads, n, V'] logits over the heads' vocabulary (fp32), for hidden states h0 [n, hidden]."""
        n = h0.shape[0]
        # one matrix product for all heads: the lm_head rows are read once
        states = torch.cat(self.states(h0))
        return self._score(states, self.scorer(model, "lm")).view(self.n_heads, n, -1)

    def root_logits(self, h0: Tensor, roots: Tensor, model: Transformer) -> Tensor:
        """[n, len(root_ids)] logits of the root head for hidden states h0 [n, hidden] followed by the tokens
        `roots` [n]."""
        return self.root_step(h0, roots, model)[1]

    def root_step(self, h0: Tensor, roots: Tensor, model: Transformer) -> tuple[Tensor, Tensor]:
        """The root head's pre-norm state [n, hidden] and its logits [n, len(root_ids)]. A chained root head
        (`root_chain` > 1) reads that state back with the token drafted from the logits, one level deeper."""
        assert self.root is not None, "these heads have no root head"
        native = self._native_root(model)
        if native is not None:  # one call of the kernels, the roots' embeddings looked up there too
            return tuple(native.step(h0, roots))
        state = self.root(h0, model.embed(roots))
        return state, self._score(self.root.norm_out(state), self.scorer(model, "root_lm"))

    def root_draft(self, h0: Tensor, token: int, model: Transformer, sampler: Sampler, k: int,
                   position: int) -> tuple[Tensor, list[int], list[float]]:
        """One drafted level: the root head's state [1, hidden] after h0 [1, hidden] and `token`, and its k most
        likely drafts for sequence `position` with their chances, ranked as the draw will draw there
        (Sampler.rank_drafts). On the kernels one call does both."""
        return self.root_drafter(model, sampler, k)(h0, 0, token, position)

    def root_drafter(self, model: Transformer, sampler: Sampler, k: int) -> RootDraft:
        """root_draft with `model`, `sampler` and `k` bound: its weights and settings looked up once, for a whole
        generation's levels (each runs between two forwards, where every lookup costs)."""
        native = self._native_root(model)
        if native is not None:  # (the kernels are built, so the sampler's draw is bound on them too)
            return cpu.kernel().RootDrafter(native, self.root_ids, sampler.native, k)
        assert self.root is not None, "these heads have no root head"
        return lambda h0, row, token, position: self.ranked(
            *self.root_step(h0[row:row + 1], torch.tensor([token], device=h0.device), model), sampler, k, position)

    def ranked(self, state: Tensor, logits: Tensor, sampler: Sampler, k: int,
               position: int) -> tuple[Tensor, list[int], list[float]]:
        """A drafted level from the root head's state and logits [1, len(root_ids)]: the k drafts for `position`
        ranked as the draw will draw there, as lists."""
        ids, p = sampler.rank_drafts(logits, k, position, self.root_ids)
        return state, ids.tolist()[0], p.tolist()[0]

    def _native_root(self, model: Transformer) -> Any | None:
        """The root head bound on the kernels (kernels/root_head.h: RootHead) with `model`'s embeddings and the lm_head
        rows it scores, made once for `model`; None where the root head does not run on the kernels."""
        bound = self._root_native
        if bound is not None and bound[0] is model and self._scorers.get("root_lm", (None, None))[1] is bound[1]:
            return bound[2]  # the same model and the same scored rows (any change of them drops the entry)
        assert self.root is not None, "these heads have no root head"
        rows = self.scorer(model, "root_lm")
        if not (isinstance(self.root.up, NativeLinear) and isinstance(rows, NativeLinear) and cpu.kernel() is not None
                and isinstance(model.embed, NativeEmbedding) and not model.bf16_activations and not rows.bf16_out):
            return None
        lin, meta = NativeLinear.listed((self.root.up, self.root.down, rows))
        code, data, d, m, bias, n = model.embed.table.kernel_args()
        norms = [self.root.norm_h.weight, self.root.norm_e.weight, self.root.norm_out.weight]
        native = cpu.kernel().RootHead(norms, self.root.norm_h.eps, lin + [data, d, m, bias], meta + [code, n])
        self._root_native = (model, rows, native)
        return native

    @staticmethod
    def _score(states: Tensor, rows: NativeLinear | Tensor) -> Tensor:
        """fp32 logits of post-norm states over lm_head rows."""
        return (rows(states) if isinstance(rows, NativeLinear) else nn.functional.linear(states, rows)).float()

    def to_native(self, fmt: str = "f32", root_fmt: str | None = None) -> None:
        """Run the heads' own matrices on the CPU kernels in `fmt`, as a native model runs its (the lm_head rows they
        score follow the model: `scorer`), and the root head's, with the lm_head rows it scores, in `root_fmt` if
        given. A quantized model's heads are quantized too (the engine: q8_0, the root head q4_1): the root head
        reads its matrices and rows once per drafted level, from memory, between the forwards, and drafts only
        choose what is verified, never a token."""
        for k in range(self.n_heads):
            if isinstance(self.proj[k], nn.Linear):
                self.proj[k] = NativeLinear.of(self.proj[k], fmt)
        if self.root is not None and isinstance(self.root.up, nn.Linear):
            own = root_fmt or fmt
            self.root.up, self.root.down = NativeLinear.of(self.root.up, own), NativeLinear.of(self.root.down, own)
            self.root_format = root_fmt
            self._scorers.pop("root_lm", None)

    def candidates(self, scores: Tensor, k: int, noise: Tensor | None = None,
                   ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """rank_drafts over the heads' scores; column j scores token ids[j] (default: the heads' vocabulary)."""
        return rank_drafts(scores, k, noise, self.vocab if ids is None else ids)


def fingerprint_ids(cfg: ModelConfig) -> list[int]:
    """The token ids whose embedding rows a fingerprint hashes: 64 spread over the vocabulary."""
    return list(range(0, cfg.vocab_size, max(1, cfg.vocab_size // 64)))[:64]


def fingerprint(cfg: ModelConfig, rows: Tensor) -> str:
    """Hash of the architecture and of the embedding rows of fingerprint_ids (hashed in bf16, so fp32 and bf16
    copies of one model agree)."""
    arch = json.dumps([cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                       cfg.intermediate_size, cfg.rope_theta])
    rows = rows.detach().to("cpu", torch.bfloat16).contiguous()
    return hashlib.sha256(arch.encode() + rows.view(torch.int16).numpy().tobytes()).hexdigest()[:24]


def model_fingerprint(model: Transformer) -> str:
    """`fingerprint` of a loaded model."""
    ids = torch.tensor(fingerprint_ids(model.cfg), device=model.device)
    with torch.inference_mode():  # the rows as any embedding (a native model's packed table too) looks them up
        return fingerprint(model.cfg, model.embed(ids))


def save_heads(heads: DraftHeads, path: Path, model: Transformer, base_model: str, extra: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).contiguous()
               for k, v in heads.state_dict().items()}
    # extra metadata (e.g. an earlier file's, re-saved) never overrides what identifies the file
    meta = {**(extra or {}), "root_chain": heads.root_chain, "format": FORMAT, "base_model": base_model,
            "fingerprint": model_fingerprint(model), "n_heads": str(heads.n_heads),
            "hidden_size": str(model.cfg.hidden_size)}
    save_file(tensors, str(path), metadata={k: str(v) for k, v in meta.items()})


def read_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def load_heads(path: Path, model: Transformer, base_model: str = "") -> DraftHeads:
    """Load heads for `model`; refuse files made for another model with a message naming both."""
    path = Path(path)
    if not path.is_file():
        raise HeadsError(f"heads file {path} does not exist")
    try:
        meta = read_metadata(path)
        with safe_open(str(path), framework="pt") as f:
            # copies: a tensor the heads kept from the file would keep its whole mapping resident
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    except Exception as e:
        raise HeadsError(f"heads file {path} is unreadable: {e}") from None
    if meta.get("format") != FORMAT:
        raise HeadsError(f"{path} is not a TokenSwift heads file (format {meta.get('format')!r})")
    if meta.get("fingerprint") != model_fingerprint(model):
        raise HeadsError(f"heads {path.name} were trained for {meta.get('base_model', '?')!r}, not for this model "
                         f"{base_model or model.cfg.arch!r} (fingerprint mismatch); train heads for it with "
                         f"`python -m core train-heads`")
    root_width = tensors["root.up.weight"].shape[0] if "root.up.weight" in tensors else 0
    if root_width:
        tensors.setdefault("root.ids", torch.empty(0, dtype=torch.long))  # files that score all the heads' ids
    with skeleton():  # weights are the file's: none initialised, none copied
        heads = DraftHeads(model.cfg.hidden_size, int(meta["n_heads"]), model.cfg.rms_eps, tensors.get("vocab"),
                           root_width, tensors.get("root.ids"))
    heads.load_state_dict(tensors, assign=True)
    heads.root_chain = int(meta.get("root_chain", 1))
    heads.meta = meta  # type: ignore[attr-defined]
    return heads.to(device=model.device, dtype=model.dtype).eval().requires_grad_(False)
