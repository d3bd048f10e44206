# SPDX-License-Identifier: Apache-2.0
"""Per-request arrays behind the token table. Private to ``core``; read through ``TokenTable``.

One request, tokens_per_block B = 4, after a few evictions (L live, . dead, _ empty):

    block_ids  = [7, 2, 9]                  the request's block list (its row of the block table)
    positions    0 1 2 3 | 4 5 6 7 | 8 9 ...
    token_at   = [0 1 2 3 | 4 5 6 7 | 8 _ _ _]   position -> logical id (NO_TOKEN if empty)
    liveness     L L . L   . L L L   L          live[token_at[p]]
    kv_len     = 9                              positions [0, kv_len) are attended / written
    slot_of[5] = 2 * B + 1                      logical id -> flat slot (block_id * B + offset)

Memory is O(L): ``slot_of`` (int32) and ``live`` (uint8) per logical token, ``token_at`` (int32)
per position, ``live_per_block`` (int32) per block. Arrays grow by doubling.

Each array comes with a memoryview of the same buffer (``slot_of_mv`` ...). The decode step
touches a handful of entries per request, and a numpy scalar read or write costs about ten times
a memoryview's (~0.9 us vs ~0.09 us): scalar code goes through the views, vector code through the
arrays. ``reserve_*`` rebinds both together.
"""

from __future__ import annotations

import numpy as np

NO_SLOT = -1
"""Value of ``slot_of[token]`` for a token whose KV no longer exists (evicted and reclaimed)."""
NO_TOKEN = -1
"""Value of ``token_at[position]`` for a position that holds no token."""

_INITIAL_CAPACITY = 64


def _grown(array: np.ndarray, needed: int, fill: int) -> np.ndarray:
    """Returns ``array`` if it has ``needed`` entries, else a copy doubled until it does."""
    if needed <= len(array):
        return array
    capacity = max(len(array), _INITIAL_CAPACITY)
    while capacity < needed:
        capacity *= 2
    out = np.full(capacity, fill, dtype=array.dtype)
    out[: len(array)] = array
    return out


class Sequence:
    """The token-table row of one request. Mutated only by ``TokenTable``."""

    __slots__ = (
        "block_ids", "block_index", "num_tokens", "kv_len", "num_live", "version",
        "slot_of", "live", "token_at", "live_per_block", "pending_dead",
        "slot_of_mv", "live_mv", "token_at_mv", "live_per_block_mv",
    )

    def __init__(self) -> None:
        self.block_ids: list[int] = []
        self.block_index: dict[int, int] = {}
        self.num_tokens = 0  # logical ids handed out: [0, num_tokens)
        self.kv_len = 0  # physical positions in use: [0, kv_len)
        self.num_live = 0
        self.version = 0  # bumped by every mutation; plans record it (I4 snapshot)
        self.slot_of = np.full(0, NO_SLOT, dtype=np.int32)
        self.live = np.zeros(0, dtype=np.uint8)
        self.token_at = np.full(0, NO_TOKEN, dtype=np.int32)
        self.live_per_block = np.zeros(0, dtype=np.int32)
        self._bind_views()
        # Positions evicted since the last relocation, in eviction order. Dense planning consumes
        # them so the per-step plan costs O(evictions), not O(L); lazy planning rescans instead.
        self.pending_dead: list[int] = []

    def reserve_tokens(self, num_tokens: int) -> None:
        self.slot_of = _grown(self.slot_of, num_tokens, NO_SLOT)
        self.live = _grown(self.live, num_tokens, 0)
        self._bind_views()

    def reserve_blocks(self, num_blocks: int, tokens_per_block: int) -> None:
        self.token_at = _grown(self.token_at, num_blocks * tokens_per_block, NO_TOKEN)
        self.live_per_block = _grown(self.live_per_block, num_blocks, 0)
        self._bind_views()

    def _bind_views(self) -> None:
        self.slot_of_mv, self.live_mv = memoryview(self.slot_of), memoryview(self.live)
        self.token_at_mv, self.live_per_block_mv = memoryview(self.token_at), memoryview(self.live_per_block)

    def live_at(self, positions: np.ndarray) -> np.ndarray:
        """Boolean mask: does each position hold a live token? Shape: positions.shape."""
        tokens = self.token_at[positions]
        held = tokens != NO_TOKEN
        out = np.zeros(len(positions), dtype=bool)
        out[held] = self.live[tokens[held]].astype(bool)
        return out

    # Ranges here are short on the decode path (one step's holes), long only for rare resets:
    # scalar loops below a few entries, numpy above.
    def has_live_in(self, start: int, stop: int) -> bool:
        """Does any position in [start, stop) hold a live token?"""
        if stop - start <= 8:
            token_at, live = self.token_at_mv, self.live_mv
            return any(token_at[p] != NO_TOKEN and live[token_at[p]] for p in range(start, stop))
        return bool(self.live_at(np.arange(start, stop)).any())

    def drop_tokens_in(self, start: int, stop: int) -> None:
        """Empties positions [start, stop); their tokens lose their slots."""
        if stop - start <= 8:
            slot_of, token_at = self.slot_of_mv, self.token_at_mv
            for p in range(start, stop):
                token = token_at[p]
                if token != NO_TOKEN:
                    slot_of[token] = NO_SLOT
                    token_at[p] = NO_TOKEN
            return
        tokens = self.token_at[start:stop]
        self.slot_of[tokens[tokens != NO_TOKEN]] = NO_SLOT
        tokens[:] = NO_TOKEN

    def metadata_bytes(self, tokens_per_block: int) -> int:
        """Bytes the table needs for this request (in-use entries, not the doubling slack)."""
        return (
            self.num_tokens * (self.slot_of.itemsize + self.live.itemsize)
            + len(self.block_ids) * tokens_per_block * self.token_at.itemsize
            + len(self.block_ids) * self.live_per_block.itemsize
        )
