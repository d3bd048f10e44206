# SPDX-License-Identifier: Apache-2.0
"""The reclamation backend: plan -> copy -> commit, one request at a time, never overlapping.
The per-call API over a Python ``TokenTable`` (the specification the batched step
``trtllm_vtoken.step`` is checked against, and the core benchmark's "calls" row); hosts call the
step instead.

    plan(req)            the dense/lazy planner, from one table snapshot (I4)
    submit(plan)         validate (I4), hash live KV (I1, if checking), start the copy
    commit_*(req)        apply_moves + truncate/release in the table, free blocks in the pool,
                         re-hash (I1) and check the table (I2), if checking; a plan that no
                         longer applies is refused whole (ValueError) and dropped

Commit variants differ only in how they know the copy is done: ``commit_ordered`` makes a stream
wait on the event and commits at once (dense mode on CUDA: the next forward on that stream cannot
run before the copy, I3); ``commit_blocking`` waits on the host (CPU, tests). A lazy plan may
commit after evictions and appends made while its copy ran.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from trtllm_vtoken.core.block_pool import BlockPool
from trtllm_vtoken.core.token_table import TokenTable
from trtllm_vtoken.reclaim.config import ReclaimConfig
from trtllm_vtoken.reclaim.copy import CopyExecutor, CopyHandle
from trtllm_vtoken.reclaim.invariants import (
    LiveSnapshot,
    check_conservation,
    snapshot_live,
    validate_plan,
)
from trtllm_vtoken.reclaim.plan import RelocationPlan
from trtllm_vtoken.reclaim.planner import commit_plan, plan_for_mode


@dataclass
class ReclaimStats:
    plans: int = 0
    moves: int = 0
    blocks_freed: int = 0
    bytes_copied: int = 0
    invariant_checks: int = 0
    plan_seconds: float = 0.0
    """Host time in ``reclaim``: planning, submitting copies (on CUDA: enqueueing them), and
    committing (table, pool, plus the I1/I2 checks when on)."""
    copy_seconds: float = 0.0
    commit_seconds: float = 0.0


@dataclass
class _InFlight:
    plan: RelocationPlan
    handle: CopyHandle
    before: LiveSnapshot | None


class ReclaimBackend:
    """Turns dead tokens into free blocks for all requests of one token table and block pool.

    Args:
        executor: Moves the KV; None for metadata-only use (the simulated-attention backend and
            the core benchmark), where plans are committed as if copied.
    """

    def __init__(
        self,
        table: TokenTable,
        pool: BlockPool,
        executor: CopyExecutor | None = None,
        config: ReclaimConfig | None = None,
    ) -> None:
        if table.tokens_per_block != pool.tokens_per_block:
            raise ValueError(
                f"table tokens_per_block {table.tokens_per_block} != pool {pool.tokens_per_block}"
            )
        self.table = table
        self.pool = pool
        self.executor = executor
        self.config = config or ReclaimConfig()
        self.stats = ReclaimStats()
        self._in_flight: dict[int, _InFlight] = {}

    # ---- planning ------------------------------------------------------------------------------
    def plan(self, req_id: int, pressure: bool = False) -> RelocationPlan | None:
        """A plan for the request under the configured mode, or None if it is not worth one now.

        Lazy mode plans only past the fragmentation threshold, or under memory ``pressure``.
        A request with a plan in flight gets None (it is not eligible until that one commits).
        """
        if req_id in self._in_flight:
            return None
        return plan_for_mode(self.table, req_id, self.config.mode, self.config.fragmentation_threshold, pressure)

    # ---- stage 4: copy -------------------------------------------------------------------------
    def submit(self, plan: RelocationPlan) -> CopyHandle:
        """Starts the plan's copy. Raises ValueError (changing nothing) if it violates I4
        (the layout checks run when ``check_invariants`` is on; the table re-validates every move
        at commit either way)."""
        return self.submit_many([plan])

    def submit_many(self, plans: list[RelocationPlan]) -> CopyHandle:
        """Starts the copies of several requests' plans as one (one launch on CUDA). Raises
        ValueError, changing nothing, if any plan violates I4 or two plans share a request."""
        if len({plan.req_id for plan in plans}) != len(plans):
            raise ValueError("one plan per request at a time")
        for plan in plans:
            validate_plan(self.table, plan, self._in_flight, full=self.config.check_invariants)
        befores = [self._snapshot(plan.req_id) if self.config.check_invariants else None for plan in plans]
        handle = self.executor.submit_many(plans) if self.executor else CopyHandle()
        for plan, before in zip(plans, befores):
            self._in_flight[plan.req_id] = _InFlight(plan, handle, before)
        return handle

    def in_flight(self, req_id: int) -> bool:
        return req_id in self._in_flight

    # ---- commit ----------------------------------------------------------------------------------
    def commit_ordered(self, req_id: int, stream: Any) -> RelocationPlan:
        """Makes ``stream`` wait on the copy, then commits without waiting on the host (I3)."""
        entry = self._entry(req_id)
        entry.handle.make_stream_wait(stream)
        return self._commit(entry)

    def commit_blocking(self, req_id: int) -> RelocationPlan:
        """Waits on the host for this request's copy, then commits."""
        entry = self._entry(req_id)
        entry.handle.synchronize()
        return self._commit(entry)

    def reclaim(self, req_ids: Iterable[int], pressure: bool = False, stream: Any = None) -> int:
        """Plans every request, copies all plans' moves at once, then commits them; returns the
        blocks freed.

        With a ``stream`` (CUDA), commits are ordered on it instead of waited for on the host.
        """
        stats = self.stats
        t0 = time.perf_counter()
        plans = [plan for plan in (self.plan(req_id, pressure) for req_id in req_ids) if plan is not None]
        t1 = time.perf_counter()
        stats.plan_seconds += t1 - t0
        if not plans:
            return 0
        self.submit_many(plans)  # every request's moves in one copy
        t2 = time.perf_counter()
        stats.copy_seconds += t2 - t1
        freed = 0
        for plan in plans:
            done = self.commit_ordered(plan.req_id, stream) if stream is not None else self.commit_blocking(plan.req_id)
            freed += len(done.blocks_to_free)
        stats.commit_seconds += time.perf_counter() - t2
        return freed

    # ---- private ---------------------------------------------------------------------------------
    def _entry(self, req_id: int) -> _InFlight:
        try:
            return self._in_flight[req_id]
        except KeyError:
            raise KeyError(f"request {req_id} has no relocation in flight") from None

    def _commit(self, entry: _InFlight) -> RelocationPlan:
        plan, table = entry.plan, self.table
        try:
            released = commit_plan(table, plan)
        except (KeyError, ValueError):
            # Refused whole, the table unchanged: the plan is dropped so the request can be planned
            # again. Its copy only wrote into the plan's destinations, slots that held no live KV.
            del self._in_flight[plan.req_id]
            raise
        self.pool.free(released)
        del self._in_flight[plan.req_id]
        self.stats.plans += 1
        self.stats.moves += plan.num_moves
        self.stats.blocks_freed += len(plan.blocks_to_free)
        if self.executor is not None:
            self.stats.bytes_copied += plan.num_moves * self.executor.bytes_per_move()
        if entry.before is not None:
            entry.handle.synchronize()
            check_conservation(plan.req_id, entry.before, self._snapshot(plan.req_id))
            table.check_integrity(plan.req_id)
            self.pool.check_integrity()
            self.stats.invariant_checks += 1
        return plan

    def _snapshot(self, req_id: int) -> LiveSnapshot:
        return snapshot_live(self.table, req_id, getattr(self.executor, "pools", ()))
