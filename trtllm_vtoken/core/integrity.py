# SPDX-License-Identifier: Apache-2.0
"""Invariant I2 (unique mapping) over the token table's arrays, written for clarity, not speed.

Every live id maps to exactly one slot inside its request's blocks and below ``kv_len``; the
reverse map agrees; no slot is referenced twice; counters match a recount; a block appears in
several requests only if the pool marks it shared, and the table's count of each block's
holders agrees.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from trtllm_vtoken.core.sequence import NO_SLOT, NO_TOKEN, Sequence


def check_sequence(req_id: int, seq: Sequence, tokens_per_block: int) -> None:
    """Raises RuntimeError naming the first broken invariant of one request."""
    tpb = tokens_per_block

    def fail(message: str) -> None:
        raise RuntimeError(f"token table of request {req_id}: {message}")

    if len(seq.block_index) != len(seq.block_ids) or any(
        seq.block_index.get(b) != i for i, b in enumerate(seq.block_ids)
    ):
        fail(f"block index {seq.block_index} disagrees with block list {seq.block_ids}")
    if not 0 <= seq.kv_len <= len(seq.block_ids) * tpb:
        fail(f"kv_len {seq.kv_len} exceeds the {len(seq.block_ids)} blocks held")
    token_at = seq.token_at[: len(seq.block_ids) * tpb]
    if (token_at[seq.kv_len :] != NO_TOKEN).any() or (seq.token_at[len(token_at) :] != NO_TOKEN).any():
        fail("a position at or beyond kv_len holds a token")
    held = np.flatnonzero(token_at != NO_TOKEN)
    tokens = token_at[held]
    if len(np.unique(tokens)) != len(tokens):
        fail("a token is referenced by two positions (I2)")
    if ((tokens < 0) | (tokens >= seq.num_tokens)).any():
        fail("a position holds an unknown token id")
    blocks = np.asarray(seq.block_ids, dtype=np.int64)
    expected_slots = blocks[held // tpb] * tpb + held % tpb
    if not np.array_equal(seq.slot_of[tokens].astype(np.int64), expected_slots):
        fail("slot_of and token_at disagree (I2)")
    slot_holders = np.flatnonzero(seq.slot_of[: seq.num_tokens] != NO_SLOT)
    if len(slot_holders) != len(tokens):
        fail(f"{len(slot_holders)} tokens claim a slot but {len(tokens)} positions hold one (I2)")
    live = seq.live[: seq.num_tokens].astype(bool)
    if (seq.live[seq.num_tokens :] != 0).any():
        fail("liveness set for an unassigned token id")
    live_without_slot = np.flatnonzero(live & (seq.slot_of[: seq.num_tokens] == NO_SLOT))
    if len(live_without_slot):
        fail(f"live tokens without a slot: {live_without_slot[:8].tolist()} (I2)")
    if int(live.sum()) != seq.num_live:
        fail(f"num_live {seq.num_live} but {int(live.sum())} live bits")
    counts = np.bincount(held[live[tokens]] // tpb, minlength=len(seq.block_ids))
    if not np.array_equal(counts, seq.live_per_block[: len(seq.block_ids)]):
        fail("live_per_block disagrees with a recount")
    holes = set(np.flatnonzero(token_at[: seq.kv_len] == NO_TOKEN).tolist())
    holes |= set(held[~live[tokens]].tolist())
    missing = holes - set(seq.pending_dead)
    if missing:
        fail(f"hole positions missing from the pending list: {sorted(missing)[:8]}")


def check_blocks_disjoint(block_lists: dict[int, list[int]], is_shared: Callable[[int], bool],
                          holders: dict[int, int] | None = None) -> None:
    """Raises RuntimeError if a block sits in two requests' lists without being shared, or if
    ``holders`` (block -> requests holding it, the table's count) disagrees with a recount."""
    owner: dict[int, int] = {}
    recount: dict[int, int] = {}
    for req_id, blocks in block_lists.items():
        for block_id in blocks:
            other = owner.setdefault(block_id, req_id)
            if other != req_id and not is_shared(block_id):
                raise RuntimeError(
                    f"block {block_id} is held by requests {other} and {req_id} but not shared (I2)"
                )
            recount[block_id] = recount.get(block_id, 0) + 1
    if holders is not None and holders != recount:
        wrong = sorted(b for b in holders.keys() | recount.keys() if holders.get(b) != recount.get(b))
        raise RuntimeError(f"the holders counted for blocks {wrong[:8]} disagree with the block lists")
