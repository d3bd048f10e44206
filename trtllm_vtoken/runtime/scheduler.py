# SPDX-License-Identifier: Apache-2.0
"""Which requests an iteration runs: the decode rows' slots reserved (the newest request
preempted while the pool runs dry), then its prefill forwards: the next chunk of each prompt being
prefilled in chunks, and waiting requests admitted while the batch has room, the iteration's
tokens (``max_num_tokens``) allow and the KV-cache manager takes them.

With chunked prefill a prompt is cut every ``EngineConfig.prefill_chunk_tokens`` tokens, one
chunk an iteration; a chunk that does not fit the tokens left waits whole for the next iteration
(the cuts never depend on what runs beside the request, and so neither do its decisions):

    iteration      k              k+1            k+2
    request A      chunk [0, c)   chunk [c, 2c)  chunk [2c, P)  -> samples its first token
    decode rows    ...            ...            ...            (one token each, counted first)
"""

from __future__ import annotations

from collections import deque
from typing import Any

from trtllm_vtoken.runtime.request import Request, Status


class Scheduler:
    """Schedules over the engine's request lists, which it changes in place: ``requests`` (by
    id), ``waiting`` (the queue), ``running`` (admission order); ``specs``: each request's policy
    (``PolicySpec`` or None); ``stats``: the engine's (``preemptions``)."""

    def __init__(self, requests: dict[int, Request], waiting: deque[int], running: list[int], kv: Any,
                 specs: dict, max_batch_size: int, stats: Any) -> None:
        self.requests, self.waiting, self.running, self.kv = requests, waiting, running, kv
        self.specs, self.max_batch_size, self.stats = specs, max_batch_size, stats
        self.chunks: dict[int, tuple[int, int, int]] = {}
        """This iteration's prefill forwards: request -> (first, end) of its ``prefill_ids`` to
        compute, and the tokens it found cached at admission (0 after its first chunk)."""
        self.prefilling: dict[int, int] = {}
        """Requests whose prompt is partly prefilled (admission order) -> its tokens done so far."""
        self.preempted_now = False
        """This iteration preempted a request: it admits none while others run (``schedule_prefill``)."""

    def unprefilled(self, req_id: int) -> int:
        """Prompt tokens the request has still to prefill in later chunks."""
        done = self.prefilling.get(req_id)
        return 0 if done is None else len(self.requests[req_id].prefill_ids()) - done

    def forget(self, req_id: int) -> None:
        """The request left the running set (cancelled or preempted): its prefill starts over."""
        self.prefilling.pop(req_id, None)
        self.chunks.pop(req_id, None)

    def schedule_decode(self) -> list[int]:
        """Reserves the decode rows' slots. Usually the free blocks cover every row: one batch
        reservation. Otherwise one by one in admission order, the newest request preempted while
        the pool is dry (a preempted request leaves the batch; older ones keep their slots)."""
        self.preempted_now = False
        running = [r for r in self.running if r not in self.prefilling]
        if self.kv.reserve_decode(running):
            return running
        scheduled: list[int] = []
        preempted: set[int] = set()
        for req_id in running:
            if req_id in preempted:  # preempted below to make room for an older request
                continue
            while not self.kv.reserve(req_id, 1):
                victim = self.running[-1]  # may be a prompt being prefilled in chunks
                self.preempt(victim)
                preempted.add(victim)
                if victim == req_id:
                    break
            else:
                scheduled.append(req_id)
        return [r for r in scheduled if r not in preempted]

    def schedule_prefill(self, decode_rows: int) -> list[int]:
        """This iteration's prefill forwards (``chunks`` says what each computes): the next chunk
        of every prompt being prefilled, in admission order, then new admissions, while the
        iteration's tokens last. Where a chunk finds no room in the pool, the newest prompt being
        prefilled is preempted until it does (the chunk's own request last), as decode rows
        preempt the newest: the oldest prompt always goes on, so two prompts cannot take turns
        preempting each other for ever. An iteration that preempted admits no one while other
        requests run, as vLLM's V1 scheduler schedules no waiting request in a step with
        preemptions (``vllm/v1/core/sched/scheduler.py``): the preempted request, first in the
        queue, would take the blocks just freed back at once, recomputing its prompt for the pool
        to run dry again."""
        cfg = self.kv.config
        tokens = None if cfg.max_num_tokens is None else cfg.max_num_tokens - decode_rows
        scheduled: list[int] = []
        self.kv.new_iteration()  # the blocks keyed before were written by the forwards that ran
        for req_id, done in list(self.prefilling.items()):
            if req_id not in self.prefilling:  # preempted below to make room for an older prompt
                continue
            end = min(len(self.requests[req_id].prefill_ids()), done + cfg.prefill_chunk_tokens)
            if tokens is not None and end - done > tokens:
                break  # it waits whole: where a prompt is cut never depends on the batch
            while not self.kv.reserve(req_id, end - done):
                victim = next(reversed(self.prefilling))  # newer than every prompt scheduled above
                self.preempt(victim)
                if victim == req_id:
                    break
            else:
                self.kv.store_chunk(req_id, self.requests[req_id].prefill_ids()[:end])
                self._chunk(req_id, done, end, cached=0)
                scheduled.append(req_id)
                tokens = None if tokens is None else tokens - (end - done)
        if self.preempted_now and self.running:
            return scheduled
        return scheduled + self.admit(tokens)

    def admit(self, tokens: int | None = None) -> list[int]:
        """Admits waiting requests in order while the batch has room, ``tokens`` (this iteration's
        prefill tokens left; None: no limit) cover their first forward and the KV-cache manager
        takes them (its admission credits the blocks vToken reclaims); reserves each one's prompt
        (after a cached prefix), or its first chunk. Returns them, to be prefilled this iteration."""
        joined: list[int] = []
        chunk = self.kv.config.prefill_chunk_tokens
        while self.waiting and len(self.running) < self.max_batch_size:
            request = self.requests[self.waiting[0]]
            ids = request.prefill_ids()
            first = len(ids) if chunk is None else min(len(ids), chunk)
            if tokens is not None and first > tokens:
                break
            cached = self.kv.admit(request.req_id, ids, request.remaining, self.specs[request.req_id],
                                   request.draft_tokens, in_chunks=self.prefilling)
            if cached is None:
                break
            # A cached prefix ends inside a chunk: the first forward computes the rest of it, so the
            # chunks end where they do without the cache (and the request decides where it does).
            end = len(ids) if chunk is None else min(len(ids), (cached // chunk + 1) * chunk)
            if not self.kv.reserve(request.req_id, end - cached):  # greedy admission raced the pool
                self.kv.release(request.req_id)
                break
            self.kv.store_prompt(request.req_id, ids[:end])
            self._chunk(request.req_id, cached, end, cached)
            tokens = None if tokens is None else tokens - (end - cached)
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request.req_id)
            joined.append(request.req_id)
        return joined

    def _chunk(self, req_id: int, first: int, end: int, cached: int) -> None:
        self.chunks[req_id] = (first, end, cached)
        if end < len(self.requests[req_id].prefill_ids()):
            self.prefilling[req_id] = end
        else:
            self.prefilling.pop(req_id, None)

    def preempt(self, req_id: int) -> None:
        """Sends a running request back to the front of the queue; its KV is released."""
        request = self.requests[req_id]
        self.running.remove(req_id)
        self.kv.release(req_id)
        self.forget(req_id)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.stats.preemptions += 1
        self.preempted_now = True
        self.waiting.appendleft(req_id)
