# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/pyexecutor/scheduler.py`` (1.2-era copies, index ids 19133766724, 53336218421)
and of the C++ schedulers its ``Bind*`` classes wrap.

- ``ScheduledRequests``: context requests, then generation requests (the batch order the model
  engine and the metadata rows follow), and the requests the capacity scheduler paused.
- ``BindCapacityScheduler(max_num_requests, kv_cache_manager.impl, peft, policy,
  two_step_lookahead)``: the executor creator hands it the C++ manager (``_util.py``
  ``create_py_executor_instance``, index id 90899134: ``kv_cache_manager.impl``,
  ``two_step_lookahead=mapping.has_pp()``), so a Python override of the KV-cache manager never
  reaches admission. ``MAX_UTILIZATION`` only (vToken's setting): ``MaxUtilizationScheduler::
  operator()`` (``capacityScheduler.cpp``, index id 610139638): ``startScheduling``; active
  requests in order, those not yet in CONTEXT_INIT or already GENERATION_COMPLETE skipped; a
  request fits if the blocks scheduled so far plus its ``getNeededBlocksOneStep`` fit the
  scheduling count of free blocks (``MaxUtilizationScheduledBlocksManager``); one that does not
  fit pauses the LAST started request (a generation request, or a context request past its first
  chunk) still ahead in the list (``schedulingRemoveSequence``: its blocks count as free) and is
  tried again; with none left to pause, scheduling stops. Returns (fitting, paused).
  ``GUARANTEED_NO_EVICT`` (TensorRT-LLM's default; ``GuaranteedNoEvictScheduler``): started
  requests first, each reserving its ``getRemainingBlocksToCompletion``; then requests still in
  their first context chunk, in order, while their remaining blocks fit the free blocks left.
- ``BindMicroBatchScheduler(max_batch_size, max_num_tokens, ctx_chunk_config)``:
  ``MicroBatchScheduler::operator()`` (``microBatchScheduler.cpp``, index ids 653260947,
  37123910384; the Python class, ``scheduler.py`` index id 19133766724, builds it with
  ``max_num_tokens`` as its ``maxContextLength``): the fitting requests in order, those in flight
  skipped, at most ``max_batch_size`` of them. A generation request counts one token and its
  draft tokens, and the first that does not fit ``max_num_tokens`` ends the batch. Without chunking a context request
  counts its remaining prompt the same way (longer than ``maxContextLength``: "The number of
  context tokens exceeds the limit value", a RuntimeError). With ``ctx_chunk_config = (policy, chunk_unit_size)`` (chunked prefill;
  ``py_executor_creator.py`` passes the tokens per block as the unit) context requests are set
  aside with their remaining prompt as chunk; if they do not all fit the tokens the generation
  requests left (or one is longer than ``maxContextLength``), ``setCtxRequestsChunkSize`` cuts
  them: FIRST_COME_FIRST_SERVED gives each in turn what is left, at most ``maxContextLength`` (cut
  down to whole units unless it is its whole remainder), EQUAL_PROGRESS adds a unit to each in
  turn while one fits both limits. Requests left with a chunk of 0 wait; the others are
  scheduled, those not on their last chunk first (``sortRequests``, ``inflightBatchingUtils.cpp``,
  index id 149516547: a partition, which this double keeps stable).
- ``SimpleScheduler.schedule_request(active_requests, inflight_request_ids)``: capacity, then
  micro batch, into a ``SchedulerOutput``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ...llmapi.llm_args import CapacitySchedulerPolicy
from .llm_request import LlmRequestState


@dataclass
class ScheduledRequests:
    context_requests: list = field(default_factory=list)
    generation_requests: list = field(default_factory=list)
    paused_requests: list = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)

    @property
    def can_run_cuda_graph(self) -> bool:
        return not self.context_requests

    def all_requests(self) -> list:
        return self.context_requests + self.generation_requests


@dataclass
class SchedulerOutput:
    context_requests: list
    generation_requests: list
    paused_requests: list
    fitting_disagg_gen_init_requests: list
    num_fitting_requests: int


class BindCapacityScheduler:
    def __init__(self, max_num_requests: int, kv_cache_manager, peft_cache_manager=None,
                 scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
                 two_step_lookahead: bool = False) -> None:
        if scheduler_policy not in (CapacitySchedulerPolicy.MAX_UTILIZATION,
                                    CapacitySchedulerPolicy.GUARANTEED_NO_EVICT):
            raise NotImplementedError(f"the double does not model {scheduler_policy}")
        self.policy = scheduler_policy
        self.max_num_requests = max_num_requests
        self.kv_cache_manager = kv_cache_manager  # the C++ manager (impl)
        self.two_step_lookahead = two_step_lookahead

    @staticmethod
    def _started(req) -> bool:
        return (req.is_context_init_state() and not req.is_first_context_chunk) or \
            req.is_generation_in_progress_state()

    @staticmethod
    def _schedulable(req) -> bool:
        return LlmRequestState.CONTEXT_INIT <= req.state < LlmRequestState.GENERATION_COMPLETE

    def schedule_request(self, active_requests: list) -> tuple[list, list, list]:
        if self.policy == CapacitySchedulerPolicy.GUARANTEED_NO_EVICT:
            return self._guaranteed_no_evict(active_requests)
        return self._max_utilization(active_requests)

    def _guaranteed_no_evict(self, active_requests: list) -> tuple[list, list, list]:
        impl = self.kv_cache_manager
        available = impl.get_kv_cache_stats().free_num_blocks
        scheduled = []
        for req in active_requests:
            if self._schedulable(req) and self._started(req) and len(scheduled) < self.max_num_requests:
                available -= impl.get_remaining_blocks_to_completion(req)
                scheduled.append(req)
        for req in active_requests:
            if self._schedulable(req) and not self._started(req) and len(scheduled) < self.max_num_requests:
                needed = impl.get_remaining_blocks_to_completion(req)
                if needed > available:
                    break
                available -= needed
                scheduled.append(req)
        return scheduled, [], []

    def _max_utilization(self, active_requests: list) -> tuple[list, list, list]:
        impl = self.kv_cache_manager
        impl.start_scheduling()
        scheduled, paused = [], []
        scheduled_blocks = 0
        candidates = list(active_requests)
        end = len(candidates)
        i = 0
        while i < end:
            req = candidates[i]
            if not self._schedulable(req):
                i += 1
                continue
            needed = impl.get_needed_blocks_one_step(req, self.two_step_lookahead)
            if len(scheduled) < self.max_num_requests and impl.scheduling_has_free_blocks(scheduled_blocks + needed):
                scheduled_blocks += needed
                scheduled.append(req)
                i += 1
                continue
            last = next((j for j in range(end - 1, i - 1, -1) if self._started(candidates[j])), None)
            if last is None:
                break
            impl.scheduling_remove_sequence(candidates[last].py_request_id)
            paused.append(candidates[last])
            end = last
        return scheduled, [], paused


class ContextChunkingPolicy(str, enum.Enum):
    FIRST_COME_FIRST_SERVED = "FIRST_COME_FIRST_SERVED"
    EQUAL_PROGRESS = "EQUAL_PROGRESS"


class BindMicroBatchScheduler:
    def __init__(self, max_batch_size: int, max_num_tokens: int | None = None, ctx_chunk_config=None) -> None:
        self.max_batch_size, self.max_num_tokens = max_batch_size, max_num_tokens
        self.max_context_length = max_num_tokens  # MicroBatchScheduler(ctx_chunk_config_cpp, max_num_tokens)
        self.ctx_chunk_config = None
        if ctx_chunk_config is not None:
            policy, unit = ctx_chunk_config
            self.ctx_chunk_config = (ContextChunkingPolicy(getattr(policy, "value", policy)), int(unit))

    def schedule(self, active_requests: list, inflight_request_ids: set) -> tuple[list, list]:
        context, generation, to_chunk = [], [], []
        tokens = chunked_tokens = scheduled = 0
        limit, all_fit = self.max_context_length, True
        for req in active_requests:
            if req.py_request_id in inflight_request_ids:
                continue
            if req.is_context_init_state() and self.ctx_chunk_config is not None:
                req.context_chunk_size = req.context_remaining_length
                to_chunk.append(req)
                need = req.context_chunk_size
                if limit is not None and need > limit:  # chunked later
                    need, all_fit = limit, False
                chunked_tokens += need
            else:
                need = req.context_remaining_length if req.is_context_init_state() else 1 + len(req.py_draft_tokens)
                if req.is_context_init_state() and limit is not None and need > limit:
                    raise RuntimeError(f"[TensorRT-LLM][ERROR] Assertion failed: The number of context tokens ({need}) "
                                       f"exceeds the limit value ({limit})")
                if self.max_num_tokens is not None and tokens + need > self.max_num_tokens:
                    break
                tokens += need
                (context if req.is_context_init_state() else generation).append(req)
            scheduled += 1
            if scheduled >= self.max_batch_size:
                break
        if self.max_num_tokens is not None and chunked_tokens > self.max_num_tokens - tokens:
            all_fit = False
        if not all_fit:
            self._set_chunk_sizes(to_chunk, self.max_num_tokens - tokens)
        chunks = [req for req in to_chunk if req.context_chunk_size > 0]
        if not all_fit:  # sortRequests: chunks that do not end their prompt first
            chunks = [r for r in chunks if not r.is_last_context_chunk] + [r for r in chunks if r.is_last_context_chunk]
        return context + chunks, generation

    def _set_chunk_sizes(self, requests: list, capacity: int) -> None:
        """``setCtxRequestsChunkSize``: the chunk of each request in ``requests``, ``capacity`` tokens in all."""
        policy, unit = self.ctx_chunk_config
        limit = self.max_context_length
        for req in requests:
            req.context_chunk_size = 0
        if policy == ContextChunkingPolicy.FIRST_COME_FIRST_SERVED:
            for req in requests:
                wanted = req.context_remaining_length
                size = min(capacity, wanted, limit if limit is not None else wanted)
                if size != wanted:
                    size = size // unit * unit
                req.context_chunk_size = size
                capacity -= size
            return
        used, progress = 0, 1
        while used < capacity and progress:
            progress = 0
            for req in requests:
                past = req.context_chunk_size
                req.context_chunk_size = past + unit
                grown = req.context_chunk_size - past
                if used + grown > capacity or (limit is not None and req.context_chunk_size > limit):
                    req.context_chunk_size = past
                    continue
                used += grown
                progress += grown


class SimpleScheduler:
    def __init__(self, capacity_scheduler: BindCapacityScheduler, micro_batch_scheduler: BindMicroBatchScheduler) -> None:
        self.capacity_scheduler, self.micro_batch_scheduler = capacity_scheduler, micro_batch_scheduler

    def schedule_request(self, active_requests: list, inflight_request_ids: set) -> SchedulerOutput:
        fitting, disagg, paused = self.capacity_scheduler.schedule_request(active_requests)
        context, generation = self.micro_batch_scheduler.schedule(fitting, inflight_request_ids)
        return SchedulerOutput(context, generation, paused, disagg, len(fitting))
