# SPDX-License-Identifier: Apache-2.0
"""The ranks of one TensorRT-LLM model instance, as its KV-cache manager in the worker sees them.

Under tensor parallelism each rank's ``KVCacheManager`` holds the KV of its own heads; under
pipeline parallelism the KV of its own layers. Every rank runs the same allocator and the same
scheduler over the same requests, so vToken's decisions must agree on every rank
(``trtllm_vtoken.consistency``): the attention mass is summed over all ``tp_size * pp_size``
ranks before a policy scores it, and with ``check_invariants`` the ranks compare a digest of their
token tables after every step.

The communicator is TensorRT-LLM's own: ``tensorrt_llm._utils.mpi_comm()``, the MPI communicator
of the model instance's worker processes (``pkl5.Intracomm(MPI.COMM_WORLD)``, or the session's
communicator set by ``set_mpi_comm``), the one the executor's own ``MPIDist`` splits into its
``tp_comm`` / ``pp_comm`` (``_torch/distributed/communicator.py``). Its ranks are the mapping's
global ranks (``Mapping.rank``; ``tp_group`` and ``pp_group`` list them), and a resource manager
can call it at any point that every rank reaches in the same order: ``update_resources`` is one
(the executor calls it once per scheduled batch on every rank, batches in the same order, also in
the pipeline-parallel loop ``PyExecutor._executor_loop_pp``). vToken talks on a duplicate of it
(``Dup``, collective, made while the manager is built, which every rank does in the same order),
so its messages never mix with the executor's own.

The sum is exact: the mass is turned into fixed point (int64, ``MASS_SCALE`` steps per unit) and
MPI adds integers, which gives the same bits whatever order its algorithm adds in -- so every rank
gets the same mass by construction, not by the luck of a reduction tree.

    rank r:  mass[B, L] (float, its heads / layers) -> rint(mass * 2^24) int64 --+
                                                                                  +- MPI Allreduce(SUM)
    every rank:  int64 sum / 2^24  = one float64 array, the same bits everywhere <-+
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import torch

from trtllm_vtoken.consistency import RankGroup, SingleRank

MASS_SCALE = float(2**24)
"""Fixed-point steps per unit of attention mass: 6e-8 resolution; room for sums up to 5e11 (a
prompt token's prefill mass is at most queries x heads x layers)."""


class MpiRanks(RankGroup):
    """One model instance's ranks over an mpi4py communicator (``Get_rank``, ``Get_size``, the
    buffer ``Allreduce(sendbuf, recvbuf)`` whose default op is SUM, the object ``allgather``)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums a CPU float tensor over the ranks exactly (fixed point), in place."""
        if tensor.device.type != "cpu" or not tensor.is_floating_point():
            raise TypeError(f"the mass is summed as a CPU float tensor, got {tensor.dtype} on {tensor.device}")
        scaled = tensor.detach().double().numpy() * MASS_SCALE
        # Fixed point holds no NaN or infinity, and refusing here would stop the step halfway
        # (the mass is read after the batch's tokens joined the layout). So each rank saturates
        # alike: NaN and +inf to the largest addend (ranked above every real mass, as a single
        # rank ranks them after every number), -inf to the smallest; the sum of world_size of
        # them stays within int64.
        limit = 2.0**61 / self.world_size
        np.nan_to_num(scaled, copy=False, nan=limit, posinf=limit, neginf=-limit)
        np.clip(scaled, -limit, limit, out=scaled)
        mine = np.ascontiguousarray(np.rint(scaled), dtype=np.int64)
        total = np.empty_like(mine)
        self.comm.Allreduce(mine, total)  # op=SUM, mpi4py's default
        tensor.copy_(torch.from_numpy(total.astype(np.float64) / MASS_SCALE))
        return tensor

    def all_gather_int(self, value: int) -> list[int]:
        return [int(v) for v in self.comm.allgather(int(value))]


def parallel_layout_problem(mapping: Any) -> str | None:
    """Why vToken cannot run on this mapping's ranks, or None. Supported: tensor and pipeline
    parallelism (every rank holds the same requests). Attention data parallelism gives each rank
    its own requests and context parallelism a slice of each sequence: the ranks' tables are
    meant to differ there, which the protocol does not model."""
    if mapping is None:
        return None
    tp, pp = getattr(mapping, "tp_size", 1), getattr(mapping, "pp_size", 1)
    if getattr(mapping, "enable_attention_dp", False) and tp > 1:
        return ("attention data parallelism (enable_attention_dp) gives each rank its own requests; vToken supports "
                "tensor and pipeline parallelism")
    if getattr(mapping, "cp_size", 1) > 1:
        return "context parallelism (cp_size > 1) splits each sequence over ranks; vToken supports tp and pp"
    world = getattr(mapping, "world_size", tp * pp)
    if world != tp * pp:
        return f"world_size {world} != tp_size {tp} * pp_size {pp}: ranks outside tensor/pipeline parallelism"
    return None


def worker_ranks(mapping: Any) -> RankGroup:
    """The ranks of the model instance this worker belongs to: ``SingleRank`` for one rank, else
    TensorRT-LLM's MPI communicator. ValueError for a layout vToken does not support; RuntimeError
    if TensorRT-LLM runs without MPI (``TLLM_DISABLE_MPI=1``, its Ray orchestrator) or if the
    communicator is not this instance's ranks."""
    problem = parallel_layout_problem(mapping)
    if problem:
        raise ValueError(problem)
    world = getattr(mapping, "world_size", 1) if mapping is not None else 1
    if world == 1:
        return SingleRank()
    utils = importlib.import_module("tensorrt_llm._utils")
    if getattr(utils, "mpi_disabled", lambda: False)():
        raise RuntimeError("TensorRT-LLM runs without MPI (TLLM_DISABLE_MPI=1): vToken's cross-rank protocol uses "
                           "tensorrt_llm._utils.mpi_comm(); run the MPI executor for tp/pp > 1")
    ranks = MpiRanks(utils.mpi_comm().Dup())
    if ranks.world_size != world or ranks.rank != mapping.rank:
        raise RuntimeError(f"TensorRT-LLM's MPI communicator has {ranks.world_size} ranks (this one {ranks.rank}), "
                           f"the mapping {world} (rank {mapping.rank}): it is not this model instance's")
    return ranks
