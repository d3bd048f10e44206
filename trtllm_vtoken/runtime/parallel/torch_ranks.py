# SPDX-License-Identifier: Apache-2.0
"""The ranks of one model instance over ``torch.distributed``: gloo on CPU, NCCL on CUDA."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from trtllm_vtoken.consistency import RankGroup

COLLECTIVE_TIMEOUT = timedelta(seconds=300)
"""A rank that stops joining collectives (it raised, or was killed) turns the others' wait into an
error after this long instead of a hang."""


class TorchDistributedRanks(RankGroup):
    """The default process group of this process (``init_rank``), one rank per process."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call init_rank first")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device(device)
        self.all_reduces = 0
        self.all_reduce_seconds = 0.0
        """Every all-reduce of this rank (the model's row-parallel layers and the protocol's)."""
        self._riders: list[torch.Tensor] = []

    def attach(self, tensor: torch.Tensor) -> None:
        """``tensor`` is summed over the ranks, in place, by the next ``all_reduce_sum``: it rides
        in the same collective (one buffer) instead of paying a collective of its own."""
        self._riders.append(tensor)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        riders, self._riders = self._riders, []
        if riders and all(r.dtype == tensor.dtype and r.device == tensor.device for r in riders):
            parts = [tensor, *riders]
            flat = torch.cat([p.reshape(-1) for p in parts])
            self._all_reduce(flat)
            for part, summed in zip(parts, flat.split([p.numel() for p in parts])):
                part.copy_(summed.view_as(part))
        else:
            for part in (tensor, *riders):  # another dtype or device cannot share the buffer
                self._all_reduce(part)
        self.all_reduce_seconds += time.perf_counter() - start
        self.all_reduces += 1
        return tensor

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        if tensor.device != self.device and self.device.type == "cuda":  # NCCL reduces device memory
            on_device = tensor.to(self.device)
            dist.all_reduce(on_device, op=dist.ReduceOp.SUM)
            tensor.copy_(on_device)
        else:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def all_gather_int(self, value: int) -> list[int]:
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine)
        return [int(t.item()) for t in out]


def init_rank(rank: int, world_size: int, init_method: str, device: str = "cpu") -> TorchDistributedRanks:
    """Joins the process group of a model instance: gloo for a CPU run, NCCL for CUDA (rank r on
    ``cuda:r``). Returns the rank's group."""
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        backend, device = "nccl", f"cuda:{rank}"
    else:
        backend = "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    return TorchDistributedRanks(device)
