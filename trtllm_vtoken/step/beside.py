# SPDX-License-Identifier: Apache-2.0
"""A ``DecodeStep``'s fused call on its worker thread, beside the host's own work: started
(``DecodeStep.start`` with overlap), repeated for the same batch (``RepeatedCall``), waited for and
completed (``settle``); ``DecodeStep.start`` draws the timeline. A base of ``DecodeStep``, which
sets the state it reads and completes the step (``_end``). The victims hook runs after the call,
on the host's thread, with the block lists copied before it (``Iteration.listed_before``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from trtllm_vtoken.core.native import batch_refused
from trtllm_vtoken.policies import EvictionPolicy
from trtllm_vtoken.step.config import StepConfig, StepStats
from trtllm_vtoken.step.core import TableCore
from trtllm_vtoken.step.decide import BatchDecision
from trtllm_vtoken.step.fused import FusedOutput, start_decide_and_step
from trtllm_vtoken.step.io import StepInput, StepOutput
from trtllm_vtoken.step.iteration import Iteration
from trtllm_vtoken.step.repeat import RepeatedCall
from trtllm_vtoken.step.slots import LISTS, SlotMap


class CallBesideHost:
    """The call on the worker: started, repeated, waited for."""

    config: StepConfig
    core: TableCore
    decision: BatchDecision
    slots: SlotMap
    stats: StepStats
    on_victims: Callable | None
    shared_blocks: Callable[[], Collection[int]]
    _policies: list[EvictionPolicy]
    _may_repeat: bool
    _flight: Iteration | None  # started on the worker thread, not yet waited for
    _landed: StepOutput | None  # completed, not yet handed over by finish()
    _native_worker: Any
    _repeated: RepeatedCall | None
    _end: Callable[[Iteration, tuple[Any, float]], StepOutput]
    _refused: Callable[[Exception], RuntimeError]
    _call_settings: Callable[[np.ndarray], tuple[str, np.ndarray | None]]

    def _start_beside(self, it: Iteration, inp: StepInput) -> None:
        """The fused call for the checked batch, started on the worker; kept for repetition
        where the host passed lists and no mass, or a mass array the call takes as it is, not
        reduced (``RepeatedCall``)."""
        it.block_lists = self._lists_for_hook(it.rows)
        compaction, may_plan = self._call_settings(it.req_ids)
        try:
            arguments = start_decide_and_step(self._worker(), self.slots, self.core.table, it.req_ids, it.rows,
                                              it.num_new, it.offsets, it.blocks, it.native, compaction,
                                              self.config.fragmentation_threshold, inp.pressure, may_plan,
                                              it.registers)
        except batch_refused():  # the call's checks of the batch: nothing changed
            raise
        except (KeyError, ValueError) as exc:
            raise self._refused(exc) from exc  # the host registered the new tokens already
        self._flight = it
        if self._may_repeat and it.registers and it.offsets is None and it.native.mass is inp.mass and \
                (inp.mass is None or self.decision.reduce_mass is None) and \
                type(inp.req_ids) in LISTS and type(inp.num_new) in LISTS and it.native.selector:
            policy = self._policies[int(self.slots.policy[it.rows[0]])]  # the batch's one policy
            self._repeated = RepeatedCall.of(inp.req_ids, inp.num_new, self.slots, policy, arguments, it.native,
                                             self._native_worker)

    def _repeat(self, inp: StepInput) -> bool:
        """Starts the call on the worker as the last step's (``RepeatedCall``) where the host
        passes the same lists and nothing the skipped checks and decision read has changed.
        False: the whole path runs (``_start``)."""
        last = self._repeated
        if last is None:
            return False
        start = time.perf_counter()
        shared = self.shared_blocks()
        self.core.sync_shared(shared)
        block_lists = self._lists_for_hook(last.iteration.rows)  # before the call changes them
        try:
            needed = last.start_unchanged(inp, self.slots, shared, self._native_worker)
        except batch_refused():  # the call's checks of the batch: nothing changed
            raise
        except (KeyError, ValueError) as exc:
            raise self._refused(exc) from exc
        if needed is None or needed:  # something changed, or the rows' lists outgrow the block table
            self._repeated = None
            return False
        self._flight = last.iteration.again(inp.new_blocks, inp.stream, block_lists)
        self.stats.repeated_steps += 1
        self.stats.seconds["table"] += time.perf_counter() - start
        return True

    def settle(self) -> None:
        """Waits for a step's call on the worker thread (``start`` with overlap) and completes
        the step; ``finish`` hands its output over. Every query and request change calls it."""
        it = self._flight
        if it is None:
            return
        self._flight = None
        waited = time.perf_counter()
        try:
            fused, seconds = self._native_worker.wait()
        except (KeyError, ValueError) as exc:
            raise self._refused(exc) from exc
        self.stats.waited_seconds += time.perf_counter() - waited
        self.stats.overlapped_steps += 1
        self._landed = self._end(it, (FusedOutput(fused), seconds))

    def _lists_for_hook(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """With a victims hook, the rows' block lists copied before a call on the worker changes
        them: the hook sees them as the decision did (``Iteration.listed_before``)."""
        if self.on_victims is None:
            return None
        return self.slots.block_table[rows], self.slots.num_blocks_of[rows]

    def _worker(self):
        if self._native_worker is None:
            self._native_worker = self.slots.native.DecodeWorker()
        return self._native_worker
