# SPDX-License-Identifier: Apache-2.0
"""The transient memory a piece of torch code holds: measured on the code path itself.

On CPU (and on the meta device, where shapes cost nothing) every allocation goes through
``PeakMemory``, a dispatch mode that counts each new storage from the operator that made it until
the tensor that made it is gone. On CUDA the caching allocator's own peak is read.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakMemory(TorchDispatchMode):
    """``largest``: the largest storage the code inside allocates; ``peak``: the most bytes its
    allocations hold at once (its result included while it lives); ``sizes``: every allocation's
    bytes, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak, self.largest = 0, 0, 0
        self.sizes: list[int] = []
        self._storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage._cdata in inputs or storage._cdata in self._storages:
                continue  # in place, out=, or a view
            self._storages.add(storage._cdata)
            self.sizes.append(storage.nbytes())
            self.live += storage.nbytes()
            self.largest = max(self.largest, storage.nbytes())
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, storage._cdata, storage.nbytes())
        return out

    def _release(self, key: int, nbytes: int) -> None:
        self._storages.discard(key)
        self.live -= nbytes


def peak_transient_bytes(fn: Callable[[], object], device: torch.device | str) -> int:
    """The most bytes ``fn()`` holds at once beyond what was allocated before it (its result
    included): the allocator's peak on CUDA, ``PeakMemory`` elsewhere."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with PeakMemory() as memory:
        fn()
    return memory.peak
