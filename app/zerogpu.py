"""Hugging Face ZeroGPU support: generation in GPU-bounded chunks from inside requests; a no-op elsewhere.

On a ZeroGPU Space a GPU exists only while a function decorated with ``spaces.GPU`` runs, and such a function must be
called from a request. There, and only there, the app does not start the background worker thread; instead, after
the UI queues a run, the same request calls ``ChunkDriver.drive``: it repeatedly enters a ``spaces.GPU`` function
that lets an in-process worker claim or continue one run for at most ``CHUNK_S`` seconds
(``Worker.process_one(time_budget_s=...)``). The worker persists every chunk's text and metrics before returning, so
the page shows progress between chunks and nothing is lost if a request ends early; the next drive continues.

ZeroGPU is detected by the ``spaces`` package being importable *and* ``SPACES_ZERO_GPU`` being set (the package
alone is installed on many non-ZeroGPU machines). Everywhere else ``enabled()`` is False and ``gpu()`` returns the
function unchanged.
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

ENV_VAR = "SPACES_ZERO_GPU"
CHUNK_S = 50.0  # work per GPU call; ZeroGPU's default allocation is 60 s, the rest is margin for start-up
GPU_DURATION_S = 60
MAX_CHUNKS_PER_REQUEST = 240  # ~3 h of generation from one click; a later click or visit carries on

F = TypeVar("F", bound=Callable[..., Any])


def _spaces() -> Any | None:
    try:
        return importlib.import_module("spaces")
    except ImportError:
        return None


def enabled() -> bool:
    """True on a ZeroGPU Space: env ``SPACES_ZERO_GPU`` set and the ``spaces`` package importable."""
    flag = os.environ.get(ENV_VAR, "").strip().lower()
    if flag in ("", "0", "false", "no"):
        return False
    return _spaces() is not None


def gpu(fn: F, duration: int = GPU_DURATION_S) -> F:
    """``spaces.GPU(duration=...)(fn)`` on ZeroGPU; ``fn`` itself everywhere else."""
    if not enabled():
        return fn
    return _spaces().GPU(duration=duration)(fn)


class ChunkDriver:
    """Drives queued runs chunk by chunk inside ``spaces.GPU`` calls (ZeroGPU only; see the module docstring).

    ``worker_factory`` builds the in-request worker (an ``app.worker.Worker`` that is never ``start()``-ed); it is
    built on first use. One request drives at a time: the others return at once, since a single GPU call already
    works through the whole queue in order.
    """

    def __init__(self, worker_factory: Callable[[], Any], chunk_s: float = CHUNK_S,
                 max_chunks: int = MAX_CHUNKS_PER_REQUEST) -> None:
        self._factory = worker_factory
        self._worker: Any = None
        self._lock = threading.Lock()
        self.chunk_s = chunk_s
        self.max_chunks = max_chunks
        self._chunk = gpu(self._run_chunk)

    @property
    def worker(self) -> Any:
        if self._worker is None:
            self._worker = self._factory()
        return self._worker

    def _run_chunk(self) -> bool:
        return bool(self.worker.process_one(time_budget_s=self.chunk_s))

    def drive(self) -> int:
        """Run chunks until the queue is empty (or the per-request cap); returns the number of chunks run."""
        if not self._lock.acquire(blocking=False):
            return 0
        try:
            n = 0
            while n < self.max_chunks:
                if not self._chunk():
                    break
                n += 1
            return n
        except Exception:  # the run's own failure is recorded by the worker; this is about the GPU call itself
            log.exception("ZeroGPU chunk failed")
            return -1
        finally:
            self._lock.release()

