# SPDX-License-Identifier: Apache-2.0
"""The step's call with the Python core: the specification of the C++ core's one native call
(``step/fused.py``, ``cpp/core/decode_step.h``), step by step in the same order. The host's thread
registered the batch and decided its victims before it (``step/decide.py``: the Python core's
decisions are always made there, ``Decision.victim_index`` / ``victim_pos``):

    victims      (batch index, position) -> the layout's (rows, slots) and the table's (CSR
                 offsets [B + 1], logical ids); the victims hook (prefix caching's cut)
    table        reclaim.step_batch: append, evict, plan (dense / lazy), commit
    layout       SlotMap.apply_step: evictions, moves, released blocks, lengths
                 ("lazy-deferred", background compaction: the victims and lengths only)
    output       lost lengths, logical lengths, which requests changed
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from trtllm_vtoken.reclaim.step_batch import step_batch
from trtllm_vtoken.step.io import StepOutput
from trtllm_vtoken.step.slots import SlotMap

if TYPE_CHECKING:
    from trtllm_vtoken.step.iteration import Iteration


def decode_step(slots: SlotMap, table: Any, it: Iteration, compaction: str, fragmentation_threshold: int,
                pressure: bool, on_victims: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None,
                may_plan: np.ndarray | None = None) -> StepOutput:
    """``fused.decode_step`` for the Python core (``table``: its ``TokenTable``), the batch
    registered and its victims given (``it.decision``). ValueError/KeyError from the table's step
    may leave it half done: the caller stops the step then."""
    rows, req_ids = it.rows, it.req_ids
    victim_index, victim_pos = it.decision.victim_index, it.decision.victim_pos
    victim_rows = rows[victim_index]
    victim_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    if len(victim_index):
        victim_slots = slots.slots_at(victim_rows, victim_pos)
        victim_ids = slots.tokens[victim_slots].astype(np.int64)
        np.cumsum(np.bincount(victim_index, minlength=len(rows)), out=victim_offsets[1:])
        if on_victims is not None:  # before the table's step
            on_victims(req_ids, victim_offsets, victim_ids)
    else:  # nothing evicted (e.g. every request within its budget)
        victim_slots = victim_ids = victim_index
    length = slots.kv_len[rows]  # after the new tokens, before the step (a copy)
    result = step_batch(table, req_ids, it.num_new, *it.new_blocks_csr(), victim_offsets, victim_ids, compaction,
                        fragmentation_threshold, pressure, None if may_plan is None else may_plan.astype(bool).tolist())
    if compaction == "lazy-deferred":  # the plans commit later: the victims and lengths only
        slots.evict(victim_rows, victim_slots)
        slots.kv_len[rows] = result.kv_lens
    else:
        slots.apply_step(victim_rows, victim_slots, result.move_src, result.move_dst, rows, req_ids, result.kv_lens,
                         result.freed_offsets, compaction == "dense", table)
    lost = length - result.kv_lens
    changed = np.diff(result.move_offsets) + np.diff(result.freed_offsets) + lost > 0
    return StepOutput(req_ids, victim_offsets, victim_ids, result, lost, slots.num_tokens[rows].copy(), changed)
