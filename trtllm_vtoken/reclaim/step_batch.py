# SPDX-License-Identifier: Apache-2.0
"""``step_batch``: one decode step's table work for a whole batch, in the Python core.

Per request i of the batch, in order, it does exactly what this loop does (the specification,
shared with the C++ core's ``TokenTable.step_batch``, see ``cpp/core/batch.h``):

    table.append_tokens(req, new_blocks[i], num_new[i])
    table.evict_tokens(req, evict_ids[i])
    "dense":        plan = plan_dense(table, req)
    "lazy":         plan = plan_lazy(table, req) if pressure or fragmentation >= threshold else None
    if plan: commit_plan(table, plan)            # apply_moves, then truncate / release_blocks
    "dead-blocks":  table.release_blocks(req, fully_dead_blocks(table, req))     (naive-evict)
    "lazy-deferred": as "lazy", the plan returned uncommitted; not planned where may_plan is False

Metadata only: every relocation is committed in the table at once and returned (token, source
slot, destination slot), so that the caller copies the KV of all of them in one copy before the
next attention reads it (I3), and frees the returned blocks in its pool. Lists of ids come in and
go out in CSR form: request i's entries are ``values[offsets[i]:offsets[i + 1]]``.

Dense requests whose one hole is their one eviction (most of a decode step) take
``TokenTable.fill_single_hole``, which leaves the table exactly as plan + commit would.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import NamedTuple

import numpy as np

from trtllm_vtoken.core.arguments import as_int, as_ints
from trtllm_vtoken.core.token_table import TokenTable
from trtllm_vtoken.reclaim.dead_blocks import fully_dead_blocks
from trtllm_vtoken.reclaim.planner import commit_plan, plan_for_mode

COMPACTIONS = ("dense", "lazy", "dead-blocks", "lazy-deferred")
"""What a step does after the evictions; the C++ core takes the index into this tuple.
"lazy-deferred" plans as "lazy" but commits nothing: the plans come back (moves, and blocks to
free in ``freed``) for the caller to copy in the background and commit later (``commit_plan``)."""


class StepBatchResult(NamedTuple):
    """What one ``step_batch`` did, as int64 arrays (CSR: request i's entries are
    ``values[offsets[i]:offsets[i + 1]]``)."""

    move_offsets: np.ndarray
    """[batch + 1] into the three move arrays."""
    move_tokens: np.ndarray
    """[moves] logical id of each relocated token."""
    move_src: np.ndarray
    """[moves] its flat slot (block * tokens_per_block + offset) before the step: copy from here..."""
    move_dst: np.ndarray
    """[moves] ...to here."""
    freed_offsets: np.ndarray
    """[batch + 1] into ``freed``."""
    freed: np.ndarray
    """Block ids released, request by request: the caller frees them in its pool."""
    kv_lens: np.ndarray
    """[batch] each request's physical KV length after the step."""

    def moves_of(self, i: int) -> list[tuple[int, int, int]]:
        """Request i's moves as (token, source slot, destination slot)."""
        lo, hi = self.move_offsets[i], self.move_offsets[i + 1]
        return list(zip(self.move_tokens[lo:hi].tolist(), self.move_src[lo:hi].tolist(),
                        self.move_dst[lo:hi].tolist()))

    def freed_of(self, i: int) -> list[int]:
        return self.freed[self.freed_offsets[i] : self.freed_offsets[i + 1]].tolist()


def step_batch(
    table: TokenTable,
    req_ids: SequenceOf[int],
    num_new: SequenceOf[int],
    new_block_offsets: SequenceOf[int],
    new_blocks: SequenceOf[int],
    evict_offsets: SequenceOf[int],
    evict_ids: SequenceOf[int],
    compaction: str,
    fragmentation_threshold: int = 1,
    pressure: bool = False,
    may_plan: SequenceOf[bool] | None = None,
) -> StepBatchResult:
    """Registers, evicts and compacts every request of the batch (see the module docstring).

    Ids and counts convert as the table's arguments do (``core/arguments.py``: TypeError for a
    float). Raises ValueError if the arrays do not fit together or ``compaction`` is unknown
    (nothing changed) and, like the loop, KeyError/ValueError from the first request whose input
    is bad (earlier requests' steps stay done, that request's failing call changed nothing).
    """
    req_ids, num_new = as_ints(req_ids), as_ints(num_new)
    block_offsets, blocks = as_ints(new_block_offsets), as_ints(new_blocks)
    evict_offsets, evicts = as_ints(evict_offsets), as_ints(evict_ids)
    fragmentation_threshold, pressure = as_int(fragmentation_threshold), bool(pressure)
    batch = len(req_ids)
    if len(num_new) != batch or len(block_offsets) != batch + 1 or len(evict_offsets) != batch + 1:
        raise ValueError("step_batch: num_new needs one entry per request and each offsets array one more")
    if compaction not in COMPACTIONS:
        raise ValueError(f"step_batch: compaction must be one of {COMPACTIONS}, got {compaction!r}")
    if may_plan is not None and len(may_plan) != batch:
        raise ValueError("step_batch: may_plan needs one entry per request")
    _check_csr(block_offsets, len(blocks), "new_block_offsets")
    _check_csr(evict_offsets, len(evicts), "evict_offsets")

    tpb = table.tokens_per_block
    move_offsets, tokens, srcs, dsts = [0], [], [], []
    freed_offsets, freed, kv_lens = [0], [], []
    for i, req in enumerate(req_ids):
        table.append_tokens(req, blocks[block_offsets[i] : block_offsets[i + 1]], num_new[i])
        victims = evicts[evict_offsets[i] : evict_offsets[i + 1]]
        if len(victims) == 1:
            table.evict_token(req, victims[0])
        else:
            table.evict_tokens(req, victims)
        if compaction == "dead-blocks":
            dead = fully_dead_blocks(table, req)
            if dead:
                table.release_blocks(req, dead)
                freed.extend(dead)
        else:
            single = _single_hole_move(table, req, tpb) if compaction == "dense" else None
            done = table.fill_single_hole(req) if compaction == "dense" else None
            if done is not None:
                if done[0]:
                    tokens.append(single[0]), srcs.append(single[1]), dsts.append(single[2])
                freed.extend(done[1])
            elif may_plan is None or may_plan[i]:
                deferred = compaction == "lazy-deferred"
                plan = plan_for_mode(table, req, "lazy" if deferred else compaction, fragmentation_threshold, pressure)
                if plan is not None:
                    freed.extend(plan.blocks_to_free if deferred else commit_plan(table, plan))
                    tokens.extend(plan.token_ids), srcs.extend(plan.src_slots), dsts.extend(plan.dst_slots)
        move_offsets.append(len(tokens))
        freed_offsets.append(len(freed))
        kv_lens.append(table.kv_len(req))
    as_array = lambda values: np.array(values, dtype=np.int64)  # noqa: E731
    return StepBatchResult(as_array(move_offsets), as_array(tokens), as_array(srcs), as_array(dsts),
                           as_array(freed_offsets), as_array(freed), as_array(kv_lens))


def _single_hole_move(table: TokenTable, req: int, tpb: int) -> tuple[int, int, int] | None:
    """The move ``fill_single_hole`` makes if it applies: the last token into the one hole."""
    seq = table.seq(req)
    if len(seq.pending_dead) != 1 or seq.kv_len == 0:
        return None
    last, hole = seq.kv_len - 1, seq.pending_dead[0]
    if hole >= last:
        return None
    blocks = seq.block_ids
    return seq.token_at_mv[last], blocks[last // tpb] * tpb + last % tpb, blocks[hole // tpb] * tpb + hole % tpb


def _check_csr(offsets: list[int], num_values: int, name: str) -> None:
    if offsets[0] != 0 or offsets[-1] > num_values or any(a > b for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"step_batch: {name} must start at 0, never decrease and stay within its values")
