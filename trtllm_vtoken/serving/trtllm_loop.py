# SPDX-License-Identifier: Apache-2.0
"""The TensorRT-LLM path of the Triton model: requests go to ``tensorrt_llm.LLM`` (PyTorch backend,
vToken installed through ``vtoken_llm_args``) instead of the reference engine.

``TRTLLMLoop`` has ``EngineLoop``'s interface (start, submit, cancel, stop, in_flight), so the
Triton model does not care which one runs. One asyncio event loop in a thread drives every
request's ``generate_async(prompt_ids, sampling_params, streaming=True)``; TensorRT-LLM's executor
batches them in flight. Each streamed chunk becomes a ``RequestOutput`` for the request's sink; a
sink that reports ``is_cancelled()`` has its request aborted, freeing its KV.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import threading
from typing import Any

from trtllm_vtoken.runtime.request import RequestOutput
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.serving.engine_loop import Sink


def trtllm_available() -> bool:
    """tensorrt_llm imports and torch sees a GPU: the conditions for ``backend=auto`` to pick it."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def trtllm_sampling(params: SamplingParams, api: Any) -> Any:
    """TensorRT-LLM's ``SamplingParams`` for ours (``api`` is ``tensorrt_llm``). Greedy is top_k=1."""
    greedy = params.temperature == 0.0
    return api.SamplingParams(
        max_tokens=params.max_tokens, temperature=None if greedy else params.temperature,
        top_k=1 if greedy else (params.top_k or None), top_p=None if greedy else params.top_p,
        seed=params.seed, stop=list(params.stop) or None, stop_token_ids=list(params.stop_token_ids) or None,
        presence_penalty=params.presence_penalty or None, frequency_penalty=params.frequency_penalty or None,
        ignore_eos=params.ignore_eos,
    )


class TRTLLMLoop:
    """Serves submitted requests through a ``tensorrt_llm.LLM`` (or anything with its
    ``generate_async`` / ``shutdown`` surface)."""

    def __init__(self, llm: Any, api: Any = None) -> None:
        if api is None:
            import tensorrt_llm as api
        self.llm, self.api = llm, api
        self._ids = itertools.count()
        self._results: dict[int, Any] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vtoken-trtllm-loop", daemon=True)

    def start(self) -> TRTLLMLoop:
        self._thread.start()
        return self

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> int:
        req_id = next(self._ids)
        asyncio.run_coroutine_threadsafe(self._serve(req_id, list(prompt_ids), params, sink), self._loop)
        return req_id

    def cancel(self, req_id: int) -> None:
        result = self._results.get(req_id)
        if result is not None:
            self._loop.call_soon_threadsafe(result.abort)

    def in_flight(self) -> int:
        return len(self._results)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Aborts what is still running, stops the event loop and shuts the LLM down."""
        for req_id in list(self._results):
            self.cancel(req_id)
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
        self.llm.shutdown()

    async def _serve(self, req_id: int, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        try:
            result = self.llm.generate_async(prompt_ids, sampling_params=trtllm_sampling(params, self.api),
                                             streaming=True)
        except Exception as exc:  # a refused request (too long, bad parameters): this client only
            sink.fail(f"TensorRT-LLM refused the request: {exc}")
            return
        self._results[req_id] = result
        produced = 0
        try:
            async for chunk in result:
                if sink.is_cancelled():
                    result.abort()
                    sink.emit(RequestOutput(req_id, (), "", True, "cancelled", produced))
                    return
                out = chunk.outputs[0]
                produced = len(out.token_ids)
                finished = bool(chunk.finished)
                sink.emit(RequestOutput(req_id, tuple(out.token_ids_diff), out.text_diff, finished,
                                       (out.finish_reason or "stop") if finished else None, produced,
                                       out.stop_reason, float(getattr(out, "cumulative_logprob", None) or 0.0)))
        except Exception as exc:
            sink.fail(f"TensorRT-LLM request failed: {exc}")
        finally:
            self._results.pop(req_id, None)


def make_trtllm_loop(settings) -> TRTLLMLoop:
    """The LLM for the Triton model's settings, with vToken's hooks, wrapped in a started loop."""
    import tensorrt_llm

    from trtllm_vtoken.integration.trtllm import vtoken_llm_args
    from trtllm_vtoken.runtime.checkpoint import resolve_model

    engine = settings.engine
    if engine.variant != "vtoken" or engine.mode != "dense":
        raise ValueError("the TensorRT-LLM path serves variant 'vtoken' in mode 'dense' only")
    llm = tensorrt_llm.LLM(str(resolve_model(settings.model)), max_batch_size=engine.max_batch_size,
                           max_seq_len=engine.max_seq_len,
                           **vtoken_llm_args(policy=engine.policy, budget=engine.budget,
                                             tokens_per_block=engine.tokens_per_block,
                                             policy_options=dict(engine.policy_options)))
    return TRTLLMLoop(llm, tensorrt_llm).start()
