# SPDX-License-Identifier: Apache-2.0
"""The step's invariant checks (``StepConfig.check_invariants``), around each ``run``:

- I1: the live ids of every request that changed, and their KV bytes, hash the same before the
  copy (the places found before the table call) and after it (new tokens, moved ones included;
  evicted ones leave).
- I2: every live id maps to one slot, no slot twice, counters agree (``core.integrity``), for the
  batch's requests; and the step's batch layout agrees with the table: per position, the live
  logical id (or -1), block rows, lengths, counts.

A check, never the decode hot path: it reads tables and KV back to the host.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from trtllm_vtoken.reclaim.copy import CopyExecutor
from trtllm_vtoken.reclaim.invariants import LiveSnapshot, check_conservation, snapshot_slots
from trtllm_vtoken.step.config import StepStats
from trtllm_vtoken.step.core import TableCore
from trtllm_vtoken.step.io import StepOutput
from trtllm_vtoken.step.slots import SlotMap

Located = tuple[int, np.ndarray, np.ndarray]
"""A request's token count, its live logical ids and their slots."""


class StepChecks:
    """The checks over a step's token tables (``core``), batch layout (``slots``) and KV pools
    (``executor``'s); ``stats``: where they are counted."""

    def __init__(self, core: TableCore, slots: SlotMap, executor: CopyExecutor | None,
                 is_shared: Callable[[int], bool], stats: StepStats) -> None:
        self.core, self.slots, self.executor, self.is_shared, self.stats = core, slots, executor, is_shared, stats

    def before(self, req_ids: np.ndarray, new_slots: np.ndarray, num_new: np.ndarray) -> list[Located]:
        """Where the batch's live tokens are, the new ones included, before the table call. Their
        KV is read by ``snapshots`` just before the copy: a host may launch a forward between the
        call and the copy (the overlap scheduler) that writes some new tokens' KV only then."""
        core, out, start = self.core, [], 0
        for req_id, n in zip(req_ids.tolist(), num_new.tolist()):
            ids, slots = core.live_slots(req_id)
            first = core.num_tokens(req_id)
            out.append((first + n, np.concatenate([ids, np.arange(first, first + n)]),
                        np.concatenate([slots, new_slots[start : start + n]])))
            start += n
        return out

    def snapshots(self, located: list[Located]) -> list[LiveSnapshot]:
        """I1's before: the KV at the places ``before`` found, read now."""
        pools = pools_of(self.executor)
        return [snapshot_slots(num_tokens, ids, slots, pools) for num_tokens, ids, slots in located]

    def after(self, out: StepOutput, before: list[LiveSnapshot]) -> None:
        """I1 for the requests that changed (after their copy completed), I2 for the batch."""
        changed = out.changed.astype(bool)
        if out.copy is not None:
            out.copy.synchronize()
        core, pools = self.core, pools_of(self.executor)
        for i in np.flatnonzero(changed).tolist():
            req_id = int(out.req_ids[i])
            ids, slots = core.live_slots(req_id)
            check_conservation(req_id, before[i], snapshot_slots(core.num_tokens(req_id), ids, slots, pools))
        self.layout(out.req_ids.tolist())
        self.stats.invariant_checks += int(changed.sum())

    def layout(self, req_ids: Collection[int]) -> None:
        """I2 and the batch layout against the table. Raises RuntimeError naming what differs."""
        core, slots = self.core, self.slots
        core.check_integrity(req_ids, self.is_shared)
        for req_id in req_ids:
            seq, row = core.sequence(req_id), slots.row_of[req_id]
            counters = (int(slots.kv_len[row]), int(slots.num_tokens[row]), int(slots.num_live[row]))
            if counters != (seq.kv_len, seq.num_tokens, seq.num_live):
                raise RuntimeError(f"request {req_id}: the step counts (kv_len, tokens, live) {counters}, "
                                   f"the table {(seq.kv_len, seq.num_tokens, seq.num_live)}")
            listed = slots.block_table[row, : slots.num_blocks_of[row]].tolist()
            if listed != list(seq.block_ids):
                raise RuntimeError(f"request {req_id}: the step's block row {listed} is not "
                                   f"the table's {list(seq.block_ids)}")
            tokens = slots.gather(slots.tokens, slots.block_rows(slots.rows([req_id])))[0]
            tokens = tokens[: len(seq.block_ids) * slots.tokens_per_block]
            held = seq.token_at[: len(tokens)].astype(np.int64)
            expected = np.where(held >= 0, held, -1)
            expected[held >= 0] = np.where(seq.live[held[held >= 0]] > 0, held[held >= 0], -1)
            if not np.array_equal(tokens, expected):
                bad = int(np.flatnonzero(tokens != expected)[0])
                raise RuntimeError(f"request {req_id}: position {bad} holds live token {expected[bad]} in the "
                                   f"table but {tokens[bad]} in the step's slots")


def live_snapshot(core: TableCore, executor: CopyExecutor | None, req_id: int) -> LiveSnapshot:
    """The request's live tokens and their KV in the executor's pools (I1's before and after)."""
    ids, slots = core.live_slots(req_id)
    return snapshot_slots(core.num_tokens(req_id), ids, slots, pools_of(executor))


def pools_of(executor: CopyExecutor | None) -> list:
    """The KV pools the executor copies in (none for a metadata-only host)."""
    return list(getattr(executor, "pools", ()) or ())
