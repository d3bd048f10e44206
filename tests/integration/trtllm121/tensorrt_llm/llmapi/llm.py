# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm.LLM`` (``llmapi/llm.py``) for the PyTorch backend.

- ``BaseLLM.__init__`` (2026 copy, index id 55216765702; the same order without the first step in
  the older copy, index id 323158958): ``_process_env_overrides(kwargs["env_overrides"])`` first
  (PR #9104: each variable set in the CLIENT's ``os.environ``; variables set after ``import
  tensorrt_llm`` do not reach workers spawned by MPI, ``_utils``), then the keyword arguments
  validated into ``TorchLlmArgs`` (unknown keys rejected), then ``_build_model()``, which creates
  the executor: for the PyTorch backend in an MPI-spawned worker even at TP=1
  (``GenerationExecutor.create`` -> ``_create_ipc_executor(use_worker=False)`` ->
  ``GenerationExecutorProxy`` -> ``MpiPoolSession(n_workers=world size)`` -> ``worker_main``;
  executor/executor.py, proxy.py), and waits until the worker reports it ready
  (``worker_main`` sends the ready signal after the executor is built, index id 3662896411), so
  the executor's KV-cache manager exists when ``__init__`` returns.
- ``LLM(_TorchLLM(BaseLLM))``: the public class adds nothing to construction.
- ``shutdown()`` ends the MPI session.
``worker_report`` is what the worker sent back about the executor it built."""

from __future__ import annotations

import os

from ..executor.worker import worker_main
from .llm_args import TorchLlmArgs
from .mpi_session import MpiPoolSession


class BaseLLM:
    def __init__(self, model: str, **kwargs) -> None:
        self._process_env_overrides(kwargs.get("env_overrides"))
        self.args = TorchLlmArgs(model=model, **kwargs)
        world_size = self.args.tensor_parallel_size * self.args.pipeline_parallel_size
        self.mpi_session = MpiPoolSession(n_workers=world_size)
        self._build_model()

    def _process_env_overrides(self, env_overrides) -> None:
        for key, value in (env_overrides or {}).items():
            os.environ[key] = str(value)

    def _build_model(self) -> None:
        self.worker_reports = self.mpi_session.submit_sync(worker_main, llm_args=self.args)
        self.worker_report = self.worker_reports[0]

    def shutdown(self) -> None:
        self.mpi_session.shutdown()
        self.shut_down = True


class _TorchLLM(BaseLLM):
    pass


class LLM(_TorchLLM):
    pass


class SamplingParams:
    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)
