# SPDX-License-Identifier: Apache-2.0
"""The step's general path: what ``DecodeStep`` does with numpy around the token table where the
fused native call (``step/fused.py``) does not serve a batch (the Python core, several policies,
a policy decided in Python, ``StepConfig.fused`` off), and with background compaction after the
fused call too.

    victims        BatchDecision.victims' (batch index, position) pairs
                   -> the layout's (rows, slots) and the table's (CSR offsets, logical ids)
    table_step     TableCore.step: append, evict, plan (dense / lazy), commit
    follow         the layout follows the table (SlotMap.apply_step), or background compaction
                   commits the plans whose copies finished
    output         lost lengths, which requests changed, the ``StepOutput``
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trtllm_vtoken.reclaim.step_batch import StepBatchResult
from trtllm_vtoken.step.config import StepConfig
from trtllm_vtoken.step.core import TableCore
from trtllm_vtoken.step.io import StepOutput
from trtllm_vtoken.step.iteration import Iteration
from trtllm_vtoken.step.slots import SlotMap


class GeneralPath:
    """The general path over one step's layout, table and settings (``background``: the step's
    background compaction, or None)."""

    def __init__(self, slots: SlotMap, core: TableCore, config: StepConfig, background: Any) -> None:
        self.slots, self.core, self.config, self.background = slots, core, config, background

    def victims(self, rows: np.ndarray, victim_index: np.ndarray,
                victim_pos: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The victims as the layout drops them (rows, slots) and as the table takes them (CSR
        offsets [B + 1], logical ids), from the decision's batch indices and positions (sorted by
        index)."""
        victim_rows = rows[victim_index]
        victim_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        if not len(victim_index):  # nothing evicted (e.g. every request within its budget)
            return victim_rows, victim_index, victim_offsets, victim_index
        victim_slots = self.slots.slots_at(victim_rows, victim_pos)
        victim_ids = self.slots.tokens[victim_slots].astype(np.int64)
        np.cumsum(np.bincount(victim_index, minlength=len(rows)), out=victim_offsets[1:])
        return victim_rows, victim_slots, victim_offsets, victim_ids

    def table_step(self, it: Iteration, compaction: str, pressure: bool,
                   may_plan: np.ndarray | None) -> StepBatchResult:
        """The token table's step for the iteration's new tokens and victims."""
        victim_offsets, victim_ids = it.victims[2:]
        return self.core.step(it.req_ids, it.num_new, *it.new_blocks_csr(), victim_offsets, victim_ids, compaction,
                              self.config.fragmentation_threshold, pressure, may_plan)

    def follow(self, it: Iteration, result: StepBatchResult, fused: bool) -> StepBatchResult:
        """After the table's step the layout follows it. Returns what this step committed: the
        table's step, or with background compaction the plans whose copies finished, committed now
        (after this iteration's mass was credited to the layout the forward read; the new plans'
        copies start next, to commit at a later step). ``fused``: the fused call has dropped the
        victims and set the lengths already (background compaction only). RuntimeError: a
        background plan could not commit (the tables disagree now)."""
        if self.background is None:
            victim_rows, victim_slots = it.victims[:2]
            self.slots.apply_step(victim_rows, victim_slots, result.move_src, result.move_dst, it.rows, it.req_ids,
                                  result.kv_lens, result.freed_offsets, self.config.compaction == "dense",
                                  self.core.table)
            return result
        if not fused:
            self.slots.evict(*it.victims[:2])
            self.slots.kv_len[it.rows] = result.kv_lens
        return self.background.finish(it.req_ids, it.rows)

    def output(self, it: Iteration, victim_offsets: np.ndarray, victims: np.ndarray,
               table: StepBatchResult) -> tuple[StepOutput, np.ndarray]:
        """The step's output for what it committed (``follow``), and which requests' layouts
        changed: moved tokens, released blocks or got shorter (each >= 0)."""
        lost = it.length - table.kv_lens
        changed = np.diff(table.move_offsets) + np.diff(table.freed_offsets) + lost > 0
        out = StepOutput(it.req_ids, victim_offsets, victims, table, lost, self.slots.num_tokens[it.rows].copy())
        return out, changed
