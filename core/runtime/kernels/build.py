"""Builds our C++ CPU kernels (kernels/attention.py, kernels/linear.py) with the system's compiler, once per
machine, and loads them from the cache afterwards; holds the register tile both are built on (ROW_TILE).

Each kernel is compiled with torch's cpp_extension (g++ and ninja, which torch.compile needs anyway) into
TOKENSWIFT_CACHE/kernels/<hash>; the hash covers the source, the CPU's instruction-set flags and torch's version, so a
cache shared with another machine or torch rebuilds instead of crashing. A kernel that cannot be built (no compiler,
a read-only cache) is reported once and its caller takes the plain PyTorch path, which computes the same function.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from core.runtime.paths import cache_root

log = logging.getLogger(__name__)

_MODULES: dict[str, Any] = {}  # name -> loaded extension, or None once a build failed

# The register tile both kernels are built on (C++, pasted into their sources): acc[r][c] += a[r][k] * b[k][c] for
# RB rows of a, W contiguous columns of b and k = 0..K-1 in order. The accumulators run along b's columns, so they
# vectorise with no horizontal sums, every loaded vector of b serves RB rows, and each accumulator's additions come
# in the same order whatever RB is: a row's result never depends on the rows computed with it.
ROW_TILE = r"""
template <int RB, int W>
inline void row_tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t K, float (&acc)[RB][W]) {
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * ldb;
    for (int r = 0; r < RB; ++r) {
      const float ak = a[r * lda + k];
#pragma omp simd
      for (int c = 0; c < W; ++c) acc[r][c] += ak * bk[c];
    }
  }
}
"""


def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "flags", ...); empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}


def build(name: str, source: str, functions: list[str]) -> Any | None:
    """The extension compiled from `source` (built on the first call, ~20 s; loaded from the cache later), or None
    if it cannot be built (warned once)."""
    if name in _MODULES:
        return _MODULES[name]
    # torch's C++ extension tooling is imported only when a kernel is first built or loaded: it is slow to import
    from torch.utils.cpp_extension import load_inline

    key = hashlib.sha256((source + cpu_info().get("flags", "") + torch.__version__).encode()).hexdigest()[:12]
    folder = cache_root() / "kernels" / key
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if shutil.which("ninja") is None:  # requirements.txt's ninja sits beside the interpreter, maybe not on PATH
            os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        module_name = f"tokenswift_{name}_{key}"
        if (folder / f"{module_name}.so").exists():
            log.info("loading the %s kernel from %s", name, folder)
        else:
            log.info("building the %s kernel in %s (once per machine)", name, folder)
        module = load_inline(
            name=module_name, cpp_sources=source, functions=functions, build_directory=str(folder),
            # -march=native: this CPU's vector units (the hash above ties the binary to them). -fno-trapping-math
            # only lets masked compares vectorise; no flag here reorders arithmetic.
            extra_cflags=["-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno", "-fopenmp"],
            extra_ldflags=["-fopenmp"], verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a read-only cache: fall back, do not fail generation
        module = None
        warnings.warn(f"CPU {name} kernel unavailable ({exc.__class__.__name__}: {exc}); using PyTorch's",
                      RuntimeWarning, stacklevel=3)
    _MODULES[name] = module
    return module
