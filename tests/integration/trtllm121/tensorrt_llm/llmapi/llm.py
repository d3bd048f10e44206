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
``worker_report`` is what the worker sent back about the executor it built.

Generation (1.2-era ``llm.py``, index id 323158958: the one whose ``RequestOutput`` carries
``mm_embedding_handle``), the call surface and the result's shape:
- ``generate(inputs, sampling_params=None, use_tqdm=True, lora_request=None, ...)``: the inputs
  are one prompt unless they are a list whose first item is not an int ("unbatched = not
  isinstance(inputs, list)", and a list starting with an int is one prompt's ids); each prompt
  goes through ``inputs.data.prompt_inputs``; ``sampling_params`` (and every per-request
  argument) is taken per prompt from a list, else shared; one prompt returns one
  ``RequestOutput``, a batch a list.
- ``generate_async``: ``_prepare_sampling_params`` (None becomes ``SamplingParams()``, another
  type is a TypeError), then the prompt: ``prompt_token_ids`` and ``prompt`` None for ids, the
  text and its tokenization for a ``{"prompt": ...}``.
- ``RequestOutput``: ``request_id``, ``prompt``, ``prompt_token_ids``, ``outputs`` (one
  ``CompletionOutput`` per sequence, ``executor/result.py``), ``finished``; not constructible
  directly. ``shutdown()``.
What the double does NOT imitate: the model. No tokenizer is loaded, so text is tokenized as its
UTF-8 bytes, and the "generated" tokens echo the prompt's ids (``max_tokens`` of them, text
``"<id>"`` each, finish reason "length"; with ``logprobs`` a rank-1 entry of log-probability 0
per token): enough to run a caller's code against the API, not to check outputs.
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Optional

from ..executor.result import CompletionOutput, Logprob
from ..executor.worker import worker_main
from ..inputs.data import prompt_inputs
from ..sampling_params import SamplingParams
from .llm_args import TorchLlmArgs
from .mpi_session import MpiPoolSession


class RequestOutput:
    def __init__(self) -> None:
        raise RuntimeError("RequestOutput is created by the executor; users do not construct it")

    @classmethod
    def _from_generation_result(cls, request_id: int, prompt: Optional[str], prompt_token_ids: list[int],
                                outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
        inst = cls.__new__(cls)
        inst.request_id, inst._prompt, inst.prompt_token_ids = request_id, prompt, prompt_token_ids
        inst.outputs, inst.finished = outputs, finished
        return inst

    @property
    def prompt(self) -> Optional[str]:
        return self._prompt


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
        self._ids = itertools.count()
        self._shut_down = False

    def generate(self, inputs: Any, sampling_params: Any = None, use_tqdm: bool = True, lora_request: Any = None,
                 prompt_adapter_request: Any = None, kv_cache_retention_config: Any = None,
                 disaggregated_params: Any = None, scheduling_params: Any = None, cache_salt: Any = None):
        unbatched = not isinstance(inputs, list) or isinstance(inputs[0], int)
        batch = [inputs] if unbatched else inputs
        results = [self.generate_async(prompt_inputs(item), sampling_params=_item_at(sampling_params, i))
                   for i, item in enumerate(batch)]
        return results[0] if unbatched else results

    def generate_async(self, inputs: Any, sampling_params: Any = None, streaming: bool = False) -> RequestOutput:
        if self._shut_down:
            raise RuntimeError("LLM is shutting down")
        params = self._prepare_sampling_params(sampling_params)
        inputs = prompt_inputs(inputs)
        if "prompt_token_ids" in inputs:
            prompt, prompt_token_ids = None, list(inputs["prompt_token_ids"])
        else:
            prompt, prompt_token_ids = inputs["prompt"], list(inputs["prompt"].encode())
        echoed = list(itertools.islice(itertools.cycle(prompt_token_ids), params.max_tokens))
        output = CompletionOutput(0, "".join(f"<{t}>" for t in echoed), echoed, 0.0,
                                  [{t: Logprob(0.0, 1)} for t in echoed] if params.logprobs else [],
                                  finish_reason="length")
        return RequestOutput._from_generation_result(next(self._ids), prompt, prompt_token_ids, [output], True)

    def _prepare_sampling_params(self, sampling_params: Any) -> SamplingParams:
        if sampling_params is None:
            return SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams or None, got {type(sampling_params)}")
        return sampling_params

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        self.mpi_session.shutdown()
        self._shut_down = self.shut_down = True


class _TorchLLM(BaseLLM):
    pass


class LLM(_TorchLLM):
    pass


def _item_at(maybe_batched: Any, pos: int) -> Any:
    return maybe_batched[pos] if isinstance(maybe_batched, list) else maybe_batched
