# SPDX-License-Identifier: Apache-2.0
"""The checks behind the token table's relocation calls, usable before any of them runs.

A commit is two calls: ``apply_moves``, then ``truncate`` (dense) or ``release_blocks`` (lazy).
Each call checks its own input and changes nothing when it refuses, but the second one's checks
depend on what the first did. These methods run them ahead: ``move_positions`` checks the moves,
and ``check_truncate`` / ``check_release`` check the second call as it would run after those
moves, so a commit refused for any reason is refused before the table changes.

    positions   0 1 2 3 | 4 5 6 7        L live, . dead; one move, 5 -> 1
    before      L . L L | L L _ _        kv_len 6
    after       L L L L | L . _ _        truncate(5) is valid after the move, not before it
"""

from __future__ import annotations

from collections.abc import Callable

from trtllm_vtoken.core.sequence import NO_SLOT, NO_TOKEN, Sequence

Moves = tuple[list[int], list[int]]
"""(positions the moved tokens leave, positions they fill), as ``move_positions`` returns them."""
NO_MOVES: Moves = ([], [])


class TableChecks:
    """``TokenTable``'s validation of relocations; mixed into it (reads the request's arrays)."""

    tokens_per_block: int
    is_shared: Callable[[int], bool]
    seq: Callable[[int], Sequence]

    def move_positions(self, req_id: int, token_ids: list[int], dst_slots: list[int]) -> Moves:
        """Checks moves as ``apply_moves`` does, changing nothing; returns the positions they
        leave and fill. Raises ValueError naming the first bad move."""
        seq, tpb = self.seq(req_id), self.tokens_per_block
        if len(token_ids) != len(dst_slots):
            raise ValueError(f"request {req_id}: {len(token_ids)} tokens but {len(dst_slots)} destination slots")
        if len(set(token_ids)) != len(token_ids) or len(set(dst_slots)) != len(dst_slots):
            raise ValueError(f"request {req_id}: a token or a destination slot repeats in the moves")
        src_pos = [self._position_of_token(req_id, seq, t) for t in token_ids]
        dst_pos = [self._writable_position(req_id, seq, d) for d in dst_slots]
        moving_from = set(src_pos)
        token_at, live, is_shared = seq.token_at_mv, seq.live_mv, self.is_shared
        for token_id, dst, src, pos in zip(token_ids, dst_slots, src_pos, dst_pos):
            if pos in moving_from:
                raise ValueError(f"request {req_id}: slot {dst} is the source of another move")
            occupant = token_at[pos]
            if occupant != NO_TOKEN and live[occupant]:
                raise ValueError(f"request {req_id}: slot {dst} is occupied by live token {occupant}")
            if is_shared(seq.block_ids[src // tpb]):
                raise ValueError(f"request {req_id}: token {token_id} sits in a shared block")
        return src_pos, dst_pos

    def check_truncate(self, req_id: int, new_kv_len: int, after: Moves = NO_MOVES) -> list[int]:
        """Checks ``truncate(req_id, new_kv_len)`` as it would run after the moves ``after``
        (from ``move_positions``), changing nothing. Returns the blocks it would release.

        Raises ValueError if the length is out of range, a live token would lie beyond it, it
        would end inside a shared block, or a released block is shared.
        """
        seq, tpb = self.seq(req_id), self.tokens_per_block
        if not 0 <= new_kv_len <= seq.kv_len:
            raise ValueError(f"request {req_id}: new length {new_kv_len} not in [0, {seq.kv_len}]")
        token_at, live = seq.token_at_mv, seq.live_mv
        moved = [(src, dst) for src, dst in zip(*after) if live[token_at[src]]]
        if moved:
            leaving = {src for src, _ in moved}
            beyond = any(dst >= new_kv_len for _, dst in moved) or any(
                p not in leaving and seq.has_live_in(p, p + 1) for p in range(new_kv_len, seq.kv_len)
            )
        else:
            beyond = seq.has_live_in(new_kv_len, seq.kv_len)
        if beyond:
            raise ValueError(f"request {req_id}: live tokens beyond new length {new_kv_len}")
        if new_kv_len % tpb and self.is_shared(seq.block_ids[new_kv_len // tpb]):
            # The request's next token would be written there, over KV another request reads.
            raise ValueError(f"request {req_id}: new length {new_kv_len} would end inside shared block "
                             f"{seq.block_ids[new_kv_len // tpb]}")
        released = seq.block_ids[-(-new_kv_len // tpb) :]
        shared = [b for b in released if self.is_shared(b)]
        if shared:
            raise ValueError(f"request {req_id}: cannot release shared blocks {shared}")
        return released

    def check_release(self, req_id: int, block_ids: list[int], after: Moves = NO_MOVES) -> None:
        """Checks ``release_blocks(req_id, block_ids)`` as it would run after the moves ``after``,
        changing nothing. Raises ValueError if a block repeats, is not the request's, is shared or
        would still hold a live token."""
        seq, tpb = self.seq(req_id), self.tokens_per_block
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"request {req_id}: blocks to release repeat: {block_ids}")
        live_after: dict[int, int] = {}
        token_at, live = seq.token_at_mv, seq.live_mv
        for src, dst in zip(*after):
            if live[token_at[src]]:
                live_after[src // tpb] = live_after.get(src // tpb, 0) - 1
                live_after[dst // tpb] = live_after.get(dst // tpb, 0) + 1
        for block_id in block_ids:
            if block_id not in seq.block_index:
                raise ValueError(f"request {req_id}: block {block_id} is not one of its blocks")
            if self.is_shared(block_id):
                raise ValueError(f"request {req_id}: cannot release shared block {block_id}")
            index = seq.block_index[block_id]
            if seq.live_per_block_mv[index] + live_after.get(index, 0):
                raise ValueError(f"request {req_id}: block {block_id} still holds live tokens")

    # ---- private -------------------------------------------------------------------------------
    def _position_of_token(self, req_id: int, seq: Sequence, token_id: int) -> int:
        if not 0 <= token_id < seq.num_tokens:
            raise ValueError(f"request {req_id}: token id {token_id} out of range [0, {seq.num_tokens})")
        slot = seq.slot_of_mv[token_id]
        if slot == NO_SLOT:
            raise ValueError(f"request {req_id}: token {token_id} holds no slot to move from")
        block_id, offset = divmod(slot, self.tokens_per_block)
        return seq.block_index[block_id] * self.tokens_per_block + offset

    def _writable_position(self, req_id: int, seq: Sequence, slot: int) -> int:
        block_id, offset = divmod(slot, self.tokens_per_block)
        if slot < 0 or block_id not in seq.block_index:
            raise ValueError(f"request {req_id}: slot {slot} is not in one of its blocks")
        if self.is_shared(block_id):
            raise ValueError(f"request {req_id}: slot {slot} is in shared block {block_id}")
        pos = seq.block_index[block_id] * self.tokens_per_block + offset
        if pos >= seq.kv_len:
            raise ValueError(f"request {req_id}: slot {slot} lies beyond kv_len {seq.kv_len}")
        return pos
