# SPDX-License-Identifier: Apache-2.0
"""The TensorRT-LLM path of the Triton model: requests go to ``tensorrt_llm.LLM`` (PyTorch backend,
vToken installed through ``vtoken_llm_args``) instead of the reference engine.

``TRTLLMLoop`` has ``EngineLoop``'s interface (start, submit, cancel, stop, in_flight), so the
Triton model does not care which one runs. One asyncio event loop in a thread drives every
request's ``generate_async(prompt_ids, sampling_params, streaming=True)``; TensorRT-LLM's executor
batches them in flight. Each streamed chunk becomes a ``RequestDelta`` for the request's sink; a
sink that reports ``is_cancelled()`` has its request aborted, freeing its KV.

Metrics: the executor worker publishes vToken's counters to ``stats_file``
(``integration/trtllm/stats.py``); the loop polls it every ``poll_s``, adds what only it knows
(requests finished, requests waiting for their first token) and hands the values to ``on_stats``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import itertools
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trtllm_vtoken.integration.trtllm.stats import read_stats
from trtllm_vtoken.runtime.request import RequestDelta
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.serving.engine_loop import Sink


def trtllm_available() -> bool:
    """tensorrt_llm imports and torch sees a GPU: the conditions for ``backend=auto`` to pick it."""
    if importlib.util.find_spec("tensorrt_llm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def trtllm_sampling(params: SamplingParams, api: Any) -> Any:
    """TensorRT-LLM's ``SamplingParams`` for ours (``api`` is ``tensorrt_llm``): the same names
    and meanings (``runtime/sampling.py``), so every field passes as it is."""
    return api.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        seed=params.seed, stop=None if params.stop is None else list(params.stop),
        stop_token_ids=None if params.stop_token_ids is None else list(params.stop_token_ids),
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        ignore_eos=params.ignore_eos, logprobs=params.logprobs,
    )


class TRTLLMLoop:
    """Serves submitted requests through a ``tensorrt_llm.LLM`` (or anything with its
    ``generate_async`` / ``shutdown`` surface).

    Args:
        stats_file: where the worker's ``VTokenKVCacheManager`` publishes its counters; None: no
            metrics.
        on_stats: called on the loop's thread with the metric values every ``poll_s``.
    """

    def __init__(self, llm: Any, api: Any = None, stats_file: str | Path | None = None,
                 on_stats: Callable[[dict[str, float]], None] | None = None, poll_s: float = 0.5) -> None:
        if api is None:
            import tensorrt_llm as api
        self.llm, self.api = llm, api
        self.stats_file, self.on_stats, self.poll_s = stats_file, on_stats, poll_s
        self.finished = 0
        self._ids = itertools.count()
        self._results: dict[int, Any] = {}
        self._started: set[int] = set()  # requests that produced a first chunk
        self._poller: concurrent.futures.Future | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vtoken-trtllm-loop", daemon=True)

    def start(self) -> TRTLLMLoop:
        self._thread.start()
        if self.on_stats is not None:
            self._poller = asyncio.run_coroutine_threadsafe(self._poll_stats(), self._loop)
        return self

    def metrics(self) -> dict[str, float]:
        """The worker's last published counters (if any) plus the loop's own."""
        values = (read_stats(self.stats_file) if self.stats_file else None) or {}
        values["vtoken_requests_finished"] = float(self.finished)
        values["vtoken_requests_waiting"] = float(len(self._results) - len(self._started))
        return values

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
        if self._poller is not None:
            self._poller.cancel()
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
        self.llm.shutdown()

    async def _poll_stats(self) -> None:
        while True:
            self.on_stats(self.metrics())
            await asyncio.sleep(self.poll_s)

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
                    sink.emit(RequestDelta(req_id, (), "", True, "cancelled", produced))
                    return
                self._started.add(req_id)
                out = chunk.outputs[0]
                produced = len(out.token_ids)
                finished = bool(chunk.finished)
                self.finished += finished
                sink.emit(RequestDelta(req_id, tuple(out.token_ids_diff), out.text_diff, finished,
                                       (out.finish_reason or "stop") if finished else None, produced,
                                       out.stop_reason, float(getattr(out, "cumulative_logprob", None) or 0.0)))
        except Exception as exc:
            sink.fail(f"TensorRT-LLM request failed: {exc}")
        finally:
            self._results.pop(req_id, None)
            self._started.discard(req_id)


def trtllm_options(engine) -> dict[str, Any]:
    """The LLM arguments, in TensorRT-LLM's names, that the engine settings give beside vToken's
    own (policy, budget, block size): the batch and its tokens, the overlap scheduler, chunked
    prefill, NGram drafting (``speculative_config``: its fields) and the KV cache's block reuse
    and FP8 dtype (``kv_cache_config``: fields to set on vToken's ``KvCacheConfig``)."""
    options: dict[str, Any] = {"max_batch_size": engine.max_batch_size, "max_seq_len": engine.max_seq_len,
                               "disable_overlap_scheduler": not engine.overlap_scheduler,
                               "enable_chunked_prefill": engine.enable_chunked_prefill}
    if engine.max_num_tokens is not None:
        options["max_num_tokens"] = engine.max_num_tokens
    kv_cache = {}
    if not engine.prefix_caching:
        kv_cache["enable_block_reuse"] = False
    if engine.kv_cache_dtype == "fp8":
        kv_cache["dtype"] = "fp8"
    if kv_cache:
        options["kv_cache_config"] = kv_cache
    spec = engine.speculative_config
    if spec is not None:
        options["speculative_config"] = {"max_draft_len": spec.max_draft_len,
                                         "max_matching_ngram_size": spec.max_matching_ngram_size}
    return options


def make_trtllm_loop(settings, on_stats: Callable[[dict[str, float]], None] | None = None) -> TRTLLMLoop:
    """The LLM for the Triton model's settings, with vToken's hooks, wrapped in a started loop
    whose metrics reach ``on_stats``. vToken's arguments are made before ``import tensorrt_llm``,
    so the settings reach the executor worker on every TensorRT-LLM build (``startup.py``); the
    engine settings TensorRT-LLM has too go with them (``trtllm_options``)."""
    from trtllm_vtoken.integration.trtllm import vtoken_llm_args
    from trtllm_vtoken.runtime.checkpoint import resolve_model

    engine = settings.engine
    if engine.variant != "vtoken" or engine.mode != "dense":
        raise ValueError("the TensorRT-LLM path serves variant 'vtoken' in mode 'dense' only")
    if engine.batch_invariant:
        raise ValueError("batch_invariant is the reference engine's (CPU): TensorRT-LLM's kernels choose their "
                         "reduction order per batch shape")
    stats_file = Path(tempfile.mkdtemp(prefix="vtoken-trtllm-")) / "stats.json"
    args = vtoken_llm_args(policy=engine.policy, budget=engine.budget, tokens_per_block=engine.tokens_per_block,
                           policy_options=dict(engine.policy_options), stats_file=str(stats_file),
                           decode_decision=engine.decode_decision)
    options = trtllm_options(engine)
    import tensorrt_llm

    for key, value in options.pop("kv_cache_config", {}).items():
        setattr(args["kv_cache_config"], key, value)
    if "speculative_config" in options:
        options["speculative_config"] = tensorrt_llm.llmapi.NGramDecodingConfig(**options["speculative_config"])
    llm = tensorrt_llm.LLM(str(resolve_model(settings.model)), **options, **args)
    return TRTLLMLoop(llm, tensorrt_llm, stats_file, on_stats).start()
