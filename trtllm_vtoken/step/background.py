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

Under memory pressure (``StepInput.pressure``: the pool cannot give every row a block for its
next tokens; and ``StepInput.commit_at_once``: a prompt prefilled in chunks has more to come,
whose next chunk needs what holes hold) nothing waits for a later step: the step's new plans and
every plan of the batch in flight commit at its end, and the next forward is ordered after their
copies (as lazy compaction without the background). A plan deferred there would hold the blocks
it frees through the next reservation, which then finds the pool dry: a request alone could be
preempted, and re-admitted with its output as prompt, no longer fit at all.

The Python class below is the specification and serves the Python core; where the C++ core
serves the step, it keeps the plans itself (``NativeBackgroundCompaction``, ``cpp/core/flights.h``).
A request has one plan in flight at most. On a CPU the copy is synchronous: a plan commits at the
next step of its request. A block a plan in flight reads or writes must not become shared (prefix
caching) before it commits: ``DecodeStep.relocating_blocks`` names them.

In the step, after its call: ``finish`` (the plans whose copies finished commit), ``start`` (the
call's new plans, their copy submitted), ``output`` (what the step did, what committed); under
pressure ``start``, ``order_before`` and ``finish(every=True)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from trtllm_vtoken.reclaim.copy import CopyExecutor
from trtllm_vtoken.reclaim.invariants import LiveSnapshot, check_conservation
from trtllm_vtoken.reclaim.step_batch import StepBatchResult
from trtllm_vtoken.step.checks import live_snapshot
from trtllm_vtoken.step.io import StepOutput

if TYPE_CHECKING:
    from trtllm_vtoken.step.core import TableCore
    from trtllm_vtoken.step.slots import SlotMap


@dataclass
class Flight:
    """One request's plan in flight: its moves (token, source and destination slots) and the
    blocks it releases, int64 arrays; its copy's handle; with the step's checks, its live KV before."""

    tokens: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    blocks: np.ndarray
    handle: Any
    before: LiveSnapshot | None


EMPTY = np.zeros(0, dtype=np.int64)


class BackgroundCompaction:
    """The lazy plans of one step whose copies are in flight, by request (``core``, ``slots``,
    ``executor``: the step's token tables, batch layout and copy executor)."""

    def __init__(self, core: TableCore, slots: SlotMap, executor: CopyExecutor | None) -> None:
        self.core, self.slots, self.executor = core, slots, executor
        self.in_flight: dict[int, Flight] = {}

    def may_plan(self, req_ids: np.ndarray) -> np.ndarray:
        """[B] uint8: 1 where the request has no plan in flight."""
        flying = self.in_flight
        return np.fromiter((r not in flying for r in req_ids.tolist()), dtype=np.uint8, count=len(req_ids))

    def start(self, req_ids: np.ndarray, plans: StepBatchResult, snapshot: bool) -> Any:
        """Submits ONE copy of the table call's new plans; records them. Returns the copy (or None)."""
        planned = np.flatnonzero(np.diff(plans.move_offsets) | np.diff(plans.freed_offsets))
        if not len(planned):
            return None
        executor = self.executor
        handle = executor.submit_slots(plans.move_src, plans.move_dst) if executor is not None else None
        moves, freed = plans.move_offsets.tolist(), plans.freed_offsets.tolist()
        for i in planned.tolist():
            req_id = int(req_ids[i])
            lo, hi = moves[i], moves[i + 1]
            self.in_flight[req_id] = Flight(plans.move_tokens[lo:hi], plans.move_src[lo:hi], plans.move_dst[lo:hi],
                                             plans.freed[freed[i] : freed[i + 1]], handle,
                                             self._snapshot(req_id) if snapshot else None)
        return handle

    def finish(self, req_ids: np.ndarray, rows: np.ndarray, every: bool = False) -> StepBatchResult:
        """Commits the batch's plans whose copies have finished (planned at an earlier step), in
        the table and then, all at once, in the slot layout. Returns what they did, row by row
        (kv_lens: the lengths after them). Only the batch's requests with a plan in flight are
        visited one by one. ``every``: all of the batch's plans commit, their copies finished or
        not (the caller ordered what reads their KV after them: ``order_before``). RuntimeError
        if a plan no longer applies (the step is then unusable)."""
        core, slots, flying = self.core, self.slots, self.in_flight
        ready = []  # (batch index, request, flight), ascending
        for i, req_id in enumerate(req_ids.tolist()) if flying else ():
            flight = flying.get(req_id)
            if flight is not None and (every or flight.handle is None or flight.handle.done()):
                ready.append((i, req_id, flight))
        lengths = slots.kv_len[rows]  # a copy: unchanged where nothing commits
        for i, req_id, flight in ready:
            del flying[req_id]
            try:
                core.commit_lazy(req_id, flight.tokens.tolist(), flight.src.tolist(), flight.dst.tolist(),
                                 flight.blocks.tolist())
            except (KeyError, ValueError) as exc:  # its copy moved KV the table no longer expects there
                raise RuntimeError(f"request {req_id}: a background compaction could not commit: {exc}") from exc
            lengths[i] = core.kv_len(req_id)
            if flight.before is not None:  # I1 across the whole flight (counted with the step's checks)
                check_conservation(req_id, flight.before, self._snapshot(req_id))
        committed = _as_result(len(rows), ready, lengths)
        if ready:
            slots.apply_step(EMPTY, EMPTY, committed.move_src, committed.move_dst, rows, req_ids, lengths,
                             committed.freed_offsets, False, core.table)
        return committed

    def order_before(self, stream: Any) -> None:
        """Orders the work queued on ``stream`` next after every copy in flight (None: the host
        waits for them)."""
        order_after({id(f.handle): f.handle for f in self.in_flight.values()}.values(), stream)

    def blocks(self, tokens_per_block: int) -> set[int]:
        """Blocks the plans in flight read, write or will release."""
        return blocks_of(self.in_flight.values(), tokens_per_block)

    def drop(self, req_id: int) -> None:
        """The request leaves: its copy must finish before its blocks go back to the pool."""
        flight = self.in_flight.pop(req_id, None)
        if flight is not None and flight.handle is not None:
            flight.handle.synchronize()

    def requests(self) -> list[int]:
        """The requests with a plan in flight, ascending."""
        return sorted(self.in_flight)

    def flight(self, req_id: int) -> Flight | None:
        """The request's plan in flight (tokens, src, dst, blocks), or None."""
        return self.in_flight.get(req_id)

    def _snapshot(self, req_id: int) -> LiveSnapshot:
        return live_snapshot(self.core, self.executor, req_id)


class NativeBackgroundCompaction:
    """``BackgroundCompaction`` with its plans kept by the C++ core (``cpp/core/flights.h``): a
    step records its new plans, and commits the finished ones in the table and the layout, in one
    native call each. The same effects (the step's parity and fused tests run both); the copies'
    handles and, with the step's checks, each plan's live KV before its flight stay here."""

    def __init__(self, core: TableCore, slots: SlotMap, executor: CopyExecutor | None) -> None:
        self.core, self.slots, self.executor = core, slots, executor
        self.flights = slots.native.LazyFlights()
        self._handles: dict[int, Any] = {}  # submission -> its copy (None: no executor)
        self._before: dict[int, LiveSnapshot] = {}  # with the step's checks: request -> live KV at its plan
        self._submissions = 0

    def may_plan(self, req_ids: np.ndarray) -> np.ndarray:
        """[B] uint8: 1 where the request has no plan in flight."""
        return self.flights.may_plan(req_ids)

    def start(self, req_ids: np.ndarray, plans: StepBatchResult, snapshot: bool) -> Any:
        """Submits ONE copy of the table call's new plans; records them. Returns the copy (or None)."""
        if not len(plans.move_src) and not len(plans.freed):
            return None
        executor = self.executor
        handle = executor.submit_slots(plans.move_src, plans.move_dst) if executor is not None else None
        submission, self._submissions = self._submissions, self._submissions + 1
        planned = self.flights.record(req_ids, plans.move_offsets, plans.move_tokens, plans.move_src, plans.move_dst,
                                      plans.freed_offsets, plans.freed, submission)
        self._handles[submission] = handle
        if snapshot:
            for i in planned.tolist():
                self._before[int(req_ids[i])] = live_snapshot(self.core, self.executor, int(req_ids[i]))
        return handle

    def finish(self, req_ids: np.ndarray, rows: np.ndarray, every: bool = False) -> StepBatchResult:
        """``BackgroundCompaction.finish`` in one native call: the batch's plans whose copies have
        finished (``every``: all of them) commit in the table, then in the layout; what they did,
        row by row."""
        ready = [s for s, handle in self._handles.items() if every or handle is None or handle.done()]
        committed, result = self.flights.commit_ready(self.core.table, self.slots.native_layout(), req_ids, rows,
                                                      ready)
        if ready:
            self._forget_finished()
        for i in committed.tolist() if self._before else ():  # I1 across the whole flight
            req_id = int(req_ids[i])
            check_conservation(req_id, self._before.pop(req_id), live_snapshot(self.core, self.executor, req_id))
        return StepBatchResult(*result)

    def order_before(self, stream: Any) -> None:
        """``BackgroundCompaction.order_before``."""
        order_after(self._handles.values(), stream)

    def blocks(self, tokens_per_block: int) -> set[int]:
        """Blocks the plans in flight read, write or will release."""
        return blocks_of((self.flight(r) for r in self.requests()), tokens_per_block)

    def drop(self, req_id: int) -> None:
        """The request leaves: its copy must finish before its blocks go back to the pool."""
        submission = self.flights.drop(req_id)
        self._before.pop(req_id, None)
        handle = self._handles.get(submission)
        if handle is not None:
            handle.synchronize()
        self._forget_finished()

    def requests(self) -> list[int]:
        """The requests with a plan in flight, ascending."""
        return self.flights.requests()

    def flight(self, req_id: int) -> Flight | None:
        """The request's plan in flight (tokens, src, dst, blocks), or None."""
        found = self.flights.flight(req_id)
        if found is None:
            return None
        tokens, src, dst, blocks, submission = found
        return Flight(tokens, src, dst, blocks, self._handles.get(submission), self._before.get(req_id))

    def _forget_finished(self) -> None:
        """Drops the handles no plan in flight belongs to any more."""
        live = set(self.flights.submissions())
        self._handles = {s: h for s, h in self._handles.items() if s in live}


def background_for(core: TableCore, slots: SlotMap,
                   executor: CopyExecutor | None) -> BackgroundCompaction | NativeBackgroundCompaction:
    """The step's background compaction: kept by the C++ core where it serves the step."""
    return (NativeBackgroundCompaction if core.impl == "cpp" else BackgroundCompaction)(core, slots, executor)


def output(call: StepOutput, committed: StepBatchResult) -> StepOutput:
    """What a step with background compaction did: its call's victims (the call planned, committed
    nothing) and what committed now (``finish``): moves, released blocks, the lengths after them."""
    lost = call.lost + call.table.kv_lens - committed.kv_lens  # from the length after the new tokens
    changed = np.diff(committed.move_offsets) + np.diff(committed.freed_offsets) + lost > 0
    return StepOutput(call.req_ids, call.victim_offsets, call.victims, committed, lost, call.num_tokens, changed)


def order_after(handles: Iterable[Any], stream: Any) -> None:
    """Orders ``stream``'s next work (None: the host) after each of these copies."""
    for handle in handles:
        if handle is None:
            continue
        if stream is None:
            handle.synchronize()
        else:
            handle.make_stream_wait(stream)


def blocks_of(flights: Iterable[Flight], tokens_per_block: int) -> set[int]:
    """Blocks these plans read (sources), write (destinations) or release."""
    out: set[int] = set()
    for f in flights:
        out.update((np.concatenate([f.src, f.dst]) // tokens_per_block).tolist())
        out.update(f.blocks.tolist())
    return out


def _as_result(batch: int, ready: list[tuple[int, int, Flight]], kv_lens: np.ndarray) -> StepBatchResult:
    """The committed plans (ascending batch index) as the table's step reports a batch."""
    index = np.array([i for i, _, _ in ready], dtype=np.int64)
    flights = [f for _, _, f in ready]
    move_counts, freed_counts = np.zeros(batch, dtype=np.int64), np.zeros(batch, dtype=np.int64)
    move_counts[index] = [len(f.src) for f in flights]
    freed_counts[index] = [len(f.blocks) for f in flights]

    def joined(name: str) -> np.ndarray:
        return np.concatenate([getattr(f, name) for f in flights]) if flights else EMPTY.copy()

    def offsets(counts: np.ndarray) -> np.ndarray:
        out = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(counts, out=out[1:])
        return out

    return StepBatchResult(offsets(move_counts), joined("tokens"), joined("src"), joined("dst"), offsets(freed_counts),
                           joined("blocks"), kv_lens.astype(np.int64))
