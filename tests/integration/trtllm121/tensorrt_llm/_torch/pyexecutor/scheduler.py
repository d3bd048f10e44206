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
- ``BindMicroBatchScheduler(max_batch_size, max_num_tokens)``: ``MicroBatchScheduler::operator()``
  (``microBatchScheduler.cpp``, index ids 653260947, 37123910384): the fitting requests in order,
  those in flight skipped, at most ``max_batch_size`` of them and ``max_num_tokens`` tokens (a
  context request counts its remaining prompt, a generation request one token; the first that
  does not fit ends the batch); split into context and generation requests.
- ``SimpleScheduler.schedule_request(active_requests, inflight_request_ids)``: capacity, then
  micro batch, into a ``SchedulerOutput``.
"""

from __future__ import annotations

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


class BindMicroBatchScheduler:
    def __init__(self, max_batch_size: int, max_num_tokens: int | None = None, ctx_chunk_config=None) -> None:
        if ctx_chunk_config is not None:
            raise NotImplementedError("chunked prefill is not modelled (vToken turns it off)")
        self.max_batch_size, self.max_num_tokens = max_batch_size, max_num_tokens

    def schedule(self, active_requests: list, inflight_request_ids: set) -> tuple[list, list]:
        context, generation = [], []
        tokens = 0
        for req in active_requests:
            if req.py_request_id in inflight_request_ids:
                continue
            if len(context) + len(generation) >= self.max_batch_size:
                break
            need = req.context_remaining_length if req.is_context_init_state() else 1
            if self.max_num_tokens is not None and tokens + need > self.max_num_tokens:
                break
            tokens += need
            (context if req.is_context_init_state() else generation).append(req)
        return context, generation


class SimpleScheduler:
    def __init__(self, capacity_scheduler: BindCapacityScheduler, micro_batch_scheduler: BindMicroBatchScheduler) -> None:
        self.capacity_scheduler, self.micro_batch_scheduler = capacity_scheduler, micro_batch_scheduler

    def schedule_request(self, active_requests: list, inflight_request_ids: set) -> SchedulerOutput:
        fitting, disagg, paused = self.capacity_scheduler.schedule_request(active_requests)
        context, generation = self.micro_batch_scheduler.schedule(fitting, inflight_request_ids)
        return SchedulerOutput(context, generation, paused, disagg, len(fitting))
