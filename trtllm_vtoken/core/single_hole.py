# SPDX-License-Identifier: Apache-2.0
"""The decode step's dense compaction as one table operation (``TokenTable.fill_single_hole``).

Most requests of a dense decode step have one shape: one eviction, which is their only hole.
Planning it (``plan_dense``), then ``apply_moves`` and ``truncate``, builds a plan object and
re-validates the move; for this shape the outcome is known, so it is applied straight to the
arrays. tokens_per_block = 4, token 2 evicted, R = kv_len - 1 = 8:

    before: [0 1 . 3][4 5 6 7][8 _ _ _]   kv_len 9
    after:  [0 1 8 3][4 5 6 7]            kv_len 8; token 8 moved into the hole, block 3 released

The table ends exactly as the general calls leave it, version count included (checked against
them by ``tests/reclaim/test_step_batch.py``). The C++ core has the same method. Metadata only:
callers that keep KV copy it themselves (``step_batch`` is metadata-only).
"""

from __future__ import annotations

from collections.abc import Callable

from trtllm_vtoken.core.block_holders import BlockHolders
from trtllm_vtoken.core.sequence import NO_SLOT, NO_TOKEN, Sequence


class SingleHoleCompaction:
    """``TokenTable``'s single-hole shortcut; mixed into it (it mutates the table's arrays)."""

    tokens_per_block: int
    is_shared: Callable[[int], bool]
    seq: Callable[[int], Sequence]
    block_holders: BlockHolders

    def fill_single_hole(self, req_id: int) -> tuple[int, list[int]] | None:
        """Dense compaction of a request whose one hole is its one pending eviction.

        Returns (moves, released block ids); the caller frees the blocks in its pool. Returns
        None, changing nothing, in any other case (more holes, a stale hint, a shared block in
        sight), for ``plan_dense`` and a commit to handle.
        """
        seq, tpb, is_shared = self.seq(req_id), self.tokens_per_block, self.is_shared
        if len(seq.pending_dead) != 1:
            return None
        hole = seq.pending_dead[0]
        kv_len, token_at, live = seq.kv_len, seq.token_at_mv, seq.live_mv
        if hole >= kv_len or token_at[hole] == NO_TOKEN or live[token_at[hole]]:
            return None  # a stale hint or an empty hole
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
        self.block_holders.let_go(released)
        seq.kv_len = new_len
        seq.pending_dead = []
        seq.version += 2  # as apply_moves, then truncate
        return num_moves, released
