# SPDX-License-Identifier: Apache-2.0
"""Stage 4 of reclamation: copying KV from source to destination slots.

KV pools are laid out as TensorRT-LLM's primary pools, HND inside a block:

    pool: [num_blocks, num_layers, 2 (K, V), num_kv_heads, tokens_per_block, head_dim]

One move copies a token's K and V in every layer and head: ``pool[db, :, :, :, do, :] =
pool[sb, :, :, :, so, :]``. ``relocate_slots`` is the reference (the spec the CUDA kernel must
match bit for bit). On CUDA, ``TorchCopyExecutor`` runs the CUDA kernel (``cuda_kernel.py``; torch
indexing where the kernel is not built) on a side stream that first waits for
the compute stream (the KV being moved was written there) and records an event after it; the
compute stream waits on that event before the next attention (I3). Nothing calls a device-wide
synchronize.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from trtllm_vtoken.reclaim.plan import RelocationPlan

if TYPE_CHECKING:
    import torch


class CopyHandle:
    """A submitted copy (one launch for any number of moves). ``event`` is None when the copy
    already ran synchronously (CPU)."""

    def __init__(self, event: Any = None, keepalive: tuple = ()) -> None:
        self.event = event
        self._keepalive = keepalive  # index tensors the side stream still reads

    def done(self) -> bool:
        """Non-blocking: has the copy finished?"""
        return self.event is None or bool(self.event.query())

    def make_stream_wait(self, stream: Any) -> None:
        """Orders all later work on ``stream`` after the copy (I3). No host synchronization."""
        if self.event is not None:
            stream.wait_event(self.event)

    def synchronize(self) -> None:
        """Blocks the host until this copy (only this one) has finished."""
        if self.event is not None:
            self.event.synchronize()


class CopyExecutor(ABC):
    """Moves KV between slots. Does not touch the token table or the block pool."""

    @abstractmethod
    def submit_slots(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> CopyHandle:
        """Starts copying slot ``src_slots[i]`` to ``dst_slots[i]`` for every i, as one copy
        (sources and destinations disjoint); returns at once on CUDA. int64 arrays [moves]."""

    def submit_before(self, src_slots: np.ndarray, dst_slots: np.ndarray, stream: Any) -> CopyHandle | None:
        """``submit_slots`` ordered before what ``stream`` runs next (CUDA: the stream waits on the
        copy; None: the copy has finished when this returns). None if nothing moves."""
        if not len(src_slots):
            return None
        handle = self.submit_slots(src_slots, dst_slots)
        if stream is not None:
            handle.make_stream_wait(stream)
        else:
            handle.synchronize()
        return handle

    def submit_many(self, plans: Sequence[RelocationPlan]) -> CopyHandle:
        """One copy of every plan's moves (plans of different requests touch disjoint blocks)."""
        src = np.fromiter((s for plan in plans for s in plan.src_slots), dtype=np.int64)
        dst = np.fromiter((d for plan in plans for d in plan.dst_slots), dtype=np.int64)
        return self.submit_slots(src, dst)

    def submit(self, plan: RelocationPlan) -> CopyHandle:
        return self.submit_many([plan])

    @abstractmethod
    def bytes_per_move(self) -> int:
        """Bytes read (= bytes written) to move one token in every layer, K and V."""


def relocate_slots(pool: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Reference copy inside one pool; gathers every source before scattering (plans are disjoint).

    Args:
        pool: [num_blocks, num_layers, 2, num_kv_heads, tokens_per_block, head_dim], modified.
        src_slots, dst_slots: [num_moves], int64, flat slots on ``pool.device``.
    """
    tpb = pool.shape[4]
    values = pool[src_slots // tpb, :, :, :, src_slots % tpb]  # [M, layers, 2, heads, head_dim]
    pool[dst_slots // tpb, :, :, :, dst_slots % tpb] = values


class TorchCopyExecutor(CopyExecutor):
    """The torch copy executor: synchronous on CPU, side stream + event on CUDA.

    Args:
        kernel: on CUDA, "auto" uses the CUDA relocation kernel when it is built, "cuda" requires
            it (RuntimeError if absent), "torch" always uses torch indexing. Ignored on CPU.
        copy_delay_cycles: test hook for I3: the side stream spins this many GPU cycles before the
            copy, so a consumer that skips the event wait reads stale KV.
    """

    def __init__(self, pools: Sequence[torch.Tensor], kernel: str = "auto",
                 copy_delay_cycles: int = 0) -> None:
        if not pools:
            raise ValueError("need at least one KV pool")
        shapes = {(p.shape[0], p.shape[4], p.device) if p.dim() == 6 else None for p in pools}
        if len(shapes) != 1 or None in shapes:
            raise ValueError(
                "KV pools must be 6-D [num_blocks, num_layers, 2, num_kv_heads, tokens_per_block, "
                f"head_dim] with the same blocks, tokens_per_block and device; got {[tuple(p.shape) for p in pools]}"
            )
        self.pools = list(pools)
        self.device = pools[0].device
        if kernel not in ("auto", "cuda", "torch"):
            raise ValueError(f"kernel must be 'auto', 'cuda' or 'torch', got {kernel!r}")
        self._stream = None
        self.uses_kernel = False
        self.copy_delay_cycles = copy_delay_cycles
        if self.device.type == "cuda":
            import torch

            from trtllm_vtoken.reclaim import cuda_kernel

            self._stream = torch.cuda.Stream(self.device)
            if kernel == "cuda" and cuda_kernel.load() is None:
                raise RuntimeError("kernel='cuda' but the CUDA relocation kernel is not built")
            self.uses_kernel = kernel != "torch" and cuda_kernel.load() is not None

    def bytes_per_move(self) -> int:
        return sum(p[0, :, :, :, 0].numel() * p.element_size() for p in self.pools)

    def submit_slots(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> CopyHandle:
        import torch

        if not len(src_slots):
            return CopyHandle()
        if self._stream is None:
            src_t = torch.from_numpy(np.ascontiguousarray(src_slots, dtype=np.int64))
            dst_t = torch.from_numpy(np.ascontiguousarray(dst_slots, dtype=np.int64))
            for pool in self.pools:
                relocate_slots(pool, src_t, dst_t)
            return CopyHandle()
        from trtllm_vtoken.reclaim.upload import to_device

        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # the KV to move was written by work queued there
        with torch.cuda.stream(self._stream):
            on_device = to_device(np.stack([src_slots, dst_slots]), torch.int64, self.device)
            if self.copy_delay_cycles:
                torch.cuda._sleep(self.copy_delay_cycles)
            for pool in self.pools:
                if self.uses_kernel:
                    from trtllm_vtoken.reclaim.cuda_kernel import relocate_slots_cuda

                    relocate_slots_cuda(pool, on_device[0], on_device[1], self._stream)
                else:
                    relocate_slots(pool, on_device[0], on_device[1])
            event = torch.cuda.Event()
            event.record(self._stream)
        return CopyHandle(event, keepalive=(on_device,))


class AccountingCopyExecutor(CopyExecutor):
    """Moves no data: counts what a real executor would copy. For the simulated-attention backend,
    which keeps the token table, planner and block pool exact but has no KV tensors."""

    def __init__(self, bytes_per_move: int) -> None:
        if bytes_per_move <= 0:
            raise ValueError(f"bytes_per_move must be positive, got {bytes_per_move}")
        self._bytes_per_move = bytes_per_move

    def bytes_per_move(self) -> int:
        return self._bytes_per_move

    def submit_slots(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> CopyHandle:
        return CopyHandle()
