"""Which models a studio offers its writers: its own model, and on a GPU with a reachable hub TokenSwift's published
checkpoints (the paper's trained heads inside), each with what it needs in GPU memory.

The sizes are computed from the checkpoints' public configurations (parameters, layers, KV heads, head size): bf16
weights take two bytes a parameter, the KV cache 2 x layers x KV heads x head size x two bytes a token. A worker
serves one model at a time and loads another when a run asks for one of these (app.worker), in bf16 on CUDA.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

GIB = 2**30
LONG_CONTEXT = 100_000  # tokens: the paper's length, at which the KV cache is shown


@dataclass(frozen=True)
class Offer:
    """A model a writer may pick: its spec (what a run stores and a worker loads) and a label saying what it needs."""

    spec: str
    label: str


@dataclass(frozen=True)
class Checkpoint:
    """A published TokenSwift checkpoint's shape, from its config.json."""

    hub_id: str
    params_b: float  # billions of parameters
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def weights_bytes(self) -> float:
        return self.params_b * 1e9 * 2  # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # keys and values, bf16

    def label(self) -> str:
        name = self.hub_id.split("/", 1)[1].removeprefix("TokenSwift-")
        kv = self.kv_bytes_per_token * LONG_CONTEXT / GIB
        return (f"TokenSwift {name} · {self.weights_bytes / GIB:.0f} GiB of bf16 weights + {kv:.1f} GiB of KV "
                f"cache at {LONG_CONTEXT // 1000}K tokens")


PUBLISHED = (
    Checkpoint("TokenSwift/TokenSwift-Qwen2.5-1.5B", 1.54, 28, 2, 128),
    Checkpoint("TokenSwift/TokenSwift-Qwen2.5-7B", 7.62, 28, 4, 128),
    Checkpoint("TokenSwift/TokenSwift-Llama-3.1-8B", 8.03, 32, 8, 128),
    Checkpoint("TokenSwift/TokenSwift-Yarn-Llama-2-7b-128k", 6.74, 32, 32, 128),
    Checkpoint("TokenSwift/TokenSwift-Qwen2.5-14B", 14.77, 48, 8, 128),
    Checkpoint("TokenSwift/TokenSwift-DeepSeek-R1-Distill-Qwen-32B", 32.76, 64, 8, 128),
    Checkpoint("TokenSwift/TokenSwift-QwQ-32B", 32.76, 64, 8, 128),
)


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers (never where HF_HUB_OFFLINE is set); any failure is a no."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return False
    try:
        from huggingface_hub import HfApi

        HfApi().model_info(PUBLISHED[0].hub_id, timeout=timeout_s)
        return True
    except Exception as e:  # noqa: BLE001  (offline, DNS, a proxy, the hub down: nothing is offered)
        log.info("the Hugging Face hub is not reachable (%s): offering the studio's own model only", e)
        return False


def offers(own_model: str, *, cuda: bool, hub: bool, gpu_bytes: int | None = None) -> list[Offer]:
    """The studio's own model, then (on CUDA with a reachable hub) the published checkpoints whose bf16 weights fit
    `gpu_bytes` (the GPU's memory; None: all), smallest first."""
    out = [Offer(own_model, f"{own_model} (this studio's model)")]
    if cuda and hub:
        out += [Offer(c.hub_id, c.label()) for c in sorted(PUBLISHED, key=lambda c: c.params_b)
                if c.hub_id != own_model and (gpu_bytes is None or c.weights_bytes < gpu_bytes)]
    return out


def studio_offers(own_model: str, gpu: bool | None = None) -> list[Offer]:
    """`offers` for this machine: CUDA and its memory as torch sees them (`gpu` True: a GPU that exists only inside
    requests, as on ZeroGPU), and the hub as it answers now."""
    gpu_bytes = None
    if gpu is None:
        try:
            import torch

            gpu = torch.cuda.is_available()
            gpu_bytes = torch.cuda.get_device_properties(0).total_memory if gpu else None
        except Exception:  # noqa: BLE001  (a torch build without CUDA, a driver problem: a CPU studio)
            gpu = False
    return offers(own_model, cuda=gpu, hub=gpu and hub_reachable(), gpu_bytes=gpu_bytes)
