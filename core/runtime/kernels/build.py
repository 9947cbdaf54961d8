"""Builds our C++ CPU kernels (kernels/cpu.cpp and the headers it includes) with the system's compiler, once per
machine, and loads them from the cache afterwards.

The source is compiled for an explicit instruction-set level, the best this CPU's flags allow (`isa_level`):
AVX-512 with VNNI and BF16, AVX-512 with VNNI, AVX2 with FMA and F16C, or plain C++ (any CPU). Never
`-march=native`: on some virtual machines it enables instructions the CPU then refuses. `TOKENSWIFT_ISA` picks a
lower level by hand. The extension goes into TOKENSWIFT_CACHE/kernels/<hash>, the hash covering the source and the
headers beside it, the level's flags and torch's version. A kernel that cannot be built (no compiler, a read-only
cache) is reported once, and the model runs PyTorch's operators instead.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from core.runtime.paths import cache_root

log = logging.getLogger(__name__)

_MODULES: dict[str, Any] = {}  # name -> loaded extension, or None once a build failed

# Instruction-set levels, best first: the CPU flags each needs (/proc/cpuinfo) and the compiler flags it builds with.
AVX512 = (("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"),
          ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"))
LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512bf16": (AVX512[0] + ("avx512_bf16",), AVX512[1] + ("-mavx512bf16",)),
    "avx512": AVX512,
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
    "generic": ((), ()),
}
# Nothing here reorders or fuses float arithmetic: the kernels write every fused multiply-add they mean.
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]


def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "flags", ...); empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}


def isa_level() -> str:
    """The best level this CPU supports (plain C++ off x86), or TOKENSWIFT_ISA's if that is lower."""
    flags = set(cpu_info().get("flags", "").split())
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    supported = [name for name, (need, _) in LEVELS.items() if not need or (x86 and set(need) <= flags)]
    chosen = os.environ.get("TOKENSWIFT_ISA")
    if chosen:
        if chosen not in LEVELS:
            raise ValueError(f"TOKENSWIFT_ISA must be one of {', '.join(LEVELS)}, got {chosen!r}")
        if chosen not in supported:
            raise ValueError(f"TOKENSWIFT_ISA={chosen}: this CPU lacks {set(LEVELS[chosen][0]) - flags}")
        return chosen
    return supported[0]


def build(name: str, source: Path) -> Any | None:
    """The extension compiled from `source` for this CPU's level (built on the first call, about a minute; loaded
    from the cache later), or None if it cannot be built (warned once)."""
    level = isa_level()
    key_name = f"{name}-{level}"
    if key_name in _MODULES:
        return _MODULES[key_name]
    flags = [*COMMON_FLAGS, *LEVELS[level][1]]
    # the source and the headers beside it, which it includes: one translation unit
    text = "".join(path.read_text() for path in [source, *sorted(source.parent.glob("*.h"))])
    key = hashlib.sha256((text + " ".join(flags) + torch.__version__).encode()).hexdigest()[:12]
    folder = cache_root() / "kernels" / key
    module_name = f"tokenswift_{name}_{level}_{key}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if shutil.which("ninja") is None:  # requirements.txt's ninja sits beside the interpreter, maybe not on PATH
            os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        built = folder / f"{module_name}.so"
        log.info("%s the %s kernels (%s) in %s", "loading" if built.exists() else "building", name, level, folder)
        # torch's build holds the folder's lock file until the extension is linked: no half-written file is read
        done = built.exists() and not (folder / "lock").exists()
        module = import_built(built, module_name) if done else None
        if module is None:
            # torch's C++ extension tooling (and setuptools with it: slow to import, and memory held for good) only
            # when a kernel has to be built
            from torch.utils.cpp_extension import load

            module = load(name=module_name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                          build_directory=str(folder), verbose=False)
    except Exception as exc:  # no compiler, no ninja, a read-only cache: fall back, do not fail generation
        module = None
        warnings.warn(f"CPU {name} kernels unavailable ({exc.__class__.__name__}: {exc}); using PyTorch's operators",
                      RuntimeWarning, stacklevel=3)
    _MODULES[key_name] = module
    return module


def import_built(path: Path, module_name: str) -> Any | None:
    """An extension built before, imported as torch's `load` imports it once built (its key covers the source, the
    flags and torch's version, so it is this source's build); None if it does not import (then `load` rebuilds)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        return None
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as exc:
        log.info("the built kernels in %s do not import (%s); building them again", path.parent, exc)
        return None
    return module
