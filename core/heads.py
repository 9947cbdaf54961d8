"""TokenSwift's multi-token drafting heads, and their files.

Three chained residual heads on the frozen model: h_0 is the pre-final-norm hidden state of the last position,
h_k = h_{k-1} + W_k · RMSNorm_k(h_{k-1}), and logits_k = lm_head(post-norm_k(h_k)) with the model's own lm_head.
Head k predicts the token k+1 places ahead of the model's next token.

The heads may score only a subset of the vocabulary (`vocab`, the ids the model actually writes): drafts need only a
top-k, and on a CPU the full 49K-row lm_head costs as much as a third of a decoder step. The verification always uses
the full vocabulary, so this never changes the output, only which drafts are proposed.

A heads file is safetensors with metadata naming its base model and a fingerprint of that model's config and
embeddings; loading it on another model fails with a clear error.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from core.model import RMSNorm, Transformer

FORMAT = "tokenswift-heads/1"


class HeadsError(ValueError):
    """A heads file is missing, malformed or made for another model."""


class DraftHeads(nn.Module):
    def __init__(self, hidden_size: int, n_heads: int = 3, eps: float = 1e-5, vocab: Tensor | None = None):
        super().__init__()
        self.n_heads = n_heads
        self.norm_in = nn.ModuleList(RMSNorm(hidden_size, eps) for _ in range(n_heads))
        self.proj = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=False) for _ in range(n_heads))
        self.norm_out = nn.ModuleList(RMSNorm(hidden_size, eps) for _ in range(n_heads))
        self.register_buffer("vocab", vocab if vocab is not None else torch.empty(0, dtype=torch.long))
        self._lm_rows: Tensor | None = None

    @classmethod
    def initial(cls, model: Transformer, n_heads: int = 3, vocab: Tensor | None = None) -> "DraftHeads":
        """Fresh heads that start out predicting what the model itself predicts (zero residual, model's norm)."""
        cfg = model.cfg
        heads = cls(cfg.hidden_size, n_heads, cfg.rms_eps, vocab)
        for k in range(n_heads):
            nn.init.zeros_(heads.proj[k].weight)
            heads.norm_out[k].weight.data.copy_(model.norm.weight.detach().float())
        return heads.to(device=model.device, dtype=model.dtype)

    def states(self, h0: Tensor) -> list[Tensor]:
        """Post-norm states of each head, [n, hidden] each, for hidden states h0 [n, hidden]."""
        out, h = [], h0
        for k in range(self.n_heads):
            h = h + self.proj[k](self.norm_in[k](h))
            out.append(self.norm_out[k](h))
        return out

    def lm_weight(self, model: Transformer) -> Tensor:
        """The lm_head rows the heads score: the whole vocabulary, or the subset (cached)."""
        if self.vocab.numel() == 0:
            return model.lm_head.weight
        if self._lm_rows is None or self._lm_rows.device != model.device:
            self._lm_rows = model.lm_head.weight[self.vocab].contiguous()
        return self._lm_rows

    def logits(self, h0: Tensor, model: Transformer) -> Tensor:
        """[n_heads, n, V'] logits over the heads' vocabulary (fp32), for hidden states h0 [n, hidden]."""
        n = h0.shape[0]
        # one matrix product for all heads: the lm_head rows are read once
        states = torch.cat(self.states(h0))
        return torch.nn.functional.linear(states, self.lm_weight(model)).float().view(self.n_heads, n, -1)

    def candidates(self, logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Top-k token ids and probabilities per head from one position's logits [n_heads, V']: [n_heads, k] each."""
        p, idx = logits.float().softmax(-1).topk(k, dim=-1)
        return (self.vocab[idx] if self.vocab.numel() else idx), p


def model_fingerprint(model: Transformer) -> str:
    """Hash of the architecture and of a slice of the token embeddings (in bf16, so fp32 and bf16 loads agree)."""
    cfg = model.cfg
    arch = json.dumps([cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                       cfg.intermediate_size, cfg.rope_theta])
    rows = model.embed.weight[:: max(1, cfg.vocab_size // 64)][:64].detach().to("cpu", torch.bfloat16)
    return hashlib.sha256(arch.encode() + rows.view(torch.int16).numpy().tobytes()).hexdigest()[:24]


def save_heads(heads: DraftHeads, path: Path, model: Transformer, base_model: str, extra: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).contiguous()
               for k, v in heads.state_dict().items()}
    meta = {"format": FORMAT, "base_model": base_model, "fingerprint": model_fingerprint(model),
            "n_heads": str(heads.n_heads), "hidden_size": str(model.cfg.hidden_size), **(extra or {})}
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
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise HeadsError(f"heads file {path} is unreadable: {e}") from None
    if meta.get("format") != FORMAT:
        raise HeadsError(f"{path} is not a TokenSwift heads file (format {meta.get('format')!r})")
    if meta.get("fingerprint") != model_fingerprint(model):
        raise HeadsError(f"heads {path.name} were trained for {meta.get('base_model', '?')!r}, not for this model "
                         f"{base_model or model.cfg.arch!r} (fingerprint mismatch); train heads for it with "
                         f"`python -m core train-heads`")
    heads = DraftHeads(model.cfg.hidden_size, int(meta["n_heads"]), model.cfg.rms_eps, tensors.get("vocab"))
    heads.load_state_dict(tensors)
    heads.meta = meta  # type: ignore[attr-defined]
    return heads.to(device=model.device, dtype=model.dtype).eval().requires_grad_(False)
