# SPDX-License-Identifier: Apache-2.0
"""The token table's two ways of giving blocks back (``TokenTable.truncate``, ``release_blocks``),
which the reclamation backend calls after it moved KV: dense compaction cuts the tail, lazy
compaction drops blocks without live tokens from anywhere in the list. tokens_per_block = 4,
block_ids [7, 2, 9] (. dead, _ empty):

    truncate(6):          [0 1 2 3][4 5 . .][. . . _]  ->  [0 1 2 3][4 5 _ _]   9 released
    release_blocks([2]):  [0 1 2 3][. . . .][8 9 _ _]  ->  [0 1 2 3][8 9 _ _]   later positions move
                                                                                down a block

Each validates first (``TableChecks``) and changes nothing on an error. The C++ core mirrors both
(``cpp/core/release.cpp``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from trtllm_vtoken.core.arguments import as_int, as_ints
from trtllm_vtoken.core.block_holders import BlockHolders
from trtllm_vtoken.core.sequence import NO_SLOT, NO_TOKEN, Sequence


class BlockRelease:
    """``TokenTable``'s block release; mixed into it (it mutates the table's arrays)."""

    tokens_per_block: int
    block_holders: BlockHolders
    seq: Callable[[int], Sequence]
    check_truncate: Callable[[int, int], list[int]]
    check_release: Callable[[int, list[int]], None]

    def truncate(self, req_id: int, new_kv_len: int) -> list[int]:
        """Shortens the request to positions ``[0, new_kv_len)`` and drops the blocks past it.

        Dead tokens beyond the new length lose their slots. Returns the released block ids (the
        caller frees them in the pool). Raises ValueError if a live token lies beyond the new
        length, the new length ends inside a shared block, or a released block is shared.
        """
        req_id, new_kv_len = as_int(req_id), as_int(new_kv_len)
        seq = self.seq(req_id)
        released = self.check_truncate(req_id, new_kv_len)
        keep_blocks = len(seq.block_ids) - len(released)
        seq.drop_tokens_in(new_kv_len, seq.kv_len)
        for block_id in released:
            del seq.block_index[block_id]
        del seq.block_ids[keep_blocks:]
        self.block_holders.let_go(released)
        for block_idx in range(keep_blocks, keep_blocks + len(released)):
            seq.live_per_block_mv[block_idx] = 0
        seq.kv_len = new_kv_len
        if seq.pending_dead:
            seq.pending_dead = [p for p in seq.pending_dead if p < new_kv_len]
        seq.version += 1
        return released

    def release_blocks(self, req_id: int, block_ids: Iterable[int]) -> None:
        """Removes blocks that hold no live token from anywhere in the request's block list.

        Later positions shift down by ``tokens_per_block`` per removed block (slots do not
        change). Used by lazy compaction with masked attention; TensorRT-LLM's V1 manager can only
        release tail blocks, which ``truncate`` covers.
        """
        req_id, blocks = as_int(req_id), as_ints(block_ids)
        seq, tpb = self.seq(req_id), self.tokens_per_block
        self.check_release(req_id, blocks)
        if not blocks:
            return
        drop = np.array(sorted(seq.block_index[b] for b in blocks))
        positions = (drop[:, None] * tpb + np.arange(tpb)).ravel()
        dead = seq.token_at[positions]
        seq.slot_of[dead[dead != NO_TOKEN]] = NO_SLOT
        old_len, num_blocks = seq.kv_len, len(seq.block_ids)
        keep = np.ones(num_blocks, dtype=bool)
        keep[drop] = False
        rows = seq.token_at[: num_blocks * tpb].reshape(num_blocks, tpb)[keep].ravel().copy()
        seq.token_at[: num_blocks * tpb] = NO_TOKEN
        seq.token_at[: rows.size] = rows
        counts = seq.live_per_block[:num_blocks][keep].copy()
        seq.live_per_block[:num_blocks] = 0
        seq.live_per_block[: counts.size] = counts
        # Each dropped block removes the part of [0, kv_len) it covered.
        covered = np.clip(old_len - drop * tpb, 0, tpb)
        seq.kv_len = old_len - int(covered.sum())
        seq.block_ids = [b for i, b in enumerate(seq.block_ids) if keep[i]]
        seq.block_index = {b: i for i, b in enumerate(seq.block_ids)}
        self.block_holders.let_go(blocks)
        shift = np.searchsorted(drop, np.asarray(seq.pending_dead, dtype=np.int64) // tpb, side="right")
        seq.pending_dead = [
            int(p - s * tpb) for p, s in zip(seq.pending_dead, shift) if keep[p // tpb]
        ]
        seq.version += 1
