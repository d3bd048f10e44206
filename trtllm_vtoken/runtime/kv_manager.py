# SPDX-License-Identifier: Apache-2.0
"""The reference runtime's KV-cache manager: block pool, token table, KV pool, policy, reclamation
and admission for one engine, in the roles TensorRT-LLM's ``KVCacheManager`` plays.

Per step and request the engine calls, in this order:

    reserve(req, n)         blocks for n new tokens (None: the pool is dry -> preempt someone)
    set_batch(rows)         rewrite block_offsets / kv_lens in place (+ the validity mask)
    ... forward writes K/V into the reserved slots ...
    commit(req)             sync_new_tokens: the new tokens get logical ids
    next_position(req)      the RoPE position of the request's next token
    observe(req, mass)      attention received, for H2O / Scissorhands
    evict(req)              the policy marks tokens dead (naive-evict, vtoken)
    reclaim(reqs)           vtoken: relocate (one copy for all) + free tail blocks; naive-evict:
                            free fully dead blocks; "shift" positions: re-rotate the keys of
                            requests whose physical length shrank
    update(req, remaining)  admission learns what the request now holds
    release(req)            finished, cancelled or preempted: every block back to the pool
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from trtllm_vtoken.core import BlockPool, TokenTable
from trtllm_vtoken.policies import EvictionPolicy, policy_view
from trtllm_vtoken.reclaim import (
    AdmissionConfig,
    AdmissionController,
    ReclaimBackend,
    ReclaimConfig,
)
from trtllm_vtoken.reclaim.copy import AccountingCopyExecutor, TorchCopyExecutor
from trtllm_vtoken.reclaim.dead_blocks import release_dead_blocks
from trtllm_vtoken.reclaim.rerotate import KeyRerotation
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.kv_cache import PagedKVCache
from trtllm_vtoken.runtime.model import LlamaConfig


@dataclass
class KVStats:
    tokens_evicted: int = 0
    dead_blocks_released: int = 0
    """naive-evict: blocks freed because every token in them died."""
    peak_blocks_used: int = 0
    table_seconds: float = 0.0
    """Host time registering new tokens in the token table (``commit``)."""
    policy_seconds: float = 0.0
    """Host time in the policy: observing attention and choosing victims (``observe``, ``evict``)."""
    mask_seconds: float = 0.0
    """Host time building the validity mask (naive-evict, lazy mode)."""


@dataclass(frozen=True)
class KVUsage:
    blocks_used: int
    live_tokens: int
    slots_held: int

    @property
    def utilization(self) -> float:
        """Live tokens over slots in allocated blocks: the memory doing useful work."""
        return self.live_tokens / self.slots_held if self.slots_held else 0.0


class KVCacheManager:
    def __init__(self, config: EngineConfig, model_config: LlamaConfig,
                 simulated_bytes_per_token: int | None = None) -> None:
        """``simulated_bytes_per_token``: no KV tensors at all (the simulated-attention backend);
        relocations are planned and committed exactly and their bytes counted, nothing is copied."""
        self.config = config
        tpb = config.tokens_per_block
        self.pool = BlockPool(config.num_blocks, tpb)
        self.table = TokenTable(tpb, self.pool.is_shared)
        self.cache: PagedKVCache | None = None
        if simulated_bytes_per_token is None:
            self.cache = PagedKVCache(
                config.num_blocks, tpb, model_config.num_hidden_layers, model_config.num_key_value_heads,
                model_config.head_dim, config.max_batch_size, config.max_blocks_per_seq,
                dtype=getattr(torch, config.dtype), device=config.device,
            )
        self.policy: EvictionPolicy | None = None if config.variant == "native" else config.make_policy()
        self.needs_attention = (
            self.policy is not None and type(self.policy).observe is not EvictionPolicy.observe
        )
        self.backend: ReclaimBackend | None = None
        if config.variant == "vtoken":
            reclaim = ReclaimConfig(config.mode, config.fragmentation_threshold, config.check_invariants)
            executor = (TorchCopyExecutor([self.cache.pool], kernel=config.relocation_kernel)
                        if self.cache is not None
                        else AccountingCopyExecutor(simulated_bytes_per_token))
            self.backend = ReclaimBackend(self.table, self.pool, executor, reclaim)
        self.rerotation: KeyRerotation | None = None
        if config.positions == "shift" and self.cache is not None:
            self.rerotation = KeyRerotation([self.cache.pool], model_config.rope, kernel=config.relocation_kernel)
        self.admission = AdmissionController(self.pool, AdmissionConfig(
            config.variant, config.mode, config.fragmentation_threshold, config.evacuation_headroom))
        self.stats = KVStats()
        self._staged: dict[int, tuple[list[int], int]] = {}  # req -> (block list, kv_len after write)

    # ---- admission -----------------------------------------------------------------------------
    def final_budget(self, total_tokens: int) -> int | None:
        """Live tokens a request of ``total_tokens`` keeps at completion (None: no eviction)."""
        return None if self.policy is None else self.policy.budget.target(total_tokens)

    def check_fits_alone(self, prompt_len: int, max_tokens: int) -> None:
        """Raises ValueError if the request could not run even with the whole pool to itself."""
        cfg = self.config
        if prompt_len + max_tokens > cfg.max_seq_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"max_seq_len {cfg.max_seq_len}")
        usable = cfg.num_blocks - cfg.evacuation_headroom
        probe = AdmissionController(BlockPool(usable, cfg.tokens_per_block),
                                    AdmissionConfig(cfg.variant, cfg.mode, cfg.fragmentation_threshold))
        if not probe.can_admit(prompt_len, max_tokens, self.final_budget(prompt_len + max_tokens)):
            raise ValueError(f"request needs more KV blocks than the pool's {usable} usable blocks "
                             f"(prompt {prompt_len} + max_tokens {max_tokens} tokens, "
                             f"tokens_per_block {cfg.tokens_per_block})")

    def admit(self, req_id: int, prefill_len: int, remaining: int) -> bool:
        """Registers the request (its prefill writes ``prefill_len`` tokens) if admission allows."""
        cfg = self.config
        budget = self.final_budget(prefill_len + remaining)
        if cfg.admission == "greedy":
            if self.pool.num_free - cfg.evacuation_headroom < -(-prefill_len // cfg.tokens_per_block):
                return False
            self.admission.admit(req_id, prefill_len, remaining, budget, force=True)
        elif not self.admission.admit(req_id, prefill_len, remaining, budget):
            return False
        self.table.add_request(req_id)
        return True

    # ---- one step ------------------------------------------------------------------------------
    def reserve(self, req_id: int, num_new: int) -> list[int] | None:
        """Slots for ``num_new`` tokens after the request's KV, allocating blocks as needed.
        Returns the flat slots, or None (nothing changed) if the pool lacks the blocks."""
        seq, tpb = self.table.seq(req_id), self.config.tokens_per_block
        start, blocks = seq.kv_len, list(seq.block_ids)
        missing = -(-(start + num_new) // tpb) - len(blocks)
        if missing > 0:
            fresh = self.pool.allocate(missing)
            if fresh is None:
                return None
            blocks += fresh
        self._staged[req_id] = (blocks, start + num_new)
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, self.pool.num_used)
        return self.staged_slots(req_id)

    def staged_slots(self, req_id: int) -> list[int]:
        """The flat slots ``reserve`` handed out for the request's pending write."""
        blocks, total = self._staged[req_id]
        tpb, start = self.config.tokens_per_block, self.table.kv_len(req_id)
        return [blocks[p // tpb] * tpb + p % tpb for p in range(start, total)]

    def unreserve(self, req_id: int) -> None:
        """Gives back blocks ``reserve`` allocated that were never committed."""
        blocks, _ = self._staged.pop(req_id)
        self.pool.free(blocks[len(self.table.seq(req_id).block_ids):])

    def set_batch(self, req_ids: list[int]) -> torch.Tensor | None:
        """Writes the rows' block lists and lengths (with their reserved tokens) into the cache's
        static tables. Returns the validity mask [B, max_blocks * tpb] when dead tokens may still
        sit below kv_len (naive-evict, lazy mode), else None."""
        rows = [self._staged[r] for r in req_ids]
        # Dense compaction left no hole: every position below kv_len is live.
        assert self.masks_positions or all(self.table.num_live(r) == self.table.kv_len(r) for r in req_ids)
        if self.cache is None:
            return None
        self.cache.set_batch([blocks for blocks, _ in rows], [length for _, length in rows])
        if not self.masks_positions:
            return None
        start = time.perf_counter()
        valid = np.zeros((len(req_ids), self.cache.block_offsets.shape[1] * self.config.tokens_per_block), bool)
        for i, req_id in enumerate(req_ids):
            old = self.table.kv_len(req_id)
            valid[i, :old] = self.table.position_live_mask(req_id)
            valid[i, old : rows[i][1]] = True
        self.stats.mask_seconds += time.perf_counter() - start
        return torch.from_numpy(valid).to(self.cache.pool.device)

    @property
    def masks_positions(self) -> bool:
        """Dead tokens may sit below kv_len (naive-evict, lazy mode): attention needs a mask."""
        return self.policy is not None and not (self.backend is not None and self.config.mode == "dense")

    def commit(self, req_id: int) -> None:
        """The reserved tokens are written: they join the token table with the next logical ids."""
        start = time.perf_counter()
        blocks, total = self._staged.pop(req_id)
        self.table.sync_new_tokens(req_id, blocks, total)
        self.stats.table_seconds += time.perf_counter() - start

    def next_position(self, req_id: int) -> int:
        """RoPE position of the request's next token: its logical position in "keep" mode, its
        physical one (kv_len) in "shift" mode, where ``reclaim`` re-rotates the cached keys."""
        if self.config.positions == "shift":
            return self.table.kv_len(req_id)
        return self.table.num_tokens(req_id)

    def observe(self, req_id: int, mass: torch.Tensor) -> None:
        """Credits attention mass per physical position [>= kv_len] to the live tokens there."""
        if not self.needs_attention:
            return
        start = time.perf_counter()
        seq = self.table.seq(req_id)
        tokens = seq.token_at[: seq.kv_len]
        live = self.table.position_live_mask(req_id)
        self.policy.observe(req_id, tokens[live].astype(np.int64), mass[: seq.kv_len].cpu().numpy()[live])
        self.stats.policy_seconds += time.perf_counter() - start

    def evict(self, req_id: int) -> list[int]:
        """Applies the policy's decision; returns the logical ids it evicted."""
        if self.policy is None:
            return []
        start = time.perf_counter()
        doomed = self.policy.select(policy_view(self.table, req_id)).tolist()
        if doomed:
            self.table.evict_tokens(req_id, doomed)
            self.stats.tokens_evicted += len(doomed)
        self.stats.policy_seconds += time.perf_counter() - start
        return doomed

    def reclaim(self, req_ids: list[int], pressure: bool = False) -> int:
        """Frees what the variant can free of these requests; returns the blocks freed. vtoken
        copies every request's moves at once (one launch on CUDA). In "shift" mode, the keys of
        each request whose physical length shrank by d are then turned back by d positions."""
        if self.rerotation is None:
            return self._free(req_ids, pressure)
        before = [self.table.kv_len(r) for r in req_ids]
        freed = self._free(req_ids, pressure)
        self.rerotation.shift_requests(
            self.table, {r: b - self.table.kv_len(r) for r, b in zip(req_ids, before)})
        return freed

    def _free(self, req_ids: list[int], pressure: bool) -> int:
        if self.backend is not None:
            on_cuda = self.cache is not None and self.cache.pool.is_cuda and not self.config.synchronous_copies
            stream = torch.cuda.current_stream() if on_cuda else None
            return self.backend.reclaim(req_ids, pressure=pressure, stream=stream)
        freed = 0
        if self.policy is not None:
            for req_id in req_ids:
                freed += release_dead_blocks(self.table, self.pool, req_id)
            self.stats.dead_blocks_released += freed
        return freed

    def update(self, req_id: int, remaining: int) -> None:
        seq = self.table.seq(req_id)
        self.admission.update(req_id, logical_len=seq.num_tokens, live=seq.num_live,
                              remaining=remaining, held=len(seq.block_ids))

    def release(self, req_id: int) -> None:
        """Returns every block of the request to the pool and drops its state everywhere."""
        if req_id in self._staged:
            self.unreserve(req_id)
        self.pool.free(self.table.remove_request(req_id))
        self.admission.finish(req_id)
        if self.policy is not None:
            self.policy.forget(req_id)

    # ---- reporting -----------------------------------------------------------------------------
    def usage(self) -> KVUsage:
        ids = self.table.request_ids()
        used = self.pool.num_used
        return KVUsage(used, sum(self.table.num_live(r) for r in ids), used * self.config.tokens_per_block)

    def check_integrity(self) -> None:
        self.table.check_integrity()
        self.pool.check_integrity()
        held = sum(len(self.table.block_ids(r)) for r in self.table.request_ids())
        staged = sum(len(b) - len(self.table.block_ids(r)) for r, (b, _) in self._staged.items())
        assert held + staged == self.pool.num_used, "leaked or double-held blocks"
