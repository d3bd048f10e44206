# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/pyexecutor/_util.py`` (1.2-era copies, index ids 843526953, 90899134):

- ``get_kv_cache_manager_cls(model_config)``: a module function returning ``KVCacheManager``
  (sparse attention and hybrid models get other managers, not doubled: an error here);
  ``KvCacheCreator`` reads it as a module global, so a patch of the module attribute applies.
- ``KvCacheCreator``: ``try_prepare_estimation`` sizes a first, small KV cache for the estimation
  run (``_get_token_num_for_estimation``: blocks for the dummy requests' prompts plus one generated
  token each, two with the overlap scheduler, and the draft tokens of a speculative config, twice
  with the overlap scheduler); ``build_managers`` constructs the manager class with
  the real keywords (``_create_kv_cache_manager``: ``num_layers`` the model's whole layer count,
  ``dtype`` the model's as a ``DataType``, ``mapping``, ``max_beam_width``, the model engine's
  ``spec_config``, ...) into
  ``resources["kv_cache_manager"]``; ``configure_kv_cache_capacity(py_executor)`` enqueues the
  dummy context requests (``_create_dummy_context_requests``: prompts of
  ``min(max_num_tokens, max_seq_len - 1)`` random ids, ``max_tokens=1``, ``end_id=-1``),
  ``start_worker``, ``await_responses`` (a response with an error: RuntimeError), then sets the
  final ``max_tokens`` (here: the user's ``max_tokens``, or 64 blocks; memory is not measured);
  ``teardown_managers`` shuts the managers down.
- ``create_py_executor_instance``: the resource manager with the KV-cache manager moved to the
  end, ``BindCapacityScheduler(max_num_sequences, kv_cache_manager.impl, None, policy,
  two_step_lookahead=mapping.has_pp())``, ``BindMicroBatchScheduler(max_batch_size,
  max_num_tokens, ctx_chunk_config)``, ``SimpleScheduler``, the sampler, and ``PyExecutor`` (which
  warms up). ``ctx_chunk_config`` (``py_executor_creator.py``, index ids 4285525045, 3245286861):
  None unless ``enable_chunked_prefill``; then ``(scheduler_config.context_chunking_policy or
  FIRST_COME_FIRST_SERVED, tokens_per_block)`` (no sliding window here, so the unit is a block).
"""

from __future__ import annotations

import random

from ...bindings import CacheType, DataType
from .py_executor import PyExecutor
from .resource_manager import KVCacheManager, ResourceManager
from .llm_request import LlmRequest, SamplingConfig
from .sampler import TorchSampler
from .scheduler import BindCapacityScheduler, BindMicroBatchScheduler, ContextChunkingPolicy, SimpleScheduler


def get_kv_cache_manager_cls(model_config):
    if model_config.sparse_attention_config is not None:
        raise NotImplementedError("sparse-attention managers are not doubled")
    return KVCacheManager


def greedy_token(request) -> int:
    """The token the double's sampler picks next for a request: a fixed function of the request
    and its length, standing for the model's greedy choice (never 0, 1 or an id past the vocab)."""
    return (request.py_request_id * 7919 + request.get_num_tokens(0) * 104729) % 500 + 2


class KvCacheCreator:
    def __init__(self, *, model_engine, mapping, kv_cache_config, max_seq_len: int, max_batch_size: int,
                 tokens_per_block: int, max_beam_width: int, max_num_tokens: int, kv_connector_manager=None,
                 llm_args=None, **kwargs) -> None:
        self._model_engine, self._mapping, self._kv_cache_config = model_engine, mapping, kv_cache_config
        self._max_kv_tokens_in = kv_cache_config.max_tokens
        self._max_seq_len, self._max_batch_size = max_seq_len, max_batch_size
        self._tokens_per_block, self._max_beam_width, self._max_num_tokens = tokens_per_block, max_beam_width, max_num_tokens
        self._kv_connector_manager = kv_connector_manager
        self._overlap = not getattr(llm_args, "disable_overlap_scheduler", True)
        self._dummy_reqs: list | None = None
        self._kv_cache_manager_cls = get_kv_cache_manager_cls(model_engine.model.model_config)

    def _create_dummy_context_requests(self, input_seq_len: int) -> list:
        vocab = self._model_engine.model.model_config.pretrained_config.vocab_size
        rng = random.Random(0)
        requests, remaining, request_id = [], self._max_num_tokens, 1 << 40
        input_seq_len = min(self._max_num_tokens, input_seq_len)
        while remaining > 0:
            length = min(input_seq_len, remaining)
            requests.append(LlmRequest(request_id=request_id, max_new_tokens=1,
                                       input_tokens=[rng.randrange(vocab) for _ in range(length)],
                                       sampling_config=SamplingConfig(self._max_beam_width), end_id=-1))
            remaining -= length
            request_id += 1
        return requests

    def _get_token_num_for_estimation(self) -> int:
        drafts = getattr(self._model_engine.spec_config, "max_total_draft_tokens", 0) or 0
        extra = 1 + drafts + ((1 + drafts) if self._overlap else 0)
        if self._dummy_reqs is None:
            self._dummy_reqs = self._create_dummy_context_requests(max(1, self._max_seq_len - 1))
        tpb = self._tokens_per_block
        blocks = sum(-(-(req.prompt_len + extra) // tpb) for req in self._dummy_reqs)
        return blocks * tpb

    def try_prepare_estimation(self) -> bool:
        self._kv_cache_config.max_tokens = self._get_token_num_for_estimation()
        return True

    def build_managers(self, resources: dict, estimating_kv_cache: bool = False) -> None:
        config = self._model_engine.model.model_config.pretrained_config
        resources["kv_cache_manager"] = self._kv_cache_manager_cls(
            self._kv_cache_config, CacheType.SELF, num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
            tokens_per_block=self._tokens_per_block, max_seq_len=self._max_seq_len,
            max_batch_size=self._max_batch_size, mapping=self._mapping, dtype=DataType.BF16,
            spec_config=self._model_engine.spec_config,
            max_num_tokens=self._max_num_tokens, model_config=None, max_beam_width=self._max_beam_width,
            is_draft=False, kv_connector_manager=self._kv_connector_manager, sparse_attn_config=None,
            is_estimating_kv_cache=estimating_kv_cache)

    def configure_kv_cache_capacity(self, py_executor: PyExecutor) -> None:
        req_ids = py_executor.enqueue_requests(self._dummy_reqs)
        py_executor.is_warmup = True
        py_executor.start_worker()
        for response in py_executor.await_responses(req_ids):
            if response.has_error():
                raise RuntimeError(response.error_msg)
        self._kv_cache_config.max_tokens = self._max_kv_tokens_in or 64 * self._tokens_per_block

    def teardown_managers(self, resources: dict) -> None:
        for manager in resources.values():
            manager.shutdown()
        resources.clear()


def create_py_executor_instance(*, model_engine, resources: dict, mapping, llm_args, max_seq_len: int,
                                max_batch_size: int, max_num_tokens: int, drafter=None) -> PyExecutor:
    resource_manager = ResourceManager(resources)
    resource_manager.resource_managers.move_to_end("kv_cache_manager", last=True)
    kv_cache_manager = resources["kv_cache_manager"]
    capacity = BindCapacityScheduler(max_batch_size, kv_cache_manager.impl, None,
                                     llm_args.scheduler_config.capacity_scheduler_policy,
                                     two_step_lookahead=mapping.has_pp())
    ctx_chunk_config = None
    if llm_args.enable_chunked_prefill:
        policy = llm_args.scheduler_config.context_chunking_policy or ContextChunkingPolicy.FIRST_COME_FIRST_SERVED
        ctx_chunk_config = (policy, kv_cache_manager.tokens_per_block)
    scheduler = SimpleScheduler(capacity, BindMicroBatchScheduler(max_batch_size, max_num_tokens, ctx_chunk_config))
    return PyExecutor(resource_manager, scheduler, model_engine, TorchSampler(greedy_token, max_seq_len),
                      disable_overlap_scheduler=llm_args.disable_overlap_scheduler,
                      max_input_len=llm_args.max_input_len, max_batch_size=max_batch_size,
                      max_num_sequences=max_batch_size, drafter=drafter)
