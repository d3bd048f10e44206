# SPDX-License-Identifier: Apache-2.0
"""vToken's per-step work inside TensorRT-LLM's KV-cache manager, independent of its classes.

TensorRT-LLM's C++ manager owns the blocks; vToken keeps, per request, the token table over that
block list and drives the same planner, copy executor and invariant checks as the reference
runtime. Per iteration (overlap scheduler off, so N's update runs before N+1's prepare):

    after_forward(N)      the policy marks dead tokens (attention mass from the recorded queries)
    compact(N+1)          a dense plan per request -> one copy of all their moves on the side
                          stream (after forward N) -> commit in the table -> release(req, n):
                          TensorRT-LLM's rewind_kv_cache returns the tail blocks to its free list
    ... super().prepare_resources: add_sequence / add_token on the physical length ...
    sync(N+1)             the table learns the new token (or the prompt) and its block list
    num_evicted(req)      logical - physical tokens: subtracted from num_cached_tokens_per_seq
                          by the attention metadata, while position ids stay logical (RoPE rule)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trtllm_vtoken.core import TokenTable
from trtllm_vtoken.integration.trtllm.settings import VTokenSettings
from trtllm_vtoken.policies import EvictionPolicy, policy_view
from trtllm_vtoken.reclaim import ReclaimBackend, ReclaimConfig
from trtllm_vtoken.reclaim.copy import TorchCopyExecutor

CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 1
"""TensorRT-LLM's id for the padding rows of a captured batch: always treated as empty."""


class ExternalBlocks:
    """The block-pool side of ``ReclaimBackend`` when another allocator owns the blocks: blocks a
    commit frees are collected, per request, for the owner to release (``rewind_kv_cache``)."""

    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self.freed: list[int] = []

    def is_shared(self, block_id: int) -> bool:
        return False  # block reuse is off (checked at start)

    def free(self, block_ids) -> None:
        self.freed.extend(block_ids)

    def check_integrity(self) -> None:
        """The owner's allocator checks itself."""


@dataclass
class VTokenStats:
    """What the policy did; relocations and freed blocks are counted in ``backend.stats``."""

    tokens_evicted: int = 0


class VTokenState:
    """Token tables, policy and reclamation for one TensorRT-LLM KV-cache manager.

    Args:
        pools: the manager's primary pools as 6-D HND views (``manager_pools``); None: metadata only.
        attention_mass: (request id, kv_len, block ids) -> mass per position, for policies that
            observe attention; None if the policy needs none.
    """

    def __init__(self, settings: VTokenSettings, tokens_per_block: int,
                 pools: Sequence[torch.Tensor] | None = None,
                 attention_mass: Callable[[int, int, list[int]], torch.Tensor] | None = None) -> None:
        self.settings = settings
        self.blocks = ExternalBlocks(tokens_per_block)
        self.table = TokenTable(tokens_per_block, self.blocks.is_shared)
        self.policy: EvictionPolicy = settings.make_policy()
        self.needs_attention = self.policy_observes_attention(self.policy)
        if self.needs_attention and attention_mass is None:
            raise ValueError(f"policy {settings.policy!r} observes attention: pass attention_mass")
        self.attention_mass = attention_mass
        executor = TorchCopyExecutor(pools) if pools else None
        config = ReclaimConfig(settings.mode, settings.fragmentation_threshold, settings.check_invariants)
        self.backend = ReclaimBackend(self.table, self.blocks, executor, config)
        self.stats = VTokenStats()

    @staticmethod
    def policy_observes_attention(policy: EvictionPolicy) -> bool:
        """Does the policy score tokens by the attention they receive (H2O, Scissorhands)?"""
        return type(policy).observe is not EvictionPolicy.observe

    # ---- before the forward ------------------------------------------------------------------------
    def compact(self, req_ids: Sequence[int], release: Callable[[int, int], None], stream: Any = None) -> int:
        """Relocates each request's live tokens into a dense prefix and releases its tail: calls
        ``release(req_id, num_tokens)`` with the physical tokens to drop. Returns blocks freed.

        Every request's moves go in one copy (one kernel launch on CUDA), as in the engine."""
        table = self.table
        live = [r for r in req_ids if r != CUDA_GRAPH_DUMMY_REQUEST_ID and r in table]
        before = {r: (table.kv_len(r), table.num_blocks(r)) for r in live}
        self.blocks.freed.clear()
        freed = self.backend.reclaim(live, stream=stream)
        for req_id, (kv_len, _) in before.items():
            dropped = kv_len - table.kv_len(req_id)
            if dropped:
                release(req_id, dropped)
        assert len(self.blocks.freed) == freed == sum(n - table.num_blocks(r) for r, (_, n) in before.items())
        return freed

    def sync(self, req_id: int, block_ids: Sequence[int], physical_len: int) -> None:
        """After the owner allocated: the request's block list and physical length (prompt or
        one more token). A new request joins the table."""
        if req_id == CUDA_GRAPH_DUMMY_REQUEST_ID:
            return
        if req_id not in self.table:
            self.table.add_request(req_id)
        self.table.sync_new_tokens(req_id, list(block_ids), physical_len)

    def num_evicted(self, req_id: int) -> int:
        """Logical minus physical tokens: what attention metadata subtracts from the cached count."""
        if req_id not in self.table:
            return 0
        return self.table.num_tokens(req_id) - self.table.kv_len(req_id)

    def prompt_tokens_held(self, req_id: int, prompt_len: int) -> int:
        """Prompt tokens (logical ids below ``prompt_len``) still in the physical KV ``[0, kv_len)``:
        the context length the attention op may be told, never more than the physical length."""
        if req_id not in self.table:
            return prompt_len
        seq = self.table.seq(req_id)
        positions = np.arange(seq.kv_len)
        tokens = seq.token_at[: seq.kv_len]
        return int(np.count_nonzero(seq.live_at(positions) & (tokens < prompt_len)))

    # ---- after the forward ---------------------------------------------------------------------
    def after_forward(self, req_ids: Sequence[int]) -> int:
        """The policy's decisions for the requests that just decoded; returns tokens evicted."""
        evicted = 0
        for req_id in req_ids:
            if req_id == CUDA_GRAPH_DUMMY_REQUEST_ID or req_id not in self.table:
                continue
            seq = self.table.seq(req_id)
            if self.needs_attention:
                mass = self.attention_mass(req_id, seq.kv_len, list(seq.block_ids))
                tokens = seq.token_at[: seq.kv_len]
                self.policy.observe(req_id, tokens.astype("int64"), mass.float().cpu().numpy())
            doomed = self.policy.select(policy_view(self.table, req_id)).tolist()
            if doomed:
                self.table.evict_tokens(req_id, doomed)
                evicted += len(doomed)
        self.stats.tokens_evicted += evicted
        return evicted

    def forget(self, req_id: int) -> None:
        if req_id in self.table:
            self.table.remove_request(req_id)
        self.policy.forget(req_id)

    def final_live_tokens(self, total_tokens: int) -> int:
        """Live tokens a request of ``total_tokens`` keeps at most: for budget-aware admission."""
        return self.policy.budget.target(total_tokens)
