# SPDX-License-Identifier: Apache-2.0
"""``step_batch``: one decode step's host work for a whole batch, in the Python core.

Per request i of the batch, in order, it does exactly what this loop does (the specification,
shared with the C++ core's ``TokenTable.step_batch``, see ``cpp/core/batch.h``):

    table.append_tokens(req, new_blocks[i], num_new[i])
    table.evict_tokens(req, evict_ids[i])
    plan = plan_dense(table, req)                                              # dense
    plan = plan_lazy(table, req) if pressure or fragmentation >= threshold else None  # lazy
    if plan: apply_moves, then truncate (dense) or release_blocks (lazy)

Metadata only: the caller copies the KV of plans it needs copied (use ``ReclaimBackend`` for
that) and frees the returned blocks in its pool. Lists of ids come in CSR form: request i's
entries are ``values[offsets[i]:offsets[i + 1]]``.

Most requests of a decode step have one shape: one eviction that leaves the only hole, in dense
mode. For those, ``_fill_single_hole`` moves the last token into the hole and drops the tail
position straight on the arrays (a few memoryview writes), where the general calls build a plan
object, re-validate each move and filter hint lists. With it a dense step costs ~5 us a request
instead of ~30 us through the per-call API (``vtoken bench core``, batch 256), and it leaves the
table exactly as the general calls do (``tests/reclaim/test_step_batch.py``).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np

from trtllm_vtoken.core.sequence import NO_SLOT, NO_TOKEN, Sequence
from trtllm_vtoken.core.token_table import TokenTable
from trtllm_vtoken.reclaim.planner import fragmentation, plan_dense, plan_lazy

StepResult = tuple[list[int], list[int], list[int]]
"""(moves per request, freed_offsets [batch + 1], freed block ids request by request)."""


def step_batch(
    table: TokenTable,
    req_ids: SequenceOf[int],
    num_new: SequenceOf[int],
    new_block_offsets: SequenceOf[int],
    new_blocks: SequenceOf[int],
    evict_offsets: SequenceOf[int],
    evict_ids: SequenceOf[int],
    dense: bool,
    fragmentation_threshold: int = 1,
    pressure: bool = False,
) -> StepResult:
    """Registers, evicts, plans and commits for every request of the batch (see module doc).

    Raises ValueError if the arrays do not fit together (nothing changed) and, like the loop,
    KeyError/ValueError from the first request whose input is bad (earlier requests' steps stay
    done, that request's failing call changed nothing).
    """
    req_ids, num_new = _as_list(req_ids), _as_list(num_new)
    block_offsets, blocks = _as_list(new_block_offsets), _as_list(new_blocks)
    evict_offsets, evicts = _as_list(evict_offsets), _as_list(evict_ids)
    batch = len(req_ids)
    if len(num_new) != batch or len(block_offsets) != batch + 1 or len(evict_offsets) != batch + 1:
        raise ValueError("step_batch: num_new needs one entry per request and each offsets array one more")
    _check_csr(block_offsets, len(blocks), "new_block_offsets")
    _check_csr(evict_offsets, len(evicts), "evict_offsets")

    moves: list[int] = []
    freed_offsets = [0]
    freed: list[int] = []
    tpb, is_shared = table.tokens_per_block, table.is_shared
    for i, req in enumerate(req_ids):
        table.append_tokens(req, blocks[block_offsets[i] : block_offsets[i + 1]], num_new[i])
        victims = evicts[evict_offsets[i] : evict_offsets[i + 1]]
        if len(victims) == 1:
            table.evict_token(req, victims[0])
        else:
            table.evict_tokens(req, victims)
        seq = table.seq(req)
        done = _fill_single_hole(seq, tpb, is_shared) if dense and len(seq.pending_dead) == 1 else None
        if done is None:
            done = _plan_and_commit(table, req, dense, fragmentation_threshold, pressure)
        moves.append(done[0])
        freed.extend(done[1])
        freed_offsets.append(len(freed))
    return moves, freed_offsets, freed


def _fill_single_hole(seq: Sequence, tpb: int, is_shared) -> tuple[int, list[int]] | None:
    """Dense compaction of a request whose one hole is its one pending eviction.

    Does what ``plan_dense`` + ``apply_moves`` + ``truncate`` do for that case: the hole below the
    new length R = kv_len - 1 takes the token at position R (one move); position R empties; a block
    left wholly beyond R is released. Returns None (changing nothing) for any other case,
    including any shared block in sight, for the general calls to handle.
    """
    hole = seq.pending_dead[0]
    kv_len, token_at, live = seq.kv_len, seq.token_at_mv, seq.live_mv
    if hole >= kv_len or token_at[hole] == NO_TOKEN or live[token_at[hole]]:
        return None  # a stale hint or an empty hole: the general path sorts it out
    new_len = kv_len - 1
    keep_blocks = -(-new_len // tpb)
    blocks = seq.block_ids
    released = blocks[keep_blocks:]
    if is_shared(blocks[hole // tpb]) or is_shared(blocks[new_len // tpb]) or any(map(is_shared, released)):
        return None
    moved = token_at[new_len]
    if hole < new_len and (moved == NO_TOKEN or not live[moved]):
        return None
    slot_of, live_per_block = seq.slot_of_mv, seq.live_per_block_mv
    num_moves = 0
    if hole < new_len:  # the last token moves into the hole; the evicted token loses its slot
        slot_of[token_at[hole]] = NO_SLOT
        token_at[hole] = moved
        slot_of[moved] = blocks[hole // tpb] * tpb + hole % tpb
        live_per_block[new_len // tpb] -= 1
        live_per_block[hole // tpb] += 1
        num_moves = 1
    else:  # the evicted token was the last one: it just loses its slot
        slot_of[moved] = NO_SLOT
    token_at[new_len] = NO_TOKEN
    for block_idx in range(keep_blocks, len(blocks)):
        del seq.block_index[blocks[block_idx]]
        live_per_block[block_idx] = 0
    del blocks[keep_blocks:]
    seq.kv_len = new_len
    seq.pending_dead = []
    seq.version += 2  # apply_moves, then truncate
    return num_moves, released


def _plan_and_commit(table: TokenTable, req: int, dense: bool, threshold: int, pressure: bool) -> tuple[int, list[int]]:
    if dense:
        plan = plan_dense(table, req)
    elif pressure or fragmentation(table, req) >= threshold:
        plan = plan_lazy(table, req)
    else:
        plan = None
    if plan is None:
        return 0, []
    table.apply_moves(req, plan.token_ids, plan.dst_slots)
    if plan.new_kv_len is not None:
        table.truncate(req, plan.new_kv_len)
    else:
        table.release_blocks(req, plan.blocks_to_free)
    return plan.num_moves, list(plan.blocks_to_free)


def _as_list(values: SequenceOf[int]) -> list[int]:
    return values.tolist() if isinstance(values, np.ndarray) else [int(v) for v in values]


def _check_csr(offsets: list[int], num_values: int, name: str) -> None:
    if offsets[0] != 0 or offsets[-1] > num_values or any(a > b for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"step_batch: {name} must start at 0, never decrease and stay within its values")
