# SPDX-License-Identifier: Apache-2.0
"""Queries on the token table. None changes what a request holds; ``hole_positions`` only
drops stale entries from its internal list of candidate holes."""

from __future__ import annotations

from collections.abc import Callable
from operator import index

import numpy as np

from trtllm_vtoken.core.arguments import as_int
from trtllm_vtoken.core.sequence import NO_SLOT, NO_TOKEN, Sequence


class TokenTableQueries:
    """Lookups shared by the table's users: engines, policies, planners and checks."""

    tokens_per_block: int
    is_shared: Callable[[int], bool]
    _seqs: dict[int, Sequence]

    def request_ids(self) -> list[int]:
        return list(self._seqs)

    def __contains__(self, req_id: object) -> bool:
        """TypeError for a value that is not an integer; False for any integer not a request."""
        if type(req_id) is not int:
            req_id = index(req_id)  # type: ignore[arg-type]
        return req_id in self._seqs

    def seq(self, req_id: int) -> Sequence:
        """The request's arrays, for planners and checks inside the package. Do not mutate.

        Raises KeyError for an unknown request (TypeError / ValueError for an id that is not an
        int64 integer, as ``as_int``)."""
        if type(req_id) is not int:
            req_id = as_int(req_id)  # a float 0.0 would find request 0 in the dict
        try:
            return self._seqs[req_id]
        except KeyError:
            as_int(req_id)
            raise KeyError(f"unknown request {req_id}") from None

    # ---- lookups -------------------------------------------------------------------------------
    def lookup(self, req_id: int, token_id: int) -> tuple[int, int] | None:
        """(block_id, offset) of a token, or None if its KV no longer exists."""
        req_id, token_id = as_int(req_id), as_int(token_id)
        seq = self.seq(req_id)
        if not 0 <= token_id < seq.num_tokens:
            raise ValueError(f"request {req_id}: token id {token_id} out of range [0, {seq.num_tokens})")
        slot = seq.slot_of_mv[token_id]
        return None if slot == NO_SLOT else divmod(slot, self.tokens_per_block)

    def token_at_slot(self, req_id: int, slot: int) -> int | None:
        """Logical id held by a slot of this request (live or dead), or None if it holds none."""
        req_id, slot = as_int(req_id), as_int(slot)
        seq = self.seq(req_id)
        block_id, offset = divmod(slot, self.tokens_per_block)
        if block_id not in seq.block_index:
            raise ValueError(f"request {req_id}: slot {slot} is not in one of its blocks")
        token = seq.token_at_mv[seq.block_index[block_id] * self.tokens_per_block + offset]
        return None if token == NO_TOKEN else token

    def block_ids(self, req_id: int) -> list[int]:
        return list(self.seq(req_id).block_ids)

    def num_blocks(self, req_id: int) -> int:
        return len(self.seq(req_id).block_ids)

    def kv_len(self, req_id: int) -> int:
        return self.seq(req_id).kv_len

    def num_tokens(self, req_id: int) -> int:
        return self.seq(req_id).num_tokens

    def num_live(self, req_id: int) -> int:
        return self.seq(req_id).num_live

    def version(self, req_id: int) -> int:
        return self.seq(req_id).version

    def is_live(self, req_id: int, token_id: int) -> bool:
        """Is this logical id a live token of the request? (False for ids out of range.)"""
        req_id, token_id = as_int(req_id), as_int(token_id)
        seq = self.seq(req_id)
        return 0 <= token_id < seq.num_tokens and bool(seq.live_mv[token_id])

    def live_ids(self, req_id: int) -> np.ndarray:
        """Live logical ids, ascending. Shape: (num_live,), int64."""
        seq = self.seq(req_id)
        return np.flatnonzero(seq.live[: seq.num_tokens])

    def live_slots(self, req_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(live ids ascending, their flat slots), int64: as the batched step's core answers it."""
        ids = self.live_ids(req_id)
        return ids, self.slots_of(req_id, ids)

    def slots_of(self, req_id: int, token_ids: np.ndarray) -> np.ndarray:
        """Flat slots (block_id * tokens_per_block + offset) of tokens; NO_SLOT where none."""
        return self.seq(req_id).slot_of[np.asarray(token_ids, dtype=np.int64)].astype(np.int64)

    def live_counts_per_block(self, req_id: int) -> np.ndarray:
        """Live tokens in each block of the request, aligned with ``block_ids``."""
        seq = self.seq(req_id)
        return seq.live_per_block[: len(seq.block_ids)].copy()

    def position_live_mask(self, req_id: int) -> np.ndarray:
        """Per position in ``[0, kv_len)``: holds a live token. The validity mask for attention."""
        seq = self.seq(req_id)
        return seq.live_at(np.arange(seq.kv_len))

    def protected_ids(self, req_id: int) -> np.ndarray:
        """Live ids in shared blocks: no policy may evict them. Ascending, int64."""
        seq, tpb = self.seq(req_id), self.tokens_per_block
        shared = [i for i, b in enumerate(seq.block_ids) if self.is_shared(b)]
        if not shared:
            return np.zeros(0, dtype=np.int64)
        tokens = seq.token_at[(np.array(shared)[:, None] * tpb + np.arange(tpb)).ravel()]
        return np.sort(tokens[tokens != NO_TOKEN]).astype(np.int64)

    def hole_positions(self, req_id: int) -> list[int]:
        """Positions in ``[0, kv_len)`` holding a dead token or nothing, ascending."""
        seq = self.seq(req_id)
        pending, token_at, live = seq.pending_dead, seq.token_at_mv, seq.live_mv
        if len(pending) == 1:  # the decode step's single eviction
            p = pending[0]
            if p < seq.kv_len and (token_at[p] == NO_TOKEN or not live[token_at[p]]):
                return [p]
        holes = sorted({p for p in pending if p < seq.kv_len})
        holes = [p for p in holes if token_at[p] == NO_TOKEN or not live[token_at[p]]]
        seq.pending_dead = holes  # drop stale hints (filled or truncated positions)
        return list(holes)

    def metadata_bytes_per_token(self) -> float:
        """Table bytes over logical tokens, all requests together: O(1) per token."""
        seqs = self._seqs.values()
        tokens = sum(s.num_tokens for s in seqs)
        return sum(s.metadata_bytes(self.tokens_per_block) for s in seqs) / max(tokens, 1)

