# SPDX-License-Identifier: Apache-2.0
"""The reference KV-cache manager's prefix-caching calls (``KVCacheManager``): keying the blocks a
forward writes (a prompt's first forward, its later chunks, decode tokens) and the attention mass
a prefill observes over a cached prefix. Each does nothing with prefix caching off
(``runtime/prefix_caching.py`` has the rules)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from trtllm_vtoken.runtime.batch_invariance import fold_blocks


class KVPrefixCalls:
    """Prefix-caching calls of ``KVCacheManager`` (a mixin: it reads the manager's ``prefix``,
    ``step`` or ``lists``, ``layout`` and ``writes``)."""

    def store_written(self, req_ids: list[int], token_ids: Callable[[int], list[int]]) -> None:
        """Prefix caching, after ``step_batch``: keys the blocks the step's tokens filled (decode
        tokens; up to each request's cut). ``token_ids(req)``: the request's tokens, its written
        ones first (asked for only when a block filled)."""
        if self.prefix is None:
            return
        written = self.step.counters(req_ids)[0] if self.step is not None else map(self.lists.kv_len, req_ids)
        # A step may take several tokens (drafts, a lagging first step): every block filled counts.
        for req_id, n in self.prefix.cache.due(req_ids, written):
            self.prefix.store(req_id, self.layout.block_ids(req_id), token_ids(req_id)[:n])

    def store_chunk(self, req_id: int, token_ids: list[int]) -> None:
        """After ``reserve`` for a later chunk of the request's prompt: keys the full blocks of
        ``token_ids`` (the prompt up to the chunk's end) that its forward writes this iteration."""
        if self.prefix is not None:
            self.prefix.store_chunk(req_id, self.writes.staged_blocks(req_id)[0], token_ids)

    def store_prompt(self, req_id: int, token_ids: list[int]) -> None:
        """After ``reserve`` for the prefill: keys the full blocks of ``token_ids``, what its first
        forward writes (this iteration's, which runs before any later request's forward reads them)."""
        if self.prefix is not None:
            self.prefix.store_prompt(req_id, self.writes.staged_blocks(req_id)[0], token_ids)

    def mass_cuts(self, req_id: int) -> list[int]:
        """Query counts at which the request's prefill forward cuts its attention mass."""
        return self.prefix.mass_cuts(req_id) if self.prefix is not None else []

    def prefill_mass(self, req_id: int, mass: torch.Tensor, cut_mass: torch.Tensor | None) -> torch.Tensor:
        """What the request's policy observes for its prefill (before ``step_batch``): ``mass``
        plus its cached prefix's."""
        if self.prefix is None:
            return mass
        return self.prefix.prefill_mass(req_id, self.writes.staged_blocks(req_id)[0], mass, cut_mass)

    def prefill_mass_blocks(self, req_id: int, every: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        """``prefill_mass`` of a batch-invariant prefill, whose mass comes per block of its
        positions ([blocks, L]: every query's, and the ones its policy observes): folded in block
        order onto its cached prefix's (``fold_blocks``)."""
        if self.prefix is None:
            return fold_blocks(torch.zeros_like(observed[0]), observed)[-1]
        return self.prefix.prefill_mass_blocks(req_id, self.writes.staged_blocks(req_id)[0], every, observed)
