# SPDX-License-Identifier: Apache-2.0
"""Which requests an iteration runs: the decode rows' slots reserved (the newest request
preempted while the pool runs dry) and waiting requests admitted while the batch has room and the
KV-cache manager takes them."""

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
        self.prefill_from: dict[int, int] = {}
        """Requests admitted this iteration -> their cached prompt tokens (the prefill skips them)."""

    def schedule_decode(self) -> list[int]:
        """Reserves the decode rows' slots. Usually the free blocks cover every row: one batch
        reservation. Otherwise one by one in admission order, the newest request preempted while
        the pool is dry (a preempted request leaves the batch; older ones keep their slots)."""
        running = list(self.running)
        if self.kv.reserve_decode(running):
            return running
        scheduled: list[int] = []
        preempted: set[int] = set()
        for req_id in running:
            if req_id in preempted:  # preempted below to make room for an older request
                continue
            while not self.kv.reserve(req_id, 1):
                victim = self.running[-1]
                self.preempt(victim)
                preempted.add(victim)
                if victim == req_id:
                    break
            else:
                scheduled.append(req_id)
        return [r for r in scheduled if r not in preempted]

    def admit(self) -> list[int]:
        """Admits waiting requests in order while the batch has room and the KV-cache manager
        takes them (its admission credits the blocks vToken reclaims); reserves each one's
        prompt (after a cached prefix). Returns them, to be prefilled this iteration."""
        joined: list[int] = []
        self.kv.new_iteration()
        while self.waiting and len(self.running) < self.max_batch_size:
            request = self.requests[self.waiting[0]]
            ids = request.prefill_ids()
            cached = self.kv.admit(request.req_id, ids, request.remaining, self.specs[request.req_id])
            if cached is None:
                break
            if not self.kv.reserve(request.req_id, len(ids) - cached):  # greedy admission raced the pool
                self.kv.release(request.req_id)
                break
            self.kv.store_prompt(request.req_id, ids)
            self.prefill_from[request.req_id] = cached
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request.req_id)
            joined.append(request.req_id)
        return joined

    def preempt(self, req_id: int) -> None:
        """Sends a running request back to the front of the queue; its KV is released."""
        request = self.requests[req_id]
        self.running.remove(req_id)
        self.kv.release(req_id)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req_id)
