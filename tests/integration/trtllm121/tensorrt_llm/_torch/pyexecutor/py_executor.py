# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/pyexecutor/py_executor.py`` ``PyExecutor`` (1.2-era copy, index id 736889464):
the executor loop that drives the resource managers, in its real order. Each step below names
the real function; disaggregated serving, speculative decoding, guided decoding, attention DP,
pipeline parallelism and iteration stats are not modelled.

``__init__`` runs ``model_engine.warmup(resource_manager)`` (CUDA-graph warm-up: dummy requests
from ``add_dummy_requests``, a forward, ``free_resources``; no ``update_resources``) and picks the
loop: ``_executor_loop`` when ``disable_overlap_scheduler``, else ``_executor_loop_overlap``.

``_executor_loop``, one iteration:
    _prepare_and_schedule_batch   _fetch_and_activate_new_requests, with a drafter
                                  _prepare_draft_requests (every generation request's
                                  py_draft_tokens = max_total_draft_tokens placeholder zeros,
                                  py_draft_pages_allocated the same: the KV-cache manager and the
                                  scheduler count them), then _schedule (capacity + micro batch);
                                  None when shut down with nothing left
    _pause_requests               req.pause(max_input_len); _terminate_request -> free_resources
    resource_manager.prepare_resources(batch)
    drafter                       prepare_draft_tokens(batch, resource_manager) and
                                  pad_draft_tokens_for_cuda_graph(batch) (NGram; speculative/ngram.py)
    _forward_step                 model_engine.forward(batch, resource_manager, None)
    _sample_async                 sampler.sample_async
    _update_request_states        a context request whose prompt is done -> GENERATION_IN_PROGRESS
    _update_requests              sampler.update_requests: tokens added, stop criteria
    _handle_canceled_requests     cancelled ids -> finish_by_reason(CANCELLED)
    _handle_responses             responses; finished requests -> _terminate_request ->
                                  resource_manager.free_resources(request)   <- BEFORE ...
    resource_manager.update_resources(batch, attn_metadata, kv_cache_dtype_byte_size)

``_executor_loop_overlap``, one iteration (batch N+1 prepared and launched before N is finished):
    _prepare_and_schedule_batch, _pause_requests, prepare_resources(N+1)
    _forward_step(N+1, previous batch's device tokens)   forward N+1 in flight
    _update_requests(N)                                  N's tokens reach the requests only now
    _sample_async(N+1), _update_request_states(N+1)
    _process_previous_batch: _handle_canceled_requests, _handle_responses (free), update_resources(N)
    previous_batch = N+1

A request that finishes on its first token is freed by ``_handle_responses`` and is still in the
batch ``update_resources`` receives. ``start_worker`` runs the loop on a thread as the real
executor does; an exception ends the loop and is re-raised by ``await_responses`` / ``shutdown``
(the real ``_event_loop_wrapper`` logs it and the loop is gone).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .llm_request import FinishReason, LlmRequestState
from .sampler import SampleState
from .scheduler import ScheduledRequests


@dataclass
class Response:
    request_id: int
    tokens: list = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.NOT_FINISHED
    error_msg: str | None = None

    def has_error(self) -> bool:
        return self.error_msg is not None


class PyExecutor:
    def __init__(self, resource_manager, scheduler, model_engine, sampler, *, disable_overlap_scheduler: bool = False,
                 max_input_len: int = 2048, max_batch_size: int = 8, max_num_sequences: int = 8,
                 drafter=None, start_worker: bool = False) -> None:
        self.resource_manager, self.scheduler = resource_manager, scheduler
        self.drafter = drafter
        self.use_spec_decode = drafter is not None
        self.model_engine, self.sampler = model_engine, sampler
        self.disable_overlap_scheduler, self.max_input_len = disable_overlap_scheduler, max_input_len
        self.max_batch_size, self.max_num_active_requests = max_batch_size, max_num_sequences
        self.active_requests: list = []
        self.inflight_req_ids: set = set()
        self.previous_batch: SampleState | None = None
        self.iter_counter = 0
        self.responses: dict[int, Response] = {}
        self._waiting: list = []  # (arrival iteration, request)
        self._canceled: set = set()
        self.is_shutdown = False
        self._shutdown_requested = False
        self.error: BaseException | None = None
        self.is_warmup = True
        self.model_engine.warmup(self.resource_manager)
        self.is_warmup = False
        self.event_loop = self._executor_loop if disable_overlap_scheduler else self._executor_loop_overlap
        self._thread: threading.Thread | None = None
        if start_worker:
            self.start_worker()

    @property
    def resources(self) -> dict:
        return self.resource_manager.resource_managers

    # ---- the client side -------------------------------------------------------------------------
    def enqueue_request(self, request, arrival_iteration: int = 0) -> int:
        self._waiting.append((arrival_iteration, request))
        return request.py_request_id

    def enqueue_requests(self, requests) -> list[int]:
        return [self.enqueue_request(r) for r in requests]

    def cancel_request(self, request_id: int) -> None:
        self._canceled.add(request_id)

    def start_worker(self) -> None:
        self._thread = threading.Thread(target=self._event_loop_wrapper, daemon=True)
        self._thread.start()

    def _event_loop_wrapper(self) -> None:
        try:
            self.event_loop()
        except BaseException as exc:  # the loop is gone; the client learns it on its next call
            self.error = exc
        finally:
            self.is_shutdown = True

    def await_responses(self, request_ids) -> list[Response]:
        self._shutdown_requested = True
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        return [self.responses[r] for r in request_ids]

    def shutdown(self) -> None:
        self._shutdown_requested = True
        if self._thread is not None:
            self._thread.join()
        for manager in self.resource_manager.resource_managers.values():
            manager.shutdown()
        if self.error is not None:
            raise self.error

    def run(self) -> None:
        """Runs the loop on this thread until every enqueued request has ended (test driver)."""
        self._shutdown_requested = True
        self._event_loop_wrapper()
        if self.error is not None:
            raise self.error

    @property
    def should_stop_processing(self) -> bool:
        return self._shutdown_requested and not self.active_requests and not self._waiting

    # ---- the loops ---------------------------------------------------------------------------
    def _executor_loop(self) -> None:
        while True:
            scheduled_batch = self._prepare_and_schedule_batch()
            if scheduled_batch is None:
                break
            self._pause_requests(scheduled_batch.paused_requests)
            if scheduled_batch.batch_size > 0:
                self.resource_manager.prepare_resources(scheduled_batch)
                if self.drafter is not None and self.use_spec_decode:
                    self.drafter.prepare_draft_tokens(scheduled_batch, self.resource_manager)
                    self.drafter.pad_draft_tokens_for_cuda_graph(scheduled_batch)
                batch_outputs = self._forward_step(scheduled_batch)
                sample_state = self.sampler.sample_async(scheduled_batch, batch_outputs)
                self._update_request_states(scheduled_batch)
                self.sampler.update_requests(sample_state, self.resource_manager)
                self._handle_canceled_requests()
                self._handle_responses()
                self.resource_manager.update_resources(scheduled_batch, self.model_engine.attn_metadata, 2.0)
            self.iter_counter += 1

    def _executor_loop_overlap(self) -> None:
        while True:
            scheduled_batch = self._prepare_and_schedule_batch()
            if scheduled_batch is None:
                break
            self._pause_requests(scheduled_batch.paused_requests)
            if scheduled_batch.batch_size > 0:
                self.resource_manager.prepare_resources(scheduled_batch)
                previous = self.previous_batch
                batch_outputs = self._forward_step(scheduled_batch, previous)
                if previous is not None:
                    self.sampler.update_requests(previous, self.resource_manager)
                sample_state = self.sampler.sample_async(scheduled_batch, batch_outputs)
                self._update_request_states(scheduled_batch)
                if previous is not None:
                    self._process_previous_batch(previous)
                self.previous_batch = sample_state
            self.iter_counter += 1

    def _process_previous_batch(self, previous: SampleState) -> None:
        self._handle_canceled_requests()
        self._handle_responses()
        self.resource_manager.update_resources(previous.scheduled_requests, self.model_engine.attn_metadata, 2.0)

    # ---- the steps -----------------------------------------------------------------------------
    def _prepare_and_schedule_batch(self):
        self._fetch_and_activate_new_requests()
        if self.should_stop_processing:
            return None
        if self.drafter is not None:
            self._prepare_draft_requests()
        output = self.scheduler.schedule_request(self.active_requests, self.inflight_req_ids)
        batch = ScheduledRequests(output.context_requests, output.generation_requests, output.paused_requests)
        if batch.batch_size == 0 and not output.paused_requests and self.active_requests and \
                not any(when > self.iter_counter for when, _ in self._waiting):
            # The real loop would spin here forever; the double stops the test instead.
            raise RuntimeError(f"no request can be scheduled: {len(self.active_requests)} active, "
                               f"{self.resource_manager.get_resource_manager('kv_cache_manager').get_num_free_blocks()} "
                               "free blocks")
        return batch

    def _prepare_draft_requests(self) -> None:
        max_total_draft_tokens = self.model_engine.spec_config.max_total_draft_tokens
        for req in self.active_requests:
            if req.state != LlmRequestState.GENERATION_IN_PROGRESS:
                continue
            req.py_last_draft_tokens = req.py_draft_tokens
            drafting = max_total_draft_tokens > 0 and self.use_spec_decode
            req.py_draft_tokens = [0] * max_total_draft_tokens if drafting else []
            req.py_draft_pages_allocated = max_total_draft_tokens if drafting else 0

    def _fetch_and_activate_new_requests(self) -> None:
        arrived = [r for when, r in self._waiting if when <= self.iter_counter]
        room = self.max_num_active_requests - len(self.active_requests)
        taken = arrived[: max(room, 0)]
        self._waiting = [(when, r) for when, r in self._waiting if r not in taken]
        self.active_requests.extend(taken)

    def _pause_requests(self, requests_to_pause) -> None:
        for req in requests_to_pause:
            req.pause(self.max_input_len)
            self._terminate_request(req)

    def _forward_step(self, scheduled_batch, previous_batch=None):
        return self.model_engine.forward(scheduled_batch, self.resource_manager, previous_batch)

    def _update_request_states(self, scheduled_requests) -> None:
        for request in scheduled_requests.context_requests:
            if request.state != LlmRequestState.GENERATION_COMPLETE:
                request.move_to_next_context_chunk()
            if request.context_remaining_length == 0:
                request.state = LlmRequestState.GENERATION_IN_PROGRESS

    def _handle_canceled_requests(self) -> None:
        for request in self.active_requests:
            if request.py_request_id in self._canceled:
                request.finish_by_reason(FinishReason.CANCELLED)
                self._canceled.discard(request.py_request_id)

    def _handle_responses(self) -> list:
        to_terminate, still_active = [], []
        for request in self.active_requests:
            if request.is_finished:
                prompt = request.py_orig_prompt_len
                self.responses[request.py_request_id] = Response(
                    request.py_request_id, request.get_tokens(0)[prompt:], request.finish_reason)
                to_terminate.append(request)
            else:
                still_active.append(request)
        self.active_requests = still_active
        for request in to_terminate:
            self._terminate_request(request)
        return to_terminate

    def _terminate_request(self, request) -> None:
        self.resource_manager.free_resources(request)
