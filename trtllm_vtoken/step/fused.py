# SPDX-License-Identifier: Apache-2.0
"""The common decode step in two native calls (C++ core): after the registration call
(``SlotMap.add_tokens``), one call decides, runs the token table's step and updates the batch
layout (``cpp/core/decode_step.h``), where the general path makes three more native calls with
numpy work between them:

    general path                                   fused (one call)
    BatchDecision.victims  -> select (native)      select_lowest / lowest_live_ids
    victims -> slots, ids, CSR offsets (numpy)     the same, read from the layout
    TableCore.step         -> step_batch           step_batch
    SlotMap.apply_step     -> slots_apply_step     apply_step
    lost, num_tokens, "changed" (numpy)            the same, per request

A batch fuses when the C++ core serves the step (``StepConfig.fused``), one natively decided
policy or none serves all its requests, no block is shared, and neither background compaction
nor a victims hook (prefix caching's cut) must run between the decision and the table
(``DecodeStep`` checks the last two; ``BatchDecision.native_decision`` the rest). Otherwise, and
for the Python core, the general path runs; the parity test holds both to the same outputs,
tables and layouts (``tests/step/test_step_fused.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from trtllm_vtoken.reclaim.step_batch import COMPACTIONS, StepBatchResult
from trtllm_vtoken.step.decide import NativeDecision
from trtllm_vtoken.step.slots import SlotMap


class FusedResult(NamedTuple):
    victim_offsets: np.ndarray
    victim_ids: np.ndarray
    table: StepBatchResult
    lost: np.ndarray
    num_tokens: np.ndarray
    changed: np.ndarray
    """[B] int64, 1 where the request moved tokens, released blocks or got shorter."""
    num_changed: int


def decide_and_step(slots: SlotMap, table: Any, req_ids: np.ndarray, rows: np.ndarray, num_new: np.ndarray,
                    offsets: np.ndarray, blocks: np.ndarray, decision: NativeDecision, compaction: str,
                    fragmentation_threshold: int, pressure: bool) -> FusedResult:
    """The decision, the table's step and the layout's update of a registered batch (``table``:
    the C++ token table; ``compaction``: "dense", "lazy" or "dead-blocks"). ValueError/KeyError
    from the table's step may leave it half done: the caller stops the step then."""
    victim_offsets, victim_ids, step, lost, num_tokens, changed, num_changed = slots.native.slots_decide_step(
        *slots.native_arrays(), table, req_ids, rows, num_new, offsets, blocks, decision.selector, decision.lo,
        decision.hi, decision.excess, COMPACTIONS.index(compaction), fragmentation_threshold, pressure,
        decision.stat, decision.mass)
    return FusedResult(victim_offsets, victim_ids, StepBatchResult(*step), lost, num_tokens, changed, num_changed)
