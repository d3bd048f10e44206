# SPDX-License-Identifier: Apache-2.0
"""The common decode step in two native calls (C++ core): after the registration call
(``SlotMap.add_tokens``), one call decides, runs the token table's step and updates the batch
layout (``cpp/core/decode_step.h``), where the general path makes three more native calls with
numpy work between them. The one call can also register the batch first (checked before anything
changes), so the host's thread makes one call:

    general path                                   fused (one call)
    BatchDecision.victims  -> select (native)      select_lowest / lowest_live_ids
    victims -> slots, ids, CSR offsets (numpy)     the same, read from the layout
    TableCore.step         -> step_batch           step_batch
    SlotMap.apply_step     -> slots_apply_step     apply_step
    lost, num_tokens, "changed" (numpy)            the same, per request

A batch fuses when the C++ core serves the step (``StepConfig.fused``) and one natively decided
policy or none serves all its requests (``DecodeStep`` checks that; ``BatchDecision.native_decision``
the rest). With background compaction the call plans without committing ("lazy-deferred"), and
the step then commits the plans whose copies finished and starts the new ones' copies, as on the
general path (``step/background.py``). Tokens in shared blocks are kept on top of the
budget and passed over, as the Python path's protected mask does. The victims hook
(prefix caching's cut) runs inside the call, between the decision and the table's step, as on
the general path; the call on the step's worker takes no hook (the step runs it after the call,
with the block lists copied before it). Otherwise, and for the Python core, the general path runs; the parity test
holds both to the same outputs, tables and layouts (``tests/step/test_step_fused.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Any

import numpy as np

from trtllm_vtoken.reclaim.step_batch import COMPACTIONS, StepBatchResult
from trtllm_vtoken.step.decide import NativeDecision
from trtllm_vtoken.step.io import StepOutput
from trtllm_vtoken.step.slots import SlotMap

NONE = np.zeros(0, dtype=np.int64)
NONE.flags.writeable = False
"""Every empty part of a result (nothing to write into)."""


class FusedOutput(StepOutput):
    """The fused call's ``StepOutput``, from what it returns: one int64 buffer and its sizes
    (``result_tuple`` in ``cpp/core/decode_bindings.cpp``). The buffer becomes a numpy array
    when a part is first read, each part a view of it, an empty part the shared ``NONE``: a step
    whose output only its counts are read of makes no numpy object on the host's thread, where
    each costs a multiple of its warm time in the caches the host's own work leaves
    (``benchmarks/step/cold_host``). The step sets ``req_ids`` and ``copy``; ``seconds`` holds the
    call's (decide, plan, commit) seconds (``StepStats.core_parts``).

        0      B+1       2(B+1)     3(B+1)  +B       +2B   +3B         +4B = fixed
        victim_offsets | move_offsets | freed_offsets | kv_lens | lost | num_tokens | changed
        fixed  +V          +M            +2M         +3M
        victim_ids | move_tokens | move_src | move_dst | freed
    """

    def __init__(self, native: tuple) -> None:  # not the dataclass's: the parts come when read
        self._buffer, self._batch, self.num_evicted, self.num_moves, self.num_changed, size, self.seconds = native
        self._fixed = 3 * self._batch + 3 + 4 * self._batch
        self.num_freed = size - self._fixed - self.num_evicted - 3 * self.num_moves
        self.req_ids, self.copy = NONE, None

    @cached_property
    def _flat(self) -> np.ndarray:
        """The buffer as one numpy array, made when a part is first read (none for a step whose
        output only its counts are read of)."""
        return self._buffer.array()

    def _part(self, begin: int, size: int) -> np.ndarray:
        return self._flat[begin : begin + size] if size else NONE

    @cached_property
    def victim_offsets(self) -> np.ndarray:
        return self._flat[: self._batch + 1]

    @cached_property
    def victims(self) -> np.ndarray:
        return self._part(self._fixed, self.num_evicted)

    @cached_property
    def table(self) -> StepBatchResult:
        b1 = self._batch + 1
        return StepBatchResult(self._flat[b1 : 2 * b1], self._after_victims(0), *self.moved_slots(),
                               self._flat[2 * b1 : 3 * b1], self._after_victims(3, self.num_freed),
                               self._per_request(0))

    def moved_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """The copy's two parts (move_src, move_dst), made without the rest of ``table``."""
        return self._after_victims(1), self._after_victims(2)

    def _after_victims(self, k: int, size: int | None = None) -> np.ndarray:
        """The k-th part after the victims: 0-2 move_tokens, move_src, move_dst; 3 freed."""
        moves = self.num_moves
        return self._part(self._fixed + self.num_evicted + k * moves, moves if size is None else size)

    @cached_property
    def lost(self) -> np.ndarray:
        return self._per_request(1)

    @cached_property
    def num_tokens(self) -> np.ndarray:
        return self._per_request(2)

    @cached_property
    def changed(self) -> np.ndarray:
        """[B] int64, 1 where the request moved tokens, released blocks or got shorter."""
        return self._per_request(3)

    def _per_request(self, k: int) -> np.ndarray:
        begin = 3 * self._batch + 3 + k * self._batch
        return self._flat[begin : begin + self._batch]


def decide_and_step(slots: SlotMap, table: Any, req_ids: np.ndarray, rows: np.ndarray, num_new: np.ndarray,
                    offsets: np.ndarray, blocks: np.ndarray, decision: NativeDecision, compaction: str,
                    fragmentation_threshold: int, pressure: bool,
                    on_victims: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None,
                    may_plan: np.ndarray | None = None, registers: bool = False) -> FusedOutput:
    """The decision, the table's step and the layout's update of a batch (``table``: the C++
    token table; ``compaction``: one of ``COMPACTIONS``); ``registers``: its registration first, in
    the same call (as ``SlotMap.add_tokens`` would; the block table widened here first where the
    lists outgrow it), else ``add_tokens`` made it. ``on_victims(req_ids, victim_offsets,
    victim_ids)`` runs between the decision and the table's step when there are victims
    (``DecodeStep.on_victims``). "lazy-deferred" (background compaction) plans the rows
    ``may_plan`` ([B] uint8; None: all) allows and commits nothing: the result's table step holds
    the plans, the layout only lost the victims and took the lengths (``cpp/core/decode_step.h``).
    ``BatchRefused`` (``core/native.py``) for a batch the registration's checks refuse, nothing
    changed; other ValueError/KeyError from the table's step may leave it half done: the caller
    stops the step then."""
    hook = None if on_victims is None else (lambda offsets, ids: on_victims(req_ids, offsets, ids))
    while True:
        result = slots.native.slots_decide_step(
            *fused_arguments(slots, table, req_ids, rows, num_new, offsets, blocks, decision, compaction,
                             fragmentation_threshold, pressure), hook, decision.skip_shared, decision.threads,
            may_plan, slots.num_blocks if registers else 0)
        if type(result) is not int:
            return FusedOutput(result)
        slots.fit_columns(result)  # the rows' lists outgrow the block table: widen it, then call again


def start_decide_and_step(worker: Any, slots: SlotMap, table: Any, req_ids: np.ndarray, rows: np.ndarray,
                          num_new: np.ndarray, offsets: np.ndarray, blocks: np.ndarray, decision: NativeDecision,
                          compaction: str, fragmentation_threshold: int, pressure: bool,
                          may_plan: np.ndarray | None = None, registers: bool = False) -> tuple:
    """``decide_and_step`` (no victims hook) started on ``worker`` (the C++ core's
    ``DecodeWorker``), ``registers`` as there. The worker checks the arguments and the batch at
    once (ValueError, ``BatchRefused`` for the batch, nothing started); its
    ``wait()`` returns (what ``FusedOutput`` takes, the call's seconds on the worker). Until
    then nothing may touch the layout, the table or these arrays. Returns the call's arguments
    (``step/repeat.py`` keeps them)."""
    while True:
        arguments = (*fused_arguments(slots, table, req_ids, rows, num_new, offsets, blocks, decision, compaction,
                                      fragmentation_threshold, pressure),
                     decision.skip_shared, decision.threads, may_plan, slots.num_blocks if registers else 0)
        needed = worker.start(*arguments)
        if not needed:
            return arguments
        slots.fit_columns(needed)  # as in decide_and_step


def fused_arguments(slots: SlotMap, table: Any, req_ids: np.ndarray, rows: np.ndarray, num_new: np.ndarray,
                    offsets: np.ndarray, blocks: np.ndarray, decision: NativeDecision, compaction: str,
                    fragmentation_threshold: int, pressure: bool) -> tuple:
    """The native call's leading arguments, as both of its forms take them (layout ... mass)."""
    return (slots.native_layout(), table, req_ids, rows, num_new, offsets, blocks, decision.selector,
            tuple(decision.rule), COMPACTIONS.index(compaction), fragmentation_threshold, pressure, decision.stat,
            decision.mass)
