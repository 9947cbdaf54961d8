"""Modules built as skeletons: their weights are placeholders on the meta device, never initialised, for a loader
that replaces every one of them before anything reads them.

Not `with torch.device("meta")`: under it every op runs on the meta device, and the first meta op that torch
implements in Python (a weight's random init, the rotary table's arange) imports torch._dynamo and sympy, a large
import that running a model on our kernels never needs otherwise. Here only the factories that create weights
(`torch.empty`, `ones`, `zeros` without a device) go to the meta device, and torch.nn.init's functions do nothing.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class _Skeleton(TorchFunctionMode):
    FACTORIES = (torch.empty, torch.ones, torch.zeros)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        if func in self.FACTORIES and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextmanager
def skeleton() -> Iterator[None]:
    """Modules built inside have meta, uninitialised weights (tensors made with an explicit device excepted). The
    mode is thread-local: another thread's modules are built as usual."""
    with _Skeleton():
        yield
