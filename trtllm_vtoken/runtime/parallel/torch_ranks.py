# SPDX-License-Identifier: Apache-2.0
"""The ranks of one model instance over ``torch.distributed``: gloo on CPU, NCCL on CUDA."""

from __future__ import annotations

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

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

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
