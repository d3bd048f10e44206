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
