"""Long-lived CPU buffers on 2 MiB pages: the packed weights and the KV cache, which every decoding step reads.

On 4 KiB pages a step's reads miss the TLB thousands of times (every layer's and head's keys and values on pages of
their own). Linux backs memory with transparent huge pages where a program asks for them (madvise, the usual
setting) or everywhere ("always"). Here a buffer is a slice of a reservation aligned to 2 MiB and advised
MADV_HUGEPAGE before anything touches it, so its pages are huge from their first write. Only written pages become
resident: an over-sized reservation costs address space, not memory. Elsewhere (another OS, huge pages off, a GPU
tensor) a buffer is an ordinary tensor; the numbers are the same either way.

`contiguous` packs the weights into shared reservations (`Arena`: most matrices of a small model are smaller than
one huge page); `zeros` gives the KV cache its own.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux's value (asm-generic/mman-common.h)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _libc(name: str, argtypes: list[type]) -> Callable[..., int] | None:
    """A function of the C library on Linux (glibc's, where it has one), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = argtypes, ctypes.c_int
    return f


_MADVISE = _libc("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
_MALLOC_TRIM = _libc("malloc_trim", [ctypes.c_size_t])


def huge_pages_mode() -> str:
    """This machine's transparent huge page setting: "always", "madvise", "never", or "" where there is none."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def reserve(nbytes: int) -> Tensor | None:
    """`nbytes` of untouched memory (uint8) starting on a 2 MiB boundary and advised to be backed by huge pages;
    None where this system has no such advice."""
    if _MADVISE is None or huge_pages_mode() not in ("madvise", "always"):
        return None
    # A mapping of its own: fresh pages, none touched yet. (torch.empty's may come from malloc's heap once large
    # blocks have been freed, glibc then raising its threshold for mapping them, and be small pages already.)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE
    buf = raw[start:start + nbytes]
    _MADVISE(buf.data_ptr(), nbytes, MADV_HUGEPAGE)  # advice: on failure the pages are simply small ones
    return buf


def _view(buf: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    return buf.view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A zeroed CPU tensor, on huge pages where it fills at least one."""
    nbytes = math.prod(shape) * dtype.itemsize
    buf = reserve(nbytes) if nbytes >= HUGE_PAGE else None
    return torch.zeros(shape, dtype=dtype) if buf is None else _view(buf, shape, dtype).zero_()


class Arena:
    """Tensors carved one after another (64-byte aligned) out of huge-page reservations of `chunk` bytes, a new one
    begun when the current one is full. A reservation lives while any tensor carved from it does."""

    ALIGN = 64

    def __init__(self, chunk: int = 64 << 20):
        self.chunk = chunk
        self._buf: Tensor | None = None
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor | None:
        """An uninitialised tensor from the arena; None where huge pages cannot be asked for."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-self._used // self.ALIGN) * self.ALIGN
        if self._buf is None or start + nbytes > self._buf.numel():
            buf = reserve(max(self.chunk, -(-nbytes // HUGE_PAGE) * HUGE_PAGE))
            if buf is None:
                return None
            self._buf, start = buf, 0
        self._used = start + nbytes
        return _view(self._buf[start:start + nbytes], shape, dtype)


def release_freed() -> None:
    """Give the heap's free pages back to the system. A loader calls it after each matrix: the packed weights live
    in the arena, so the heap's pages that held a matrix's transient copies would otherwise stay resident, on top
    of it, instead of being reused for the next matrix's weights."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


WEIGHTS = Arena()  # the packed weights of every model this process loads


def contiguous(t: Tensor) -> Tensor:
    """`t` as a contiguous tensor in the weights' arena (a CPU tensor; others as `t.contiguous()`)."""
    out = WEIGHTS.empty(tuple(t.shape), t.dtype) if t.device.type == "cpu" and t.numel() else None
    return t.contiguous() if out is None else out.copy_(t)
