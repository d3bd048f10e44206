# SPDX-License-Identifier: Apache-2.0
"""Lazy compaction in the background (``StepConfig(compaction="lazy", background=True)``).

With masked attention, holes need not be filled before the next forward. So a lazy plan's copy
runs on the side stream while decoding goes on, and the plan commits at a later step, once its
copy has finished:

    step N     the table call plans (commits nothing); ONE copy of every new plan is submitted;
               the forward of N+1 is NOT made to wait: it reads the tokens at their sources,
               which stay valid (their blocks are not released yet; the destinations are holes,
               masked)
    step N+k   at its end (the iteration's mass is credited to the layout its forward read), if
               the copy's event has completed: the plan commits (moves, the emptied blocks are
               released) if its tokens still sit at its sources (``TokenTable.commit`` accepts a
               lazy plan after evictions and appends made meanwhile); the request may be planned
               again from the next step

A request has one plan in flight at most. On a CPU the copy is synchronous: a plan commits at the
next step of its request. A block a plan in flight reads or writes must not become shared (prefix
caching) before it commits: ``DecodeStep.relocating_blocks`` names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from trtllm_vtoken.reclaim.invariants import LiveSnapshot, check_conservation, snapshot_slots
from trtllm_vtoken.reclaim.step_batch import StepBatchResult

if TYPE_CHECKING:
    from trtllm_vtoken.step.step import DecodeStep


@dataclass
class _Flight:
    tokens: list[int]
    src: list[int]
    dst: list[int]
    blocks: list[int]
    handle: Any
    before: LiveSnapshot | None


class BackgroundCompaction:
    """The lazy plans of one step whose copies are in flight, by request."""

    def __init__(self, step: DecodeStep) -> None:
        self.step = step
        self.in_flight: dict[int, _Flight] = {}

    def may_plan(self, req_ids: np.ndarray) -> np.ndarray:
        """[B] uint8: 1 where the request has no plan in flight."""
        flying = self.in_flight
        return np.fromiter((r not in flying for r in req_ids.tolist()), dtype=np.uint8, count=len(req_ids))

    def start(self, req_ids: np.ndarray, plans: StepBatchResult, snapshot: bool) -> Any:
        """Submits ONE copy of the table call's new plans; records them. Returns the copy (or None)."""
        planned = np.flatnonzero(np.diff(plans.move_offsets) | np.diff(plans.freed_offsets))
        if not len(planned):
            return None
        executor = self.step.executor
        handle = executor.submit_slots(plans.move_src, plans.move_dst) if executor is not None else None
        for i in planned.tolist():
            req_id = int(req_ids[i])
            moves = plans.moves_of(i)
            self.in_flight[req_id] = _Flight([t for t, _, _ in moves], [s for _, s, _ in moves],
                                             [d for _, _, d in moves], plans.freed_of(i), handle,
                                             self._snapshot(req_id) if snapshot else None)
        return handle

    def finish(self, req_ids: np.ndarray, rows: np.ndarray) -> StepBatchResult:
        """Commits the batch's plans whose copies have finished (planned at an earlier step), in
        the table and the slot layout. Returns what they did, row by row (kv_lens: the lengths
        after them). Only the batch's requests with a plan in flight are visited one by one."""
        step, slots = self.step, self.step.slots
        committed: dict[int, tuple[list[tuple[int, int, int]], list[int]]] = {}  # batch index -> (moves, freed)
        flying = self.in_flight
        for i, req_id in enumerate(req_ids.tolist()) if flying else ():
            flight = flying.get(req_id)
            if flight is None or (flight.handle is not None and not flight.handle.done()):
                continue
            del flying[req_id]
            try:
                released = step.core.commit_lazy(req_id, flight.tokens, flight.src, flight.dst, flight.blocks)
            except (KeyError, ValueError) as exc:  # its copy moved KV the table no longer expects there
                raise RuntimeError(f"request {req_id}: a background compaction could not commit: {exc}") from exc
            slots.move(np.asarray(flight.src, dtype=np.int64), np.asarray(flight.dst, dtype=np.int64))
            if flight.before is not None:  # I1 across the whole flight (counted with the step's checks)
                check_conservation(req_id, flight.before, self._snapshot(req_id))
            committed[i] = (list(zip(flight.tokens, flight.src, flight.dst)), released)
        lengths = slots.kv_len[rows]  # a copy: unchanged where nothing committed
        counts = np.zeros(len(rows), dtype=np.int64)
        for i, (_, released) in committed.items():
            counts[i] = len(released)
            if released:
                lengths[i] = step.core.kv_len(int(req_ids[i]))
        slots.set_rows(rows, lengths, lambda i: step.core.block_ids(int(req_ids[i])), counts, tail_only=False)
        return _as_result(len(rows), committed, lengths)

    def blocks(self, tokens_per_block: int) -> set[int]:
        """Blocks the plans in flight read, write or will release."""
        return {s // tokens_per_block for f in self.in_flight.values() for s in f.src + f.dst} | \
            {b for f in self.in_flight.values() for b in f.blocks}

    def drop(self, req_id: int) -> None:
        """The request leaves: its copy must finish before its blocks go back to the pool."""
        flight = self.in_flight.pop(req_id, None)
        if flight is not None and flight.handle is not None:
            flight.handle.synchronize()

    def _snapshot(self, req_id: int) -> LiveSnapshot:
        core = self.step.core
        ids, slots = core.live_slots(req_id)
        return snapshot_slots(core.num_tokens(req_id), ids, slots, list(getattr(self.step.executor, "pools", ()) or ()))


def _as_result(batch: int, committed: dict[int, tuple[list[tuple[int, int, int]], list[int]]],
               kv_lens: np.ndarray) -> StepBatchResult:
    """The committed plans (by ascending batch index) as the table's step reports a batch."""
    move_counts, freed_counts = np.zeros(batch, dtype=np.int64), np.zeros(batch, dtype=np.int64)
    flat: list[tuple[int, int, int]] = []
    freed: list[int] = []
    for i, (moves, released) in committed.items():
        move_counts[i], freed_counts[i] = len(moves), len(released)
        flat += moves
        freed += released
    moved = np.array(flat, dtype=np.int64).reshape(-1, 3)
    offsets = lambda counts: np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # noqa: E731
    return StepBatchResult(offsets(move_counts), moved[:, 0].copy(), moved[:, 1].copy(), moved[:, 2].copy(),
                           offsets(freed_counts), np.array(freed, dtype=np.int64), kv_lens.astype(np.int64))
