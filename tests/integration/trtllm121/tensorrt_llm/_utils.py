# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm/_utils.py``: ``from mpi4py import MPI`` runs at ``import tensorrt_llm``
and initialises MPI. Processes that ``MPIPoolExecutor`` spawns later get the environment MPI saw
then, not the client's later changes: TensorRT-LLM's own ``executor/worker.py`` ``worker_main``
says so ("MPI_Init seems to cache the env at import time ... Any env overrides to the main
process after tensorrt_llm import may not get reflected in the spawned worker process"; 1.2-era
copies, index ids 3662896411, 66326986617). ``MPI_INIT_ENVIRON`` is that snapshot."""

import os

MPI_INIT_ENVIRON = dict(os.environ)


def mpi_rank() -> int:
    return int(os.environ.get("TLLM_DOUBLE_RANK", "0"))


def get_sm_version() -> int:
    """The GPU's compute capability as major * 10 + minor (``_utils.get_sm_version``, read from the
    device properties). The double has no GPU: 90 (H100 / H200, where vToken's users run), or
    ``TLLM_DOUBLE_SM_VERSION`` (tests of what depends on the architecture)."""
    return int(os.environ.get("TLLM_DOUBLE_SM_VERSION", "90"))


# ---- the MPI communicator of the worker processes ---------------------------------------------------
# ``_utils.py`` (1.2-era copy, index id 52995752): ``comm = pkl5.Intracomm(MPI.COMM_WORLD)`` at
# import, ``set_mpi_comm(new_comm)`` replaces it (MPI sessions), ``mpi_comm()`` returns it,
# ``mpi_disabled()`` is ``TLLM_DISABLE_MPI == "1"`` (TensorRT-LLM's MPI-free Ray mode). In the
# double, each simulated rank is a thread standing for a worker process, so the communicator is
# per thread (``set_mpi_comm`` in the thread); a thread that set none is a single-rank world.

import threading  # noqa: E402

import numpy as np  # noqa: E402

_local = threading.local()


def set_mpi_comm(new_comm) -> None:
    _local.comm = new_comm


def mpi_comm():
    comm = getattr(_local, "comm", None)
    return comm if comm is not None else ThreadCommDouble(_Hub(1), 0)


def mpi_disabled() -> bool:
    return os.environ.get("TLLM_DISABLE_MPI") == "1"


class _Hub:
    """What the ranks of one communicator share: a slot per rank and a barrier (a rank that never
    comes turns the others' wait into an error after 60 s instead of a hang)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)


class ThreadCommDouble:
    """mpi4py's ``Intracomm`` as TensorRT-LLM's ``pkl5.Intracomm`` offers it, for ranks that are
    threads: ``Get_rank``/``Get_size``; ``Dup`` (collective: every rank must call it; a new
    communicator over the same ranks); the buffer ``Allreduce(sendbuf, recvbuf, op=SUM)``, which
    checks what MPI is strict about (same dtype and shape on every rank, separate buffers) and,
    like a real reduction tree, adds the contributions in an order that depends on the receiving
    rank (floats may come out different per rank; integers cannot); the object ``allgather``."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self._hub, self._rank = hub, rank

    @classmethod
    def world(cls, size: int) -> list["ThreadCommDouble"]:
        hub = _Hub(size)
        return [cls(hub, rank) for rank in range(size)]

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._hub.size

    def _exchange(self, value) -> list:
        hub = self._hub
        hub.slots[self._rank] = value
        hub.barrier.wait()
        got = list(hub.slots)
        hub.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return got

    def Dup(self) -> "ThreadCommDouble":
        hub = self._exchange(_Hub(self._hub.size) if self._rank == 0 else None)[0]
        return ThreadCommDouble(hub, self._rank)

    def Allreduce(self, sendbuf, recvbuf, op=None) -> None:
        if op is not None:
            raise NotImplementedError("the double models op=SUM (mpi4py's default) only")
        if sendbuf is recvbuf or np.shares_memory(sendbuf, recvbuf):
            raise ValueError("MPI_ERR_BUFFER: sendbuf and recvbuf overlap (use MPI.IN_PLACE)")
        parts = self._exchange(np.array(sendbuf, copy=True))
        if any(p.dtype != parts[0].dtype or p.shape != parts[0].shape for p in parts):
            raise ValueError("MPI_ERR_TRUNCATE: ranks passed buffers of different types or sizes")
        order = [(self._rank + i) % len(parts) for i in range(len(parts))]
        total = parts[order[0]].copy()
        for r in order[1:]:
            total += parts[r]
        recvbuf[...] = total

    def allgather(self, obj) -> list:
        return self._exchange(obj)
