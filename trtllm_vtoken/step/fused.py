# SPDX-License-Identifier: Apache-2.0
"""The step's call with the C++ core: one native call (``cpp/core/decode_step.h``) registers the
batch (unless the host's thread did), decides (or takes the victims decided in Python), runs the
token table's step and updates the batch layout, in the order of its specification, the Python
core's call (``step/spec.py``):

    register     the new blocks and tokens join the layout (checked first; nothing changed if refused)
    decide       select_lowest / lowest_live_ids, or the given victims (``step/decide.py``)
    victims      -> their slots, logical ids, CSR offsets; the victims hook (prefix caching's cut)
    table        step_batch: append, evict, plan (dense / lazy), commit
    layout       apply_step: evictions, moves, released blocks, lengths
    output       lost lengths, logical lengths, which requests changed (``FusedOutput``)

It runs at once (``decode_step``) or on the step's worker thread beside the host's own work
(``start_decode_step``, ``step/beside.py``), which takes no victims hook (the step runs it after
the call, with the block lists copied before it). With background compaction it plans without
committing ("lazy-deferred"): the layout loses the victims and takes the lengths, the plans
commit later (``step/background.py``). Tokens in shared blocks are kept on top of the budget and
passed over, as the Python decision's protected mask does. The parity tests hold both cores to
the same outputs, tables and layouts (``tests/step/test_step_parity.py``, ``test_step_fused.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from trtllm_vtoken.reclaim.step_batch import COMPACTIONS, StepBatchResult
from trtllm_vtoken.step.io import StepOutput
from trtllm_vtoken.step.slots import SlotMap

if TYPE_CHECKING:
    from trtllm_vtoken.step.iteration import Iteration

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


def decode_step(slots: SlotMap, table: Any, it: Iteration, compaction: str, fragmentation_threshold: int,
                pressure: bool, on_victims: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None,
                may_plan: np.ndarray | None = None) -> FusedOutput:
    """The call for the iteration's batch and decision (``table``: the C++ token table;
    ``compaction``: one of ``COMPACTIONS``), registering the batch first unless the host's thread
    did (``it.registered``; the block table widened here first where the lists outgrow it).
    ``on_victims(req_ids, victim_offsets, victim_ids)`` runs between the decision and the table's
    step when there are victims (``DecodeStep.on_victims``). "lazy-deferred" (background
    compaction) plans the rows ``may_plan`` ([B] uint8; None: all) allows and commits nothing: the
    result's table step holds the plans, the layout only lost the victims and took the lengths.
    ``BatchRefused`` (``core/native.py``) for a batch the registration's checks refuse, nothing
    changed; other ValueError/KeyError from the table's step may leave it half done: the caller
    stops the step then."""
    req_ids = it.req_ids
    hook = None if on_victims is None else (lambda offsets, ids: on_victims(req_ids, offsets, ids))
    while True:
        arguments = call_arguments(slots, table, it, compaction, fragmentation_threshold, pressure, may_plan)
        result = slots.native.slots_decide_step(*arguments[:14], hook, *arguments[14:])
        if type(result) is not int:
            return FusedOutput(result)
        slots.fit_columns(result)  # the rows' lists outgrow the block table: widen it, then call again


def start_decode_step(worker: Any, slots: SlotMap, table: Any, it: Iteration, compaction: str,
                      fragmentation_threshold: int, pressure: bool, may_plan: np.ndarray | None = None) -> tuple:
    """``decode_step`` (no victims hook) started on ``worker`` (the C++ core's ``DecodeWorker``).
    The worker checks the arguments and the batch at once (ValueError, ``BatchRefused`` for the
    batch, nothing started); its ``wait()`` returns (what ``FusedOutput`` takes, the call's seconds
    on the worker). Until then nothing may touch the layout, the table or these arrays. Returns
    the call's arguments (``RepeatedCall`` keeps them)."""
    while True:
        arguments = call_arguments(slots, table, it, compaction, fragmentation_threshold, pressure, may_plan)
        needed = worker.start(*arguments)
        if not needed:
            return arguments
        slots.fit_columns(needed)  # as in decode_step


def call_arguments(slots: SlotMap, table: Any, it: Iteration, compaction: str, fragmentation_threshold: int,
                   pressure: bool, may_plan: np.ndarray | None) -> tuple:
    """The native call's arguments, as ``DecodeWorker.start`` takes them (``slots_decide_step``
    takes its victims hook after the first 14): layout ... mass, skip_shared, threads, may_plan,
    num_blocks (0: the host registered the batch), victim_index, victim_pos."""
    d = it.decision
    return (slots.native_layout(), table, it.req_ids, it.rows, it.num_new, it.offsets, it.blocks, d.selector,
            tuple(d.rule), COMPACTIONS.index(compaction), fragmentation_threshold, pressure, d.stat, d.mass,
            d.skip_shared, d.threads, may_plan, 0 if it.registered else slots.num_blocks, d.victim_index, d.victim_pos)
