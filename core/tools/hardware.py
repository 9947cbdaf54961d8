"""The machine a figure was measured on, recorded with every benchmark's JSON."""
from __future__ import annotations

import platform
from typing import Any

import torch

from core.runtime.kernels.build import cpu_info


def hardware() -> dict[str, Any]:
    """The machine a figure was measured on: CPU model, family and widest vector unit (two machines of one model name
    may have different vector units), threads, torch, GPU."""
    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.machine(), "cpu": platform.processor() or "", "cuda": None}
    fields = cpu_info()
    if fields:
        flags = fields.get("flags", "").split()
        info["cpu"] = fields.get("model name", info["cpu"])
        info["cpu_family_model"] = f"{fields.get('cpu family', '?')}/{fields.get('model', '?')}"
        info["vector"] = next((isa for isa in ("avx512f", "avx2", "avx", "sse4_2") if isa in flags), "")
    if torch.cuda.is_available():
        info["cuda"] = torch.cuda.get_device_name()
    return info


def describe(hw: dict[str, Any]) -> str:
    """One line naming the machine of a `hardware()` record, as the README's tables cite it: a CPU by its model name,
    its family/model numbers (one name can cover several generations) and its widest vector unit."""
    family = f"family {hw['cpu_family_model']}, " if hw.get("cpu_family_model") else ""
    cpu = hw.get("cuda") or f"{hw['cpu']} ({family}{hw.get('vector') or hw['machine']})"
    return f"{cpu}, {hw['threads']} threads, torch {hw['torch']}"


def run_report(command: str, hw: dict[str, Any], table: str) -> str:
    """A saved run as the README shows it: its command, its machine, its table."""
    return f"```bash\n{command}\n```\n\n{describe(hw)}:\n\n{table}"

