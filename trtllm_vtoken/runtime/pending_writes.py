# SPDX-License-Identifier: Apache-2.0
"""What each request has written, or will write this iteration, beyond its layout (the step's
tables or native's block lists), until a step takes it in:

    prefix   a cached prefix taken at admission: its blocks and tokens, written already (their KV
             is reused), joining the layout with the request's first step
    staged   the blocks and tokens reserved for forwards whose step has not run yet: this
             iteration's, and with the overlap scheduler the previous iteration's too (its step
             runs beside this iteration's forward); ``latest`` then says how many are this
             iteration's

    request's KV   = layout (blocks, kv_len) + prefix (if any) + staged (earlier, then this forward's)

The KV manager (``runtime/kv_manager.py``) reserves through it, names the forward's slots from it,
hands ``take``'s batch to the step and frees whatever a leaving request still had here.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from typing import Any

import numpy as np

NOTHING: tuple[list[int], int] = ([], 0)
"""No cached prefix waiting to join a request's layout (read only: never extended in place)."""
ONE_TOKEN: tuple[list[int], int] = ([], 1)
"""A decode row's reservation that needs no new block (read only, as ``NOTHING``)."""


class PendingWrites:
    """Cached prefixes and reservations not yet in the layout, per request.

    Args:
        layout: The step or native's block lists (``kv_len``, ``num_blocks``, ``block_ids``,
            ``held``).
        allocate: Takes n blocks (None, changing nothing, if they are not there): the pool's, or
            the prefix cache's, which may reclaim unheld cached blocks.
        num_free: Blocks the pool's free list holds now.
    """

    def __init__(self, tokens_per_block: int, layout: Any, allocate: Callable[[int], list[int] | None],
                 num_free: Callable[[], int]) -> None:
        self.tokens_per_block, self.layout, self.allocate, self.num_free = tokens_per_block, layout, allocate, num_free
        self.staged: dict[int, tuple[list[int], int]] = {}  # req -> (new blocks, new tokens)
        self.latest: dict[int, int] = {}  # req -> this iteration's tokens, where earlier ones are staged too
        self.prefix: dict[int, tuple[list[int], int]] = {}  # req -> (cached blocks, cached tokens)

    def add_prefix(self, req_id: int, blocks: list[int]) -> None:
        """A cached prefix of whole blocks, taken at admission."""
        self.prefix[req_id] = (blocks, len(blocks) * self.tokens_per_block)

    def cached_tokens(self, req_id: int) -> int:
        """Tokens of a cached prefix not yet in the layout (0: none)."""
        return self.prefix.get(req_id, NOTHING)[1]

    # ---- reservations --------------------------------------------------------------------------
    def reserve(self, req_id: int, num_new: int) -> bool:
        """Room for ``num_new`` tokens after the request's KV, allocating blocks as needed. False,
        changing nothing, if there are not enough blocks."""
        fresh = self._blocks_for(req_id, num_new)
        if fresh is None:
            return False
        fresh_before, earlier = self.staged.get(req_id, NOTHING)
        self.staged[req_id] = (fresh_before + fresh, earlier + num_new)
        if earlier:
            self.latest[req_id] = num_new
        return True

    def _blocks_for(self, req_id: int, num_more: int) -> list[int] | None:
        """The fresh blocks ``num_more`` tokens after everything the request has written and
        staged need, allocated ([] when its blocks have room; None, changing nothing, if the
        pool lacks them)."""
        held, start = self.written_counts(req_id)
        fresh, staged = self.staged.get(req_id, NOTHING)
        missing = -(-(start + staged + num_more) // self.tokens_per_block) - held - len(fresh)
        return self.allocate(missing) if missing > 0 else []

    def reserve_decode(self, req_ids: list[int]) -> bool:
        """``reserve(req, 1)`` for every request, in order, when the free list alone covers them
        all (a decode step's usual case): the same blocks to the same requests, at once. False,
        changing nothing, otherwise (the caller then reserves one by one, preempting as it must)."""
        if not req_ids:
            return True
        if self.prefix and any(r in self.prefix for r in req_ids):
            return False  # a cached prefix not yet joined: ``reserve`` counts it
        held, written = self.layout.held(req_ids)
        staged = self.staged
        earlier = [staged.get(r, NOTHING) for r in req_ids] if staged else None
        if earlier is not None:  # the previous forward's tokens, whose step has not run (overlap)
            held = held + np.fromiter((len(e[0]) for e in earlier), dtype=held.dtype, count=len(req_ids))
            written = written + np.fromiter((e[1] for e in earlier), dtype=written.dtype, count=len(req_ids))
        missing = np.maximum(written // self.tokens_per_block + 1 - held, 0)  # ceil((written + 1) / tpb) - held
        total = int(missing.sum())
        if total > self.num_free():
            return False
        if earlier is None:
            staged.update(zip(req_ids, repeat(ONE_TOKEN)))
        else:
            staged.update({r: (fresh_before, tokens + 1) for r, (fresh_before, tokens) in zip(req_ids, earlier)})
            self.latest.update({r: 1 for r, (_, tokens) in zip(req_ids, earlier) if tokens})
        if total:  # split in request order, as one ``allocate`` per request would take them
            fresh = self.allocate(total)
            takers = np.flatnonzero(missing)
            ends = np.cumsum(missing[takers]).tolist()
            for i, start, end in zip(takers.tolist(), [0, *ends], ends):
                before, tokens = staged[req_ids[i]]
                staged[req_ids[i]] = (before + fresh[start:end], tokens)
        return True

    def extend(self, req_id: int, num_more: int) -> bool:
        """``num_more`` tokens more for the request's reservation of this iteration (a decode row's
        draft tokens); False, changing nothing, if the blocks are not there."""
        more = self._blocks_for(req_id, num_more)
        if more is None:
            return False
        fresh, tokens = self.staged[req_id]
        self.staged[req_id] = (fresh + more, tokens + num_more)
        if req_id in self.latest:
            self.latest[req_id] += num_more
        return True

    def unstage(self, req_id: int, num_tokens: int, free: Callable[[list[int]], None]) -> None:
        """Drops the last ``num_tokens`` of the request's reservation (draft tokens the model did
        not accept: their KV is written and never read) and hands the fresh blocks they leave empty
        to ``free``."""
        tpb, (held, start) = self.tokens_per_block, self.written_counts(req_id)
        fresh, tokens = self.staged[req_id]
        if not 0 <= num_tokens <= self.latest.get(req_id, tokens):
            raise ValueError(f"request {req_id}: cannot drop {num_tokens} of its {tokens} reserved tokens")
        tokens -= num_tokens
        keep = max(0, -(-(start + tokens) // tpb) - held)
        if fresh[keep:]:
            free(fresh[keep:])
        self.staged[req_id] = (fresh[:keep], tokens)
        if req_id in self.latest:
            self.latest[req_id] -= num_tokens

    # ---- what a forward writes -----------------------------------------------------------------
    def written(self, req_id: int) -> tuple[list[int], int]:
        """The request's blocks and the length of its KV written so far: the layout's, plus a
        cached prefix that has not joined it yet."""
        cached_blocks, cached = self.prefix.get(req_id, NOTHING)
        return self.layout.block_ids(req_id) + cached_blocks, self.layout.kv_len(req_id) + cached

    def written_counts(self, req_id: int) -> tuple[int, int]:
        """``written`` as counts: (blocks held, length written), without copying a block list."""
        cached_blocks, cached = self.prefix.get(req_id, NOTHING)
        return self.layout.num_blocks(req_id) + len(cached_blocks), self.layout.kv_len(req_id) + cached

    def staged_blocks(self, req_id: int) -> tuple[list[int], int]:
        """The request's block list with the blocks ``reserve`` added, and its length after the write."""
        fresh, num_new = self.staged[req_id]
        blocks, start = self.written(req_id)
        return blocks + fresh, start + num_new

    def held_blocks(self, req_id: int) -> list[int]:
        """The request's blocks now: ``staged_blocks``' where a reservation is pending, else ``written``'s."""
        return (self.staged_blocks(req_id) if req_id in self.staged else self.written(req_id))[0]

    def staged_slots(self, req_id: int) -> list[int]:
        """The flat slots the latest ``reserve`` handed out (this iteration's forward writes them)."""
        blocks, total = self.staged_blocks(req_id)
        tpb, start = self.tokens_per_block, total - self.latest.get(req_id, self.staged[req_id][1])
        return [blocks[p // tpb] * tpb + p % tpb for p in range(start, total)]

    def pending_tokens(self, req_id: int) -> int:
        """Tokens written or reserved for the request and not yet in its layout (a cached prefix's,
        then every staged reservation's)."""
        return self.prefix.get(req_id, NOTHING)[1] + self.staged.get(req_id, NOTHING)[1]

    def latest_tokens(self, req_id: int) -> int:
        """Tokens of the request's latest reservation (this iteration's forward's): every staged
        one unless tokens of an earlier forward wait too (0: none staged)."""
        return self.latest.get(req_id, self.staged.get(req_id, NOTHING)[1])

    def earlier_tokens(self, req_id: int) -> int:
        """Tokens reserved before the latest reservation and not taken yet (the overlap scheduler:
        the previous forward's, whose step has not run)."""
        latest = self.latest.get(req_id)
        return 0 if latest is None else self.staged[req_id][1] - latest

    # ---- leaving -------------------------------------------------------------------------------
    def take(self, req_ids: list[int]) -> tuple[tuple[list[int], ...], tuple[int, ...]]:
        """The batch's blocks and tokens that join the layouts this step (request i: ``blocks[i]``,
        ``num_new[i]``): what ``reserve`` staged, after a cached prefix the first time (it joins
        as written tokens); none for a request whose tokens an earlier step took in (a step that
        only observes a forward's mass). Forgets them here."""
        if self.latest:
            for req_id in req_ids:
                self.latest.pop(req_id, None)
        if not self.prefix:
            return tuple(zip(*(self.staged.pop(r, NOTHING) for r in req_ids)))  # type: ignore[return-value]
        return tuple(zip(*map(self._take_one, req_ids)))  # type: ignore[return-value]

    def drop(self, req_id: int) -> list[int]:
        """Forgets the request; returns the blocks it still had here (prefix, then reserved)."""
        fresh = self.staged.pop(req_id, NOTHING)[0]
        self.latest.pop(req_id, None)
        return self.prefix.pop(req_id, NOTHING)[0] + fresh

    def num_blocks(self) -> tuple[int, int]:
        """(blocks of cached prefixes, blocks reserved) held here, for the pool's reference count."""
        return (sum(len(blocks) for blocks, _ in self.prefix.values()),
                sum(len(fresh) for fresh, _ in self.staged.values()))

    def _take_one(self, req_id: int) -> tuple[list[int], int]:
        fresh, num_new = self.staged.pop(req_id, NOTHING)
        cached_blocks, cached = self.prefix.pop(req_id, NOTHING)
        return cached_blocks + fresh, cached + num_new
