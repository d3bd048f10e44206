# SPDX-License-Identifier: Apache-2.0
"""Automatic prefix caching over a ``BlockPool``, with the rules token eviction needs.

Full blocks are keyed by their content (``block_key``). A request whose prompt starts with a
cached chain of keys takes a reference on those blocks and prefills only the rest. A block whose
last request has left stays cached, least recently used first out, until the pool needs it.

Every keyed block carries one pool reference of the cache's own, so the pool's accounting stays
"free iff no reference". A block is, by its references:

    state      requests holding it   key   pool refs   vToken may
    free       0                     no    0           allocate it
    private    1                     no    1           evict tokens, move into / out of it
    private    1                     yes   2           evict tokens (this drops the key first)
    shared     >= 2                  yes*  >= 3        nothing: its tokens are protected
    cached     0                     yes   1           nothing (no request holds it); reuse or
                                                       reclaim it (LRU)
    (* a block gets shared only through its key, and its tokens cannot be evicted; it loses the
       key while shared only when a holder cuts its chain before it (``cut``): it stays with its
       holders, protected, and no later request takes it)

Eviction and caching meet in one rule, applied per request before its policy's victims die:
a request's cached chain ends at the block of its lowest evicted token (``cut``). Keys on that
block and every later one are dropped, since compaction may now write into them, and no key is
ever stored there again for this request. Blocks before the cut hold only live, never moved
tokens, so no relocation plan (dense or lazy) ever reads or writes a keyed block; shared blocks
are protected, so no plan touches them either. The rule depends only on the policy's decisions,
never on how a variant reclaims, so naive-evict and vToken cache exactly the same blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from trtllm_vtoken.core.block_key import ROOT_KEY, chain_key
from trtllm_vtoken.core.block_pool import BlockPool


@dataclass
class PrefixCacheStats:
    query_tokens: int = 0
    """Prompt tokens of requests that looked the cache up."""
    hit_tokens: int = 0
    """Of those, tokens found cached (not prefilled)."""
    stored_blocks: int = 0
    dropped_keys: int = 0
    """Keys dropped because a request evicted at or before their block (``cut``)."""
    reclaimed_blocks: int = 0
    """Cached blocks no request held, taken back for new allocations (LRU)."""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass
class _Chain:
    """What the cache knows of one request: its blocks' keys and where they stop."""

    keys: list[int] = field(default_factory=list)
    """Key of each full block of the request, in order (stored or not: a duplicate of a block
    cached elsewhere is not stored, but its key is still the next block's parent)."""
    limit: int | None = None
    """First block that may never be stored (the cut); None while nothing was evicted."""
    cached_tokens: int = 0
    """Tokens the request found cached when it began."""


class PrefixCache:
    """Content-keyed sharing and LRU retention of full blocks of one ``BlockPool``."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.tokens_per_block = pool.tokens_per_block
        self.key_of: dict[int, int] = {}
        self.block_of: dict[int, int] = {}
        self.unheld: OrderedDict[int, None] = OrderedDict()
        """Cached blocks no request holds, least recently released first."""
        self.shared: set[int] = set()
        """Blocks several requests hold: their tokens are protected (kept up to date here so a
        step can read the set without scanning the pool)."""
        self.payload: dict[int, object] = {}
        """Host data stored with a key, by block (e.g. the prefix's prefill attention mass);
        dropped with the key."""
        self.stats = PrefixCacheStats()
        self._chains: dict[int, _Chain] = {}

    # ---- queries ------------------------------------------------------------------------------
    def holders(self, block_id: int) -> int:
        """How many requests hold the block (its references minus the cache's own)."""
        return self.pool.ref_counts[block_id] - (block_id in self.key_of)

    def is_shared(self, block_id: int) -> bool:
        """Held by several requests: its tokens may be neither evicted nor moved."""
        return self.pool.ref_counts[block_id] - (block_id in self.key_of) > 1

    def is_cached(self, block_id: int) -> bool:
        """Holds a key: its KV is that of a fresh prefill of the key's tokens."""
        return block_id in self.key_of

    @property
    def num_reclaimable(self) -> int:
        """Cached blocks no request holds: free-able on demand."""
        return len(self.unheld)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus cached ones no request holds."""
        return self.pool.num_free + len(self.unheld)

    def match(self, token_ids: Sequence[int] | np.ndarray, busy: Collection[int] = (),
              computed_tail: int = 1) -> list[int]:
        """Blocks holding the longest cached chain of ``token_ids``' full blocks.

        At least the last ``computed_tail`` tokens are left out (the last token's logits are
        needed; a policy that observes a prompt's last queries needs them run). The chain stops
        before a block in ``busy`` (e.g. one an in-flight relocation touches: it must not get
        shared before that commits).
        """
        if isinstance(computed_tail, bool) or not isinstance(computed_tail, int) or computed_tail < 1:
            raise ValueError(f"computed_tail must be a positive int, got {computed_tail!r}")
        tpb, blocks, key = self.tokens_per_block, [], ROOT_KEY
        for i in range(max(0, len(token_ids) - computed_tail) // tpb):
            key = chain_key(key, token_ids[i * tpb : (i + 1) * tpb])
            block_id = self.block_of.get(key)
            if block_id is None or block_id in busy:
                break
            blocks.append(block_id)
        return blocks

    def attach(self, block_id: int, value: object) -> None:
        """Stores host data with a cached block's key (dropped with it). ValueError if the
        block holds no key."""
        if block_id not in self.key_of:
            raise ValueError(f"block {block_id} holds no key to attach data to")
        self.payload[block_id] = value

    def cached_tokens(self, req_id: int) -> int:
        """Tokens of the request's prompt found cached when it began."""
        return self._chain(req_id).cached_tokens

    # ---- requests -----------------------------------------------------------------------------
    def begin(self, req_id: int, token_ids: Sequence[int] | np.ndarray, busy: Collection[int] = (),
              computed_tail: int = 1) -> list[int]:
        """Starts a request: takes a reference on the blocks of its longest cached prefix (not
        reaching a block in ``busy``, leaving ``computed_tail`` tokens out, see ``match``).

        Returns those blocks: the start of the request's block list, holding its first
        ``len(blocks) * tokens_per_block`` tokens. Raises ValueError if the request is known.
        """
        if req_id in self._chains:
            raise ValueError(f"request {req_id} already began in the prefix cache")
        blocks = self.match(token_ids, busy, computed_tail)
        for block_id in blocks:
            self.unheld.pop(block_id, None)
        self.pool.share(blocks)
        self.shared.update(b for b in blocks if self.is_shared(b))
        cached = len(blocks) * self.tokens_per_block
        chain = _Chain(keys=[self.key_of[b] for b in blocks], cached_tokens=cached)
        self._chains[req_id] = chain
        self.stats.query_tokens += len(token_ids)
        self.stats.hit_tokens += chain.cached_tokens
        return blocks

    def extend(self, req_id: int, block_ids: Sequence[int],
               token_ids: Sequence[int] | np.ndarray) -> list[int]:
        """Keys the request's blocks that ``token_ids`` fill, up to its cut. Returns the indices
        (in ``block_ids``) of the blocks stored now.

        Args:
            block_ids: The request's block list; block i holds tokens [i*B, (i+1)*B) unmoved
                for every block before the cut (the caller calls ``cut`` before any change).
            token_ids: The request's tokens so far (prompt, then generated), whose KV is or is
                being written in those blocks.
        """
        chain, tpb = self._chain(req_id), self.tokens_per_block
        stop = min(len(token_ids) // tpb, len(block_ids))
        if chain.limit is not None:
            stop = min(stop, chain.limit)
        stored = []
        for i in range(len(chain.keys), stop):
            parent = chain.keys[-1] if chain.keys else ROOT_KEY
            key = chain_key(parent, token_ids[i * tpb : (i + 1) * tpb])
            chain.keys.append(key)
            block_id = block_ids[i]
            if key in self.block_of or block_id in self.key_of or self.pool.ref_counts[block_id] != 1:
                continue  # the same content is cached in another block; this copy stays private
            self.key_of[block_id] = key
            self.block_of[key] = block_id
            self.pool.share([block_id])
            stored.append(i)
        self.stats.stored_blocks += len(stored)
        return stored

    def due(self, req_ids: Iterable[int], num_tokens: Iterable[int]) -> list[tuple[int, int]]:
        """(request, count) of the requests whose first ``count`` tokens fill a block ``extend``
        would key: a full one beyond the chain's keys, before its cut. One pass for a step's rows;
        KeyError names an unknown request."""
        chains, tpb, found = self._chains, self.tokens_per_block, []
        for req_id, n in zip(req_ids, num_tokens):
            chain = chains[req_id]
            stop = n // tpb
            if chain.limit is not None and chain.limit < stop:
                stop = chain.limit
            if stop > len(chain.keys):
                found.append((req_id, n))
        return found

    def cut(self, req_id: int, block_ids: Sequence[int], first_token_id: int) -> int:
        """The request is about to evict token ``first_token_id`` (its lowest victim): its chain
        ends at that token's block. Drops the keys there and after; returns how many. A later
        block may be shared while that one is not (the request computed a block cached elsewhere
        again, and another request took its next one): it loses its key too, its holders keep it
        (its tokens stay protected while it is shared), and no later request takes it.

        Raises ValueError, changing nothing, if the victim's block is shared (its tokens are
        protected: the caller's policy must not have chosen them).
        """
        chain, tpb = self._chain(req_id), self.tokens_per_block
        if first_token_id < 0:
            raise ValueError(f"request {req_id}: token id {first_token_id} is negative")
        start = first_token_id // tpb
        if chain.limit is not None and start >= chain.limit:
            return 0
        affected = list(block_ids[start : len(chain.keys)])
        if affected and self.is_shared(affected[0]):
            shared = [b for b in affected if self.is_shared(b)]
            raise ValueError(f"request {req_id}: blocks {shared} are shared; their tokens are protected")
        dropped = [b for i, b in enumerate(affected, start) if self.key_of.get(b) == chain.keys[i]]
        self._drop_keys(dropped)
        del chain.keys[start:]
        chain.limit = start
        self.stats.dropped_keys += len(dropped)
        return len(dropped)

    def end(self, req_id: int, block_ids: Sequence[int]) -> None:
        """The request leaves: drops its reference on each of its blocks. Keyed blocks no other
        request holds stay cached; the tail ones are first to be reclaimed."""
        self._chain(req_id)
        self.release(block_ids)
        del self._chains[req_id]

    # ---- blocks -------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """Takes ``n`` blocks (one reference each), reclaiming unheld cached blocks, least
        recently released first, when the free list is short. None, changing nothing, if even
        that does not give ``n``."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_available:
            return None
        short = n - self.pool.num_free
        if short > 0:
            self.reclaim(short)
        return self.pool.allocate(n)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drops one request reference from each block (the list's tail is released first)."""
        blocks = list(block_ids)
        drops: dict[int, int] = {}
        for block_id in blocks:
            drops[block_id] = drops.get(block_id, 0) + 1
            if not 0 <= block_id < self.pool.num_blocks or drops[block_id] > self.holders(block_id):
                raise ValueError(f"block {block_id} released more times than requests hold it")
        self.pool.free(blocks)
        for block_id in reversed(blocks):
            if block_id in self.key_of and self.pool.ref_counts[block_id] == 1:
                self.unheld[block_id] = None
            if block_id in self.shared and not self.is_shared(block_id):
                self.shared.discard(block_id)

    def reclaim(self, n: int) -> int:
        """Frees up to ``n`` unheld cached blocks, least recently released first; returns how many."""
        count = min(n, len(self.unheld))
        victims = [self.unheld.popitem(last=False)[0] for _ in range(count)]
        self._drop_keys(victims)
        self.stats.reclaimed_blocks += count
        return count

    def clear(self) -> int:
        """Frees every unheld cached block (a reset); returns how many."""
        return self.reclaim(len(self.unheld))

    # ---- integrity ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raises RuntimeError if keys, references and the LRU disagree."""
        if len(self.key_of) != len(self.block_of) or any(
            self.block_of.get(k) != b for b, k in self.key_of.items()
        ):
            raise RuntimeError("prefix cache: key_of and block_of are not inverse maps")
        for block_id in self.key_of:
            if self.pool.ref_counts[block_id] < 1:
                raise RuntimeError(f"prefix cache: cached block {block_id} has no reference")
        unheld = {b for b in self.key_of if self.pool.ref_counts[b] == 1}
        shared = {b for b in range(self.pool.num_blocks) if self.pool.ref_counts[b] and self.is_shared(b)}
        if shared != self.shared:
            raise RuntimeError(f"prefix cache: shared set {sorted(self.shared)} != {sorted(shared)}")
        if not set(self.payload) <= set(self.key_of):
            raise RuntimeError("prefix cache: a payload outlived its key")
        if unheld != set(self.unheld):
            raise RuntimeError(
                f"prefix cache: LRU {sorted(self.unheld)} != unheld cached blocks {sorted(unheld)}"
            )

    # ---- private ------------------------------------------------------------------------------
    def _chain(self, req_id: int) -> _Chain:
        try:
            return self._chains[req_id]
        except KeyError:
            raise KeyError(f"request {req_id} is not in the prefix cache") from None

    def _drop_keys(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            del self.block_of[self.key_of.pop(block_id)]
            self.unheld.pop(block_id, None)
            self.payload.pop(block_id, None)
        self.pool.free(block_ids)
