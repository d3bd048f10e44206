# SPDX-License-Identifier: Apache-2.0
"""The reference engine's automatic prefix caching (``EngineConfig.prefix_caching``).

A request's prompt is looked up in ``core.PrefixCache`` at admission: the blocks of its longest
cached prefix join its block list as they are, and only the rest is prefilled. The full blocks
a prefill forward writes (the prompt, or with chunked prefill each chunk) are stored when it is
scheduled, before it runs, so that a request admitted after it in the same iteration shares them
(the forwards of prompts being prefilled run first, then the admissions' in order, a writer
before its readers); decode blocks are stored as they fill. A request's lowest eviction cuts its chain
(``PrefixCache.cut``, which the one step runs between its decision and its token table): the
blocks there and after lose their keys before any compaction, and none after them is stored.

Chunked prefill: a request that may evict decides after each chunk, the first at its first
chunk's end. The cached prefix it takes ends before that (``decides_at``): it computes the rest
of its first chunk and decides there on what a prefill of that chunk gives, as alone. A longer
prefix would skip that decision, and the KV of later chunks depends on it.

Attention mass over a cached prefix (H2O, Scissorhands): a request that reuses n cached blocks
does not run the queries of those n * B tokens, so the attention those tokens paid each other is
missing from what its policy observes at prefill. That mass depends on the prefix's tokens alone
(causal attention), so the request that computed the blocks keeps it with them: the payload of
block j is the mass the prompt's first (j + 1) * B queries gave to keys [0, (j + 1) * B)
(``paged_attention``'s ``mass_cuts``). A request reusing n blocks adds block n - 1's payload to
its first prefill forward's mass: its policy then observes what a fresh prefill of its prompt (or
first chunk) gives (equal up to float rounding). Blocks stored while no policy of the engine observed attention carry no
payload, nor do blocks a decode filled: a request whose policy adds the payload takes none of
them (``unpaid``) and prefills those tokens itself.

Private requests (``EngineConfig.prefix_reuse="copy"``, every request that may evict): such a
request copies its cached prefix into blocks of its own at admission (``begin``) and nobody
shares its blocks while it runs, so no token of its is ever protected and its decisions are those
of a run without caching, whatever else runs. Two rules keep it so: a private request takes only
blocks whose prefill has run (``busy_for``: not those keyed in this iteration's admissions, which
its copy would read before they are written), and a request that shares takes no block a
running private request keyed (it prefills those tokens itself).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np
import torch

from trtllm_vtoken.core.block_pool import BlockPool
from trtllm_vtoken.core.prefix_cache import PrefixCache
from trtllm_vtoken.runtime.batch_invariance import fold_blocks


class PrefixCaching:
    """Prefix cache, per-request prefill bookkeeping and prefix attention mass of one engine."""

    def __init__(self, pool: BlockPool) -> None:
        self.cache = PrefixCache(pool)
        self.tokens_per_block = pool.tokens_per_block
        self._cached: dict[int, int] = {}
        self._paying: dict[int, list[tuple[int, int, object]]] = {}  # request -> (prompt block index,
        # cached block, its key) whose payload its prefill attaches: the blocks it stored, and those
        # cached without one
        self._private: set[int] = set()  # private requests
        self._taken: dict[int, np.ndarray] = {}  # request -> its cached prefix's payload at admission (if any)
        self._owner: dict[int, int] = {}  # block keyed by a running private request -> that request
        self._unwritten: set[int] = set()  # prompt blocks keyed in this iteration's admissions
        self._payload_due: set[int] = set()  # of them, those whose prefill will attach a payload
        self._windowed: dict[int, bool] = {}  # request -> its policy observes its prompt's last queries only

    # ---- admission -----------------------------------------------------------------------------
    def probe(self, token_ids: Sequence[int], busy: Collection[int] = (), prefill_window: int | None = None,
              needs_payload: bool = False, decides_at: int | None = None) -> tuple[int, int]:
        """(blocks of the longest cached prefix, how many of them no request holds now); the
        prefix stops before a block in ``busy`` (relocations in flight), for a policy that
        observes the prompt's last ``prefill_window`` queries leaves those tokens to the prefill,
        with ``needs_payload`` (a policy observing every prefill query's attention) stops
        before a block stored without the mass its prefix paid (``unpaid``), and ends before
        token ``decides_at`` (the end of the first chunk, after which the request decides)."""
        blocks = self.cache.match(token_ids, self.unpaid(busy) if needs_payload else busy,
                                  computed_tail(len(token_ids), prefill_window, decides_at))
        return len(blocks), sum(1 for b in blocks if b in self.cache.unheld)

    def unpaid(self, busy: Collection[int] = ()) -> set[int]:
        """``busy`` and every cached block without an attention payload, now or from this
        iteration's prefills: a decode block (``store``), or one stored while no policy observed
        attention. A request that adds the prefix's payload to its own mass takes none of them,
        else it would observe its own queries' mass only and decide unlike a prefill of its
        whole prompt."""
        paid = self.cache.payload.keys() | self._payload_due
        return set(busy) | {b for b in self.cache.key_of if b not in paid}

    def new_iteration(self) -> None:
        """Before an iteration's admissions: the prompt blocks keyed so far have been written."""
        self._unwritten.clear()
        self._payload_due.clear()

    def busy_for(self, private: bool) -> set[int]:
        """Blocks a request must not take from the cache: a private one's copy would read this
        iteration's unwritten prompt blocks; a sharing one would share a private request's."""
        # A private request also keeps the payload its prefix had at admission (``begin``): one
        # that a prefill of this iteration is still to attach would not be there yet.
        return self._unwritten | self._payload_due if private else set(self._owner)

    def begin(self, req_id: int, token_ids: Sequence[int], busy: Collection[int] = (),
              copy: Callable[[list[int], list[int]], None] | None = None,
              prefill_window: int | None = None, needs_payload: bool = False,
              take_prefix: bool = True, decides_at: int | None = None) -> list[int]:
        """The request takes its cached prefix (``probe``'s; none without ``take_prefix``: it
        prefills its whole prompt); returns the blocks that start its list. With ``copy`` it is a
        private request: fresh blocks of its own are allocated and ``copy(source, destination)``
        fills them with the cached blocks' KV; its references on the cached blocks are dropped
        (they stay cached). RuntimeError if the pool lacks the copies' blocks (admission counted
        them: that would be a bookkeeping error)."""
        tail = computed_tail(len(token_ids), prefill_window, decides_at) if take_prefix else max(1, len(token_ids))
        blocks = self.cache.begin(req_id, token_ids, self.unpaid(busy) if needs_payload else busy, tail)
        self._cached[req_id] = len(blocks) * self.tokens_per_block
        self._windowed[req_id] = prefill_window is not None
        # The prefix's attention payload is kept now: a copy carries no key, and a block shared
        # loses its key (and payload) when another holder cuts its chain before it. A sharer's
        # payload that a prefill of this iteration attaches later is read from the block then.
        payload = self.cache.payload.get(blocks[-1]) if blocks else None
        if payload is not None:
            self._taken[req_id] = payload
        if copy is None:
            return blocks
        self._private.add(req_id)
        if not blocks:
            return blocks
        own = self.cache.allocate(len(blocks))
        if own is None:
            raise RuntimeError(f"request {req_id}: no {len(blocks)} blocks for its cached prefix's copy, "
                               f"though admission counted them")
        copy(blocks, own)
        self.cache.release(blocks)
        return own

    def cached_tokens(self, req_id: int) -> int:
        """Prompt tokens the request found cached (not prefilled) at its latest admission."""
        return self._cached[req_id]

    def store_prompt(self, req_id: int, block_ids: Sequence[int], token_ids: Sequence[int]) -> None:
        """Keys the full blocks of ``token_ids``, what the request's first prefill forward writes
        (its prompt, or its first chunk) after its cached prefix, before anyone reads them."""
        stored = self.store_chunk(req_id, block_ids, token_ids)
        # Its prefill computes the mass its prompt's queries pay each block's prefix, a function of
        # the tokens alone: the payload of the blocks it stored, and of those holding the same
        # tokens cached without one (a decode filled them, or no policy observed attention then).
        cached = self._cached[req_id] // self.tokens_per_block
        holding = {j: block_ids[j] for j in stored}
        for j, block_id in enumerate(self.cache.match(token_ids)):  # the cached chain of its tokens
            if j >= cached and j not in holding and block_id not in self.cache.payload:
                holding[j] = block_id
        self._paying[req_id] = paying = [(j, holding[j], self.cache.key_of[holding[j]]) for j in sorted(holding)]
        # It attaches them if its own cached prefix has one: an observing request admitted after it
        # in this iteration may take them.
        if req_id in self._private:
            due = req_id in self._taken or not cached
        else:
            due = not cached or block_ids[cached - 1] in self.cache.payload.keys() | self._payload_due
        (self._payload_due.update if due else self._payload_due.difference_update)(b for _, b, _ in paying)

    def store_chunk(self, req_id: int, block_ids: Sequence[int], token_ids: Sequence[int]) -> list[int]:
        """Keys the full blocks of ``token_ids`` that a later chunk's forward, this iteration,
        writes (up to the request's cut: its earlier decisions), before anyone reads them. They
        carry no attention payload (what their tokens paid the earlier chunks is not kept).
        Returns the indices of the blocks stored."""
        stored = self.cache.extend(req_id, block_ids, token_ids)
        self._unwritten.update(block_ids[i] for i in stored)
        self._own(req_id, block_ids, stored)
        return stored

    def store(self, req_id: int, block_ids: Sequence[int], token_ids: Sequence[int]) -> None:
        """Keys blocks a decode step filled (``token_ids``: the tokens whose KV is written)."""
        self._own(req_id, block_ids, self.cache.extend(req_id, block_ids, token_ids))

    def _own(self, req_id: int, block_ids: Sequence[int], stored: list[int]) -> None:
        if req_id in self._private:
            self._owner.update((block_ids[i], req_id) for i in stored)

    def cut(self, req_id: int, block_ids: Sequence[int], victims: Sequence[int]) -> None:
        """Before the request evicts ``victims``: its chain ends at the lowest one's block."""
        if len(victims):
            self.cache.cut(req_id, block_ids, int(min(victims)))

    def cut_batch(self, req_ids: np.ndarray, offsets: np.ndarray, victims: np.ndarray,
                  block_ids: Callable[[int], Sequence[int]]) -> None:
        """``cut`` for a step's victims (request i's: ``victims[offsets[i]:offsets[i + 1]]``),
        each request's block list as the step's decision saw it (``DecodeStep.on_victims``: after
        the decision, before the step completes and any block it changed can be shared)."""
        for i in np.flatnonzero(np.diff(offsets)).tolist():
            req_id = int(req_ids[i])
            self.cut(req_id, block_ids(req_id), victims[offsets[i] : offsets[i + 1]])

    def end(self, req_id: int, block_ids: Sequence[int]) -> None:
        """The request leaves (finished, cancelled or preempted): its blocks stay cached if keyed."""
        self.cache.end(req_id, block_ids)
        self._cached.pop(req_id, None)
        self._paying.pop(req_id, None)
        self._windowed.pop(req_id, None)
        self._taken.pop(req_id, None)
        if req_id in self._private:
            self._private.discard(req_id)
            self._owner = {b: r for b, r in self._owner.items() if r != req_id}

    def allocate(self, n: int) -> list[int] | None:
        return self.cache.allocate(n)

    # ---- attention mass over a cached prefix ---------------------------------------------------
    def mass_cuts(self, req_id: int) -> list[int]:
        """Query counts of the request's first prefill forward at which to cut its attention
        mass: the end of each prompt block whose payload it attaches (``store_prompt``)."""
        cached, tpb = self._cached[req_id], self.tokens_per_block
        return [(j + 1) * tpb - cached for j, _, _ in self._paying.get(req_id, ())]

    def prefill_mass(self, req_id: int, block_ids: Sequence[int], mass: torch.Tensor,
                     cut_mass: torch.Tensor | None) -> torch.Tensor:
        """The mass the request's policy observes for its first prefill forward: its own queries'
        ``mass`` plus the cached prefix's payload; keeps the payload of the cached blocks of its
        prompt that lack one (``cut_mass``: the rows at ``mass_cuts``). Shapes: [L] and
        [len(mass_cuts), L]. A later chunk's forward observes its own queries' mass only."""
        prefix = self._prefix_mass(req_id, block_ids, mass)
        if prefix is None:  # stored without a payload: the request observes its own queries only
            return mass
        if cut_mass is not None:
            self._attach_payloads(req_id, lambda row, _: prefix + cut_mass[row])
        # A policy observing the prompt's last queries only (H2O's prefill_window) took no cached
        # prefix reaching them (``probe``): the prefix's own queries are not its to observe.
        return mass if self._windowed.get(req_id) else mass + prefix

    def prefill_mass_blocks(self, req_id: int, block_ids: Sequence[int], every: torch.Tensor,
                            observed: torch.Tensor) -> torch.Tensor:
        """``prefill_mass`` of a batch-invariant prefill (``runtime/batch_invariance.py``): its
        mass per block of its positions [blocks, L] (``every`` query's, and the ones its policy
        ``observed``) folded in block order onto the cached prefix's payload; the payloads it
        keeps are that fold's states at their block ends, so a later prompt folding onto one gets
        the bits a prefill of the whole prompt gets."""
        prefix = self._prefix_mass(req_id, block_ids, every[0])
        if prefix is not None:
            states = fold_blocks(prefix, every)
            first_block = self._cached[req_id] // self.tokens_per_block  # the block of the row's query 0
            self._attach_payloads(req_id, lambda _, j: states[j - first_block])
        if prefix is None or self._windowed.get(req_id):  # its own queries' mass only (as above)
            return fold_blocks(torch.zeros_like(every[0]), observed)[-1]
        return states[-1]

    def _prefix_mass(self, req_id: int, block_ids: Sequence[int], like: torch.Tensor) -> torch.Tensor | None:
        """[L] like ``like``: the request's cached prefix's payload, zeros past it (all zeros
        without a cached prefix); None where the prefix was stored without a payload."""
        cached, prefix = self._cached[req_id], torch.zeros_like(like)
        if cached:
            payload = self._taken.get(req_id)
            if payload is None and req_id not in self._private:  # attached by a prefill after its admission
                payload = self.cache.payload.get(block_ids[cached // self.tokens_per_block - 1])
            if payload is None:
                return None
            prefix[:cached] = torch.from_numpy(payload)
        return prefix

    def _attach_payloads(self, req_id: int, through: Callable[[int, int], torch.Tensor]) -> None:
        """Keeps with each prompt block the request pays for (``store_prompt``) that still holds
        its tokens and has no payload yet ``through(row, j)[:end]``: the mass the prompt's queries
        up to the end of block j (row ``row`` of ``mass_cuts``) paid each other."""
        for row, (j, block_id, key) in enumerate(self._paying.get(req_id, ())):
            # still holding those tokens (a cached block no request holds may have been reused)
            if self.cache.key_of.get(block_id) == key and block_id not in self.cache.payload:
                end = (j + 1) * self.tokens_per_block
                self.cache.attach(block_id, through(row, j)[:end].numpy().astype(np.float32))


def computed_tail(prompt_len: int, prefill_window: int | None, decides_at: int | None) -> int:
    """Prompt tokens a request leaves out of the cached prefix it takes (``PrefixCache.match``):
    its last token (its logits are needed), the last ``prefill_window`` (a policy observing them
    needs them run), and every token from ``decides_at - 1`` on (chunked prefill: the request
    computes part of the first chunk it decides after)."""
    tail = prefill_window or 1
    return tail if decides_at is None else max(tail, prompt_len - decides_at + 1)
