# SPDX-License-Identifier: Apache-2.0
"""The engine's overlap scheduler: the step of iteration N runs beside the forward of N+1.

With ``EngineConfig.overlap_scheduler`` the engine orders one iteration as TensorRT-LLM's
``_executor_loop_overlap`` does (docs/overlap.md):

    iteration N+1   reserve N+1's slots (after N's tokens, which no step has taken in yet)
                    set_batch(N+1)          forward N+1's layout is fixed here
                    start step N            its decision and tables beside the forward
                    forward N+1             reads the layout as it was before step N
                    finish step N           its copy after forward N+1 (CPU: the forward has
                                            returned; CUDA: the side stream waits for it)
                    sample N+1, release the requests that finished, defer step N+1

This is the order for rows whose policy observes attention (H2O, Scissorhands) and whose step
N, by their counts, evicts nothing (``EngineConfig.decode_decision="at_once"``, the default), or
every such row with ``"lagged"``. Step N registers every token reserved for its rows, N+1's
included, so its plan counts them as present; its decision reads forward N's attention mass;
lagged, its evictions take effect in forward N+2: a one-step lag, the same for naive-evict and
vtoken, which therefore still decode alike. Rows whose policy decides from counts (StreamingLLM,
sliding window, Random), and deciding at once the observing rows whose step may evict
(``may_evict_next``), take step N at the end of iteration N instead, before N+1's slots are
reserved: no lag, the plain order's decisions.

Forward N's mass is laid out by the positions forward N saw, and step N-1 may have moved tokens
since (compaction, or a dead block dropped): ``DeferredStep`` keeps the logical id at each of
forward N's positions (``layout_ids``), and where step N-1 changed a layout ``remap_mass`` lays
the mass out again by the layout step N sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from trtllm_vtoken.runtime.request import RequestDelta, Status


@dataclass
class DeferredStep:
    """A forward's rows, waiting for their step beside the next forward."""

    rows: list[int]
    mass: Any
    """[B, L] by the forward's positions (a host array), a function of the layout (the simulated
    backend's attention, evaluated when the step runs), or None."""
    ids: np.ndarray | None
    """[B, W] int64: the logical id at each position the forward saw (-1: none)."""
    queries: list[int]
    """Each row's new tokens (the queries whose attention the mass is)."""
    moved: bool
    """Whether the step that ran beside the forward changed a layout (evicted, moved or released):
    only then do the forward's positions differ from its step's, and its mass is laid out again."""


def rows_of(mass: Any, index: list[int], batch: int) -> Any:
    """The rows ``index`` of a batch's mass [B, L] (a host array); anything else as it is (None,
    or the simulated backend's function of the layout, evaluated when the step runs)."""
    if isinstance(mass, np.ndarray) and len(index) < batch:
        return mass[index]
    return mass


def pending_rows(layout: Any, writes: Any, req_ids: list[int]) -> list[tuple[int, int, int]]:
    """Per request: (kv_len, token count, tokens reserved and not yet taken in: a cached prefix,
    earlier forwards', this one's), the layout as a forward over it sees it now."""
    return [(layout.kv_len(r), layout.num_tokens(r), writes.pending_tokens(r)) for r in req_ids]


def layout_ids(layout: Any, writes: Any, req_ids: list[int]) -> np.ndarray:
    """[B, W] int64: the logical id at each position of each request's KV as a forward over it
    sees it now: the step's table (``batch_tokens``: live ids, -1 where none), then the tokens
    reserved and not yet taken in, in order."""
    table = layout.batch_tokens(req_ids).astype(np.int64)
    rows = pending_rows(layout, writes, req_ids)
    width = max([table.shape[1]] + [kv_len + pending for kv_len, _, pending in rows])
    ids = np.full((len(req_ids), width), -1, dtype=np.int64)
    ids[:, : table.shape[1]] = table
    for i, (kv_len, num_tokens, pending) in enumerate(rows):
        ids[i, kv_len : kv_len + pending] = np.arange(num_tokens, num_tokens + pending)
    return ids


def widened(mass: np.ndarray, layout: Any, writes: Any, req_ids: list[int]) -> np.ndarray:
    """``mass`` [B, W] of a forward whose positions the step beside it left as they were, with
    zero columns up to the longest request's KV now (the step registers the next forward's
    tokens, which this forward did not attend)."""
    width = max(kv_len + pending for kv_len, _, pending in pending_rows(layout, writes, req_ids))
    if mass.shape[1] >= width:
        return mass
    out = np.zeros((mass.shape[0], width), dtype=mass.dtype)
    out[:, : mass.shape[1]] = mass
    return out


def may_evict_next(kv: Any, req_ids: list[int]) -> list[bool]:
    """Per request: could its step evict once the tokens it has written and not taken in yet, and
    its next decode token, have joined its table (``DecodeStep.may_evict``)? False for native.
    (No drafts: speculative decoding turns the overlap scheduler off.)"""
    if kv.step is None or not req_ids:
        return [False] * len(req_ids)
    return kv.step.may_evict(req_ids, [kv.writes.pending_tokens(r) + 1 for r in req_ids]).tolist()


def remap_mass(mass: np.ndarray, old_ids: np.ndarray, new_ids: np.ndarray) -> np.ndarray:
    """``mass`` [B, >= W_old] laid out by ``old_ids`` [B, W_old], laid out again by ``new_ids``
    [B, W_new]: each token's mass moves to its position now; positions of tokens the old layout
    did not have (or of no token) get 0. float32 [B, W_new]."""
    rows, width = new_ids.shape
    out = np.zeros((rows, width), dtype=np.float32)
    top = int(max(old_ids.max(initial=-1), new_ids.max(initial=-1))) + 1
    if top == 0:
        return out
    where = np.full((rows, top), -1, dtype=np.int64)  # logical id -> its position in the old layout
    r, c = np.nonzero(old_ids >= 0)
    where[r, old_ids[r, c]] = c
    r, c = np.nonzero(new_ids >= 0)
    source = where[r, new_ids[r, c]]
    found = (source >= 0) & (source < mass.shape[1])
    out[r[found], c[found]] = mass[r[found], source[found]]
    return out


class OverlapIteration:
    """The engine's iteration under the overlap scheduler (a mixin of ``Engine``: it reads the
    engine's ``kv``, ``forwards``, ``requests``, ``config`` and ``simulated``, keeps the deferred
    step in ``_deferred``, ``_layout_now`` and ``_stepped``, and samples and ends steps with the
    engine's ``_run_forwards``, ``_advance`` and ``_end_step``)."""

    def _step_overlapped(self, reported: list[RequestDelta], decode: list[int], prefill: list[int]):
        """The overlap scheduler's iteration (``runtime/overlap.py``): the previous iteration's
        step starts once this iteration's first forward has its layout, runs beside it, and
        finishes after the forwards; this iteration's rows wait for the next one."""
        deferred, self._deferred = self._deferred, None
        self.forwards.before_model = lambda: self._launch_deferred(deferred, decode + prefill, prefill)
        results, masses = self._run_forwards(decode, prefill)
        if self.forwards.before_model is not None:  # no forward ran
            self._launch_deferred(deferred, [], prefill)
            self.forwards.before_model = None
        out = self.kv.finish_step()
        self.forwards.wait()  # sampling reads the forwards' logits
        for request, logits, _ in results:
            if logits is not None:  # None: a prompt's chunk before its last
                reported.append(self._advance(request, logits))
        self._end_step(self._stepped, out, reported, stepped=deferred is not None)
        rows = [request.req_id for request, *_ in results]
        at_once = self._taken_at_once(rows, prefill)
        taken_now = set(at_once)
        lagged = [i for i in range(len(rows)) if i not in taken_now]
        queries = [r[2] for r in results]
        mass = None if self.simulated or not rows else self.forwards.batch_mass(rows, masses, queries)
        ids = self._layout_now
        moved = out is not None and bool(out.num_evicted or out.num_changed)  # the step beside these forwards
        if lagged:
            self._deferred = DeferredStep([rows[i] for i in lagged], rows_of(mass, lagged, len(rows)),
                                          None if ids is None else ids[lagged], [queries[i] for i in lagged], moved)
        now = [i for i in at_once if self.requests[rows[i]].status is Status.RUNNING]
        if now:  # the copy follows this iteration's forwards; the mass is theirs (on the host)
            stepped = [rows[i] for i in now]
            if self.simulated:
                now_mass = self.forwards.batch_mass(stepped, [], [queries[i] for i in now])
            else:
                now_mass = self._as_the_step_sees(rows_of(mass, now, len(rows)), None if ids is None else ids[now],
                                                  moved, stepped)
            self.kv.start_step(stepped, now_mass, overlap=self.config.step_overlap,
                               prompt_goes_on=bool(self.scheduler.prefilling))
            self._end_step(stepped, self.kv.finish_step(), reported, iteration=False)
        return reported

    def _taken_at_once(self, rows: list[int], prefill: list[int]) -> list[int]:
        """The indices of ``rows`` whose step this iteration runs now, before the next forward's
        slots and tables, so that their decisions land in the next forward as in the plain order:
        rows whose policy decides from counts alone (StreamingLLM, sliding window, Random); with
        ``prefill_decision="at_once"`` this iteration's prefills; with ``decode_decision="at_once"``
        the decode rows whose step may evict with the next token (``may_evict_next``). The other
        rows, whose policy observes attention, wait for the next iteration, their step beside its
        forward: it takes the next forward's tokens in too, and evicts nothing where the counts
        said so (the plain order's steps exactly), or decides one iteration late ("lagged")."""
        kv, cfg = self.kv, self.config
        at_once, observing = [], []
        for i, req_id in enumerate(rows):
            if kv.decides_from_counts(req_id) or (req_id in prefill and cfg.prefill_decision == "at_once"):
                at_once.append(i)
            elif req_id not in prefill and cfg.decode_decision == "at_once" and \
                    self.requests[req_id].status is Status.RUNNING:  # a finished one has left the step
                observing.append(i)
        if observing:
            evicts = may_evict_next(kv, [rows[i] for i in observing])
            at_once = sorted(at_once + [i for i, e in zip(observing, evicts) if e])
        return at_once

    def _as_the_step_sees(self, mass: Any, ids: np.ndarray | None, moved: bool, rows: list[int]) -> Any:
        """A forward's ``mass`` [B, >= W] over ``rows``, laid out by the positions it saw (``ids``
        [B, W]), as the rows' step sees them now: laid out again (``remap_mass``) where a step since
        the forward changed a layout (``moved``), else widened to the layout's width. A mass that
        is not a host array, or one no policy reads, as it is."""
        kv = self.kv
        if not kv.needs_attention or self.simulated or not rows or not isinstance(mass, np.ndarray):
            return mass
        if ids is not None and moved:
            return remap_mass(mass, ids, layout_ids(kv.layout, kv.writes, rows))
        return widened(mass, kv.layout, kv.writes, rows)

    def _launch_deferred(self, deferred: DeferredStep | None, rows_now: list[int], prefill: list[int]) -> None:
        """Starts the previous iteration's step for its requests still running (not preempted and
        admitted again); keeps this iteration's layout for its mass first."""
        kv = self.kv
        remaps = kv.needs_attention and not self.simulated
        self._layout_now = layout_ids(kv.layout, kv.writes, rows_now) if remaps and rows_now else None
        self._stepped = []
        if deferred is None:
            return
        keep = [i for i, r in enumerate(deferred.rows)
                if r in self.requests and self.requests[r].status is Status.RUNNING and r not in prefill]
        rows, mass = [deferred.rows[i] for i in keep], deferred.mass
        if self.simulated:  # its attention is a function of the layout the step sees
            mass = self.forwards.batch_mass(rows, [], [deferred.queries[i] for i in keep])
        else:
            ids = deferred.ids
            if isinstance(mass, np.ndarray) and len(keep) < len(deferred.rows):
                mass, ids = mass[keep], None if ids is None else ids[keep]
            mass = self._as_the_step_sees(mass, ids, deferred.moved, rows)
        # The step takes in this iteration's tokens too, which forward N+1 writes and the mass,
        # forward N's, does not cover: policies observe only what forward N attended.
        now = set(rows_now)
        unobserved = [kv.writes.latest_tokens(r) if r in now else 0 for r in rows]
        kv.start_step(rows, mass, overlap=self.config.step_overlap, forward_between=True,
                      prompt_goes_on=bool(self.scheduler.prefilling), unobserved=unobserved)
        self._stepped = rows
