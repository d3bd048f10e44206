# SPDX-License-Identifier: Apache-2.0
"""The token table: per request, logical token id -> (block, offset) plus a liveness bit.

Policies speak logical ids (``evict_tokens``); engines speak blocks (``sync_new_tokens``); the
reclamation backend moves KV and then tells the table (``apply_moves``, ``truncate``,
``release_blocks``). Logical ids are assigned in write order from 0, so a token's logical id is
also its original position: RoPE positions are read from here and never re-rotated.

Every public mutation validates all of its input before changing anything: bad input raises
ValueError (KeyError for an unknown request, TypeError for a value that is not an integer) and
leaves the table as it was. Integer arguments are taken as the C++ core takes them
(``core/arguments.py``), converted first, in argument order.

A request never writes into a shared block (prefix caching): its length never ends inside one
(``append_tokens``, ``truncate``), so a request whose tail block is shared continues in a fresh
block. ``reclaim/planner.py`` keeps a dense request's length at such a block's end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceOf

import numpy as np

from trtllm_vtoken.core.arguments import as_int, as_ints, as_request_id
from trtllm_vtoken.core.block_holders import BlockHolders
from trtllm_vtoken.core.block_release import BlockRelease
from trtllm_vtoken.core.sequence import NO_SLOT, NO_TOKEN, Sequence
from trtllm_vtoken.core.single_hole import SingleHoleCompaction
from trtllm_vtoken.core.table_checks import TableChecks
from trtllm_vtoken.core.table_queries import TokenTableQueries

__all__ = ["NO_SLOT", "NO_TOKEN", "TokenTable"]


class TokenTable(TokenTableQueries, TableChecks, SingleHoleCompaction, BlockRelease):
    """Token tables of all requests served from one block pool.

    Args:
        tokens_per_block: Slots per block, as TensorRT-LLM's ``tokens_per_block``.
        is_shared: Tells whether a block is referenced by several requests (prefix caching).
            Tokens in such blocks are protected: they can be neither evicted nor moved.
    """

    def __init__(self, tokens_per_block: int, is_shared: Callable[[int], bool] | None = None) -> None:
        tokens_per_block = as_int(tokens_per_block)
        if tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
        self.tokens_per_block = tokens_per_block
        self.is_shared = is_shared or (lambda block_id: False)
        self.max_block_id = 2**31 // tokens_per_block
        """Block ids lie in [0, max_block_id): a slot, block * tokens_per_block + offset, is an int32."""
        self._seqs: dict[int, Sequence] = {}
        self.block_holders = BlockHolders()
        """How many requests hold each block: an unshared one joins no second request."""

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, req_id: int) -> None:
        """Starts an empty request. Request ids lie in [0, 2**63 - 1] (``as_request_id``)."""
        req_id = as_request_id(req_id)
        if req_id in self._seqs:
            raise ValueError(f"request {req_id} is already in the token table")
        self._seqs[req_id] = Sequence()

    def remove_request(self, req_id: int) -> list[int]:
        """Forgets the request. Returns its block list, which the caller frees in the pool."""
        self.seq(req_id)
        blocks = self._seqs.pop(req_id).block_ids
        self.block_holders.let_go(blocks)
        return blocks

    # ---- the contract ----------------------------------------------------------------------------
    def sync_new_tokens(self, req_id: int, block_ids: SequenceOf[int], total_len: int) -> range:
        """Registers the tokens the engine wrote at positions ``[kv_len, total_len)``.

        Args:
            block_ids: The request's whole block list now: the current list, unchanged, plus any
                newly allocated blocks at its end.
            total_len: The new physical KV length; the new tokens get the next logical ids.
        Returns:
            The logical ids of the new tokens.
        """
        req_id, block_ids, total_len = as_int(req_id), as_ints(block_ids), as_int(total_len)
        seq = self.seq(req_id)
        current = seq.block_ids
        known = len(current)
        if len(block_ids) < known or block_ids[:known] != current:
            raise ValueError(
                f"request {req_id}: block list must extend the current one {current}, "
                f"got {block_ids}"
            )
        return self.append_tokens(req_id, block_ids[known:], total_len - seq.kv_len)

    def append_tokens(self, req_id: int, new_block_ids: SequenceOf[int], num_new: int) -> range:
        """``sync_new_tokens`` given only what changed: blocks appended to the list, tokens written.

        The decode path's form (no copy of the whole block list). Raises ValueError, changing
        nothing, if a new block repeats or lies outside [0, max_block_id), if another request holds
        it and it is not shared (prefix caching), if the tokens do not fit the blocks, or if they
        would write into a shared block or end inside one (a shared block is registered whole, as
        a prefix; a request whose tail block became shared has its length at that block's end and
        continues in a fresh block).
        """
        # The decode step's arguments (an int, an empty list, 1) pass without a call; a request id
        # outside int64 is refused by ``seq`` (it names no request).
        if type(req_id) is not int:
            req_id = as_int(req_id)
        added = new_block_ids if type(new_block_ids) is list and not new_block_ids else as_ints(new_block_ids)
        if type(num_new) is not int or not -9223372036854775808 <= num_new <= 9223372036854775807:
            num_new = as_int(num_new)
        seq, tpb = self.seq(req_id), self.tokens_per_block
        if added and (
            len(set(added)) != len(added)
            or any(b in seq.block_index or not 0 <= b < self.max_block_id for b in added)
        ):
            raise ValueError(
                f"request {req_id}: new blocks {added} repeat a block or lie outside [0, {self.max_block_id}) "
                f"(slots are int32: block * {tpb} + offset)"
            )
        held = self.block_holders.held_unshared(added, self.is_shared) if added else added
        if held:
            raise ValueError(f"request {req_id}: new blocks {held} are held by another request (only a shared block "
                             f"may join several requests)")
        known = len(seq.block_ids)
        num_blocks = known + len(added)
        total_len = seq.kv_len + num_new
        if not seq.kv_len <= total_len <= num_blocks * tpb:
            raise ValueError(
                f"request {req_id}: total_len {total_len} must lie in [{seq.kv_len}, "
                f"{num_blocks * tpb}] (current length, capacity of {num_blocks} blocks)"
            )
        if num_new == 1 and tpb > 1:  # the decode step: its token's block, shared, breaks the rule
            index = seq.kv_len // tpb
            if self.is_shared(seq.block_ids[index] if index < known else added[index - known]):
                self._check_shared_tail(req_id, seq, added, total_len)
        elif num_new and (seq.kv_len % tpb or total_len % tpb):
            self._check_shared_tail(req_id, seq, added, total_len)
        first_id = seq.num_tokens
        if first_id + num_new > len(seq.slot_of):
            seq.reserve_tokens(first_id + num_new)
        if num_blocks * tpb > len(seq.token_at) or num_blocks > len(seq.live_per_block):
            seq.reserve_blocks(num_blocks, tpb)
        for block_id in added:
            seq.block_index[block_id] = len(seq.block_ids)
            seq.block_ids.append(block_id)
        if added:
            self.block_holders.hold(added)
        if num_new == 1:  # the decode step: scalar writes beat building arrays
            pos = seq.kv_len
            block_idx = pos // tpb
            seq.slot_of_mv[first_id] = seq.block_ids[block_idx] * tpb + pos % tpb
            seq.token_at_mv[pos] = first_id
            seq.live_per_block_mv[block_idx] += 1
            seq.live_mv[first_id] = 1
        elif num_new:
            positions = np.arange(seq.kv_len, total_len)
            blocks = np.asarray(seq.block_ids, dtype=np.int64)
            seq.slot_of[first_id : first_id + num_new] = blocks[positions // tpb] * tpb + positions % tpb
            seq.token_at[seq.kv_len : total_len] = np.arange(first_id, first_id + num_new)
            np.add.at(seq.live_per_block, positions // tpb, 1)
            seq.live[first_id : first_id + num_new] = 1
        seq.num_tokens += num_new
        seq.num_live += num_new
        seq.kv_len = total_len
        seq.version += 1
        return range(first_id, first_id + num_new)

    def evict_token(self, req_id: int, token_id: int) -> None:
        """Marks one token dead. No KV moves; attention excludes it from the next step on."""
        if type(req_id) is not int:
            req_id = as_int(req_id)
        if type(token_id) is not int:
            token_id = as_int(token_id)
        seq, tpb = self.seq(req_id), self.tokens_per_block
        if not 0 <= token_id < seq.num_tokens or not seq.live_mv[token_id]:
            self.evict_tokens(req_id, (token_id,))  # raises the precise error
            return
        block_id, offset = divmod(seq.slot_of_mv[token_id], tpb)
        if self.is_shared(block_id):
            self.evict_tokens(req_id, (token_id,))
            return
        block_idx = seq.block_index[block_id]
        seq.live_mv[token_id] = 0
        seq.live_per_block_mv[block_idx] -= 1
        seq.pending_dead.append(block_idx * tpb + offset)
        seq.num_live -= 1
        seq.version += 1

    def evict_tokens(self, req_id: int, token_ids: Iterable[int]) -> None:
        """Marks tokens dead (the batched form of ``evict_token``).

        Raises ValueError, evicting none, if an id is out of range, repeated, already dead, or
        protected (its block is shared by several requests).
        """
        req_id, ids = as_int(req_id), as_ints(token_ids)
        seq, tpb = self.seq(req_id), self.tokens_per_block
        if len(set(ids)) != len(ids):
            raise ValueError(f"request {req_id}: token ids to evict repeat: {ids}")
        positions = []
        for token_id in ids:
            if not 0 <= token_id < seq.num_tokens:
                raise ValueError(f"request {req_id}: token id {token_id} out of range [0, {seq.num_tokens})")
            if not seq.live_mv[token_id]:
                raise ValueError(f"request {req_id}: token {token_id} is already dead")
            slot = seq.slot_of_mv[token_id]
            if self.is_shared(slot // tpb):
                raise ValueError(
                    f"request {req_id}: token {token_id} is protected: block {slot // tpb} is shared"
                )
            positions.append(seq.block_index[slot // tpb] * tpb + slot % tpb)
        live, live_per_block = seq.live_mv, seq.live_per_block_mv
        for token_id, pos in zip(ids, positions):
            live[token_id] = 0
            live_per_block[pos // tpb] -= 1
        seq.pending_dead.extend(positions)
        seq.num_live -= len(ids)
        seq.version += 1

    def apply_moves(self, req_id: int, token_ids: SequenceOf[int], dst_slots: SequenceOf[int]) -> None:
        """After a copy has completed: points each token at its new slot and clears the source.

        A destination must be a slot of this request's unshared blocks inside ``[0, kv_len)``
        that holds no live token (empty, or a dead token, which then loses its slot) and is not
        the source of another move. Liveness is unchanged.
        """
        req_id, ids, dsts = as_int(req_id), as_ints(token_ids), as_ints(dst_slots)
        seq, tpb = self.seq(req_id), self.tokens_per_block
        src_pos, dst_pos = self.move_positions(req_id, ids, dsts)
        token_at, live, slot_of = seq.token_at_mv, seq.live_mv, seq.slot_of_mv
        live_per_block = seq.live_per_block_mv
        for token_id, dst, src, pos in zip(ids, dsts, src_pos, dst_pos):
            occupant = token_at[pos]
            if occupant != NO_TOKEN:
                slot_of[occupant] = NO_SLOT
            token_at[src] = NO_TOKEN
            token_at[pos] = token_id
            slot_of[token_id] = dst
            if live[token_id]:
                live_per_block[src // tpb] -= 1
                live_per_block[pos // tpb] += 1
        filled = {pos for token_id, pos in zip(ids, dst_pos) if live[token_id]}
        seq.pending_dead = [p for p in seq.pending_dead if p not in filled] + src_pos
        seq.version += 1

    def holders_of(self, block_id: int) -> int:
        """How many requests hold the block now (several only if it is shared)."""
        return self.block_holders.count(as_int(block_id))

    # ---- invariants ----------------------------------------------------------------------------
    def check_integrity(self, req_id: int | None = None) -> None:
        """I2 (unique mapping) plus bookkeeping; raises RuntimeError naming the first violation."""
        from trtllm_vtoken.core.integrity import check_blocks_disjoint, check_sequence

        ids = self.request_ids() if req_id is None else [req_id]
        for rid in ids:
            check_sequence(rid, self.seq(rid), self.tokens_per_block)
        if req_id is None:
            check_blocks_disjoint({rid: s.block_ids for rid, s in self._seqs.items()}, self.is_shared,
                                  self.block_holders.counts())

    # ---- private -------------------------------------------------------------------------------
    def _check_shared_tail(self, req_id: int, seq: Sequence, added: list[int], total_len: int) -> None:
        """The shared-block rule for tokens about to fill positions [kv_len, total_len)."""
        tpb, known, kv_len = self.tokens_per_block, len(seq.block_ids), seq.kv_len
        if kv_len % tpb:  # the tail block is partly written: the next token goes there
            block_id = seq.block_ids[kv_len // tpb]
            if self.is_shared(block_id):
                raise ValueError(f"request {req_id}: position {kv_len} is in shared block {block_id}: "
                                 f"a request never writes into a shared block")
        if total_len % tpb:
            index = total_len // tpb
            block_id = seq.block_ids[index] if index < known else added[index - known]
            if self.is_shared(block_id):
                raise ValueError(f"request {req_id}: length {total_len} would end inside shared block "
                                 f"{block_id}: a shared block is registered whole")
