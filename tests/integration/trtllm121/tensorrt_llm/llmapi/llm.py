# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm.LLM`` (``llmapi/llm.py``) for the PyTorch backend: the keyword
arguments are validated into ``TorchLlmArgs`` (unknown keys rejected), then the executor is
built in an MPI-spawned worker even at TP=1 (``GenerationExecutor.create`` ->
``_create_ipc_executor(use_worker=False)`` -> ``GenerationExecutorProxy`` ->
``MpiPoolSession(n_workers=world size)`` -> ``worker_main``; executor/executor.py, proxy.py).
``worker_report`` is what the worker sent back about the executor it built."""

from __future__ import annotations

from ..executor.worker import worker_main
from .llm_args import TorchLlmArgs
from .mpi_session import MpiPoolSession


class LLM:
    def __init__(self, model: str, **kwargs) -> None:
        self.args = TorchLlmArgs(model=model, **kwargs)
        world_size = self.args.tensor_parallel_size * self.args.pipeline_parallel_size
        self.mpi_session = MpiPoolSession(n_workers=world_size)
        self.worker_reports = self.mpi_session.submit_sync(worker_main, llm_args=self.args)
        self.worker_report = self.worker_reports[0]


class SamplingParams:
    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)
