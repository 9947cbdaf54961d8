"""TokenSwift's published checkpoints: the paper's trained heads, read from inside its whole-model folders.

The paper's checkpoints (hub ids `TokenSwift/TokenSwift-Qwen2.5-1.5B`, `-Llama-3.1-8B`, `-Yarn-Llama-2-7b-128k`, ...)
are Hugging Face folders whose config.json has `medusa_heads` (3) and whose weights hold, beside the backbone,
`model.medusa_layers.{k}.linear.weight` [H, H] (no bias), `.input_layernorm.weight` and `.post_layernorm.weight` [H].
Head k computes h = h + linear(input_layernorm(h)) from the last decoder layer's output before the final norm,
chained, and drafts with lm_head(post_layernorm(h)) (the reference: their models/modeling_llama3_1.py, MedusaModel).
That is exactly DraftHeads' structure: input_layernorm is `norm_in[k]`, linear `proj[k]`, post_layernorm
`norm_out[k]`, with the norms' epsilon the model's `rms_norm_eps`, no root head and the whole vocabulary. So the
backbone loads through the runtime like any checkpoint (it ignores the extra tensors) and this module reads only the
heads' tensors, with no training.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from core.runtime.loading import ModelLoadError, read_config
from core.runtime.model import ModelConfig, Transformer
from core.tokenswift.heads import DraftHeads, HeadsError, fingerprint, fingerprint_ids, model_fingerprint

PREFIX = "model.medusa_layers."
FORMAT = "tokenswift-published"  # heads.meta["format"] of heads read from such a checkpoint
# their tensor names -> ours, per head
NAMES = {"linear.weight": "proj", "input_layernorm.weight": "norm_in", "post_layernorm.weight": "norm_out"}
HEAD_KEY = re.compile(re.escape(PREFIX) + r"(\d+)\.(.+)$")


def configured_heads(folder: Path) -> int:
    """The `medusa_heads` of a checkpoint folder's config.json (0: none, or no readable config)."""
    try:
        return int(json.loads((Path(folder) / "config.json").read_text()).get("medusa_heads") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def is_published_checkpoint(folder: Path) -> bool:
    """Whether `folder` is a checkpoint with TokenSwift heads inside (its config names them, or its weights hold
    them: a config saved by plain transformers may drop the key)."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    return configured_heads(folder) > 0 or bool(_head_tensor_files(folder))


def _head_tensor_files(folder: Path) -> dict[str, Path]:
    """Each heads tensor name -> the safetensors file holding it (reads only the files' headers)."""
    found: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            found.update({k: path for k in f.keys() if k.startswith(PREFIX)})
    return found


def _read(files: dict[str, Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k, p in files.items() if p == path})
    return out


def checkpoint_fingerprint(folder: Path) -> str:
    """model_fingerprint of the backbone stored in `folder`, from its config and a few embedding rows read straight
    from the files (the backbone stays frozen when the heads are trained, so it is the base model's)."""
    cfg = ModelConfig.from_hf(read_config(folder))
    name = "model.embed_tokens.weight"
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            if name in f.keys():
                table = f.get_slice(name)  # row by row: the whole table of a large model is not read
                rows = torch.cat([table[i:i + 1] for i in fingerprint_ids(cfg)])
                return fingerprint(cfg, rows)
    raise HeadsError(f"{folder}: no {name} in its safetensors files, so its base model cannot be checked")


def load_published_heads(folder: Path, model: Transformer, base_model: str = "", same_model: bool = False
                         ) -> DraftHeads:
    """The heads inside a published TokenSwift checkpoint folder, as DraftHeads for `model`.

    `same_model`: `model` was loaded from this very folder. Otherwise the folder's backbone must be `model` (the
    heads were trained on its hidden states): a checkpoint for another base model is refused, naming both.
    """
    folder = Path(folder)
    files = _head_tensor_files(folder) if folder.is_dir() else {}
    if not files:
        raise HeadsError(f"{folder} holds no TokenSwift heads ({PREFIX}* tensors in *.safetensors)")
    cfg = model.cfg
    if not same_model:
        try:
            theirs = checkpoint_fingerprint(folder)
        except (ModelLoadError, ValueError) as e:
            raise HeadsError(f"heads checkpoint {folder}: {e}") from None
        if theirs != model_fingerprint(model):
            raise HeadsError(f"the heads in {folder} were trained on that folder's own backbone, not on this model "
                             f"{base_model or cfg.arch!r} (fingerprint mismatch); load the checkpoint itself as the "
                             f"model instead")
    tensors = _read(files)
    per_head: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = HEAD_KEY.match(key)
        if m is None or m.group(2) not in NAMES:
            raise HeadsError(f"{folder}: unexpected heads tensor {key}")
        per_head.setdefault(int(m.group(1)), {})[NAMES[m.group(2)]] = tensor
    n = len(per_head)
    configured = configured_heads(folder)
    if sorted(per_head) != list(range(n)) or (configured and configured != n):
        raise HeadsError(f"{folder}: heads {sorted(per_head)} in the weights, medusa_heads={configured} in config")
    H = cfg.hidden_size
    state: dict[str, torch.Tensor] = {"vocab": torch.empty(0, dtype=torch.long)}  # the whole vocabulary
    for k, parts in per_head.items():
        shapes = {"proj": (H, H), "norm_in": (H,), "norm_out": (H,)}
        for ours, shape in shapes.items():
            if ours not in parts or tuple(parts[ours].shape) != shape:
                raise HeadsError(f"{folder}: head {k} lacks {ours} of shape {shape} for hidden size {H}")
            state[f"{ours}.{k}.weight"] = parts[ours]
    heads = DraftHeads(H, n, cfg.rms_eps)
    heads.load_state_dict(state)
    heads.meta = {"format": FORMAT, "base_model": base_model, "source": str(folder),  # type: ignore[attr-defined]
                  "n_heads": str(n)}
    return heads.to(device=model.device, dtype=model.dtype).eval().requires_grad_(False)
