# SPDX-License-Identifier: Apache-2.0
"""The reference runtime's KV-cache manager: block pool, token table, KV pool, policy, reclamation
and admission for one engine, in the roles TensorRT-LLM's ``KVCacheManager`` plays.

Per step and request the engine calls, in this order:

    admit(req, ids, ...)    admission (with prefix caching: the cached prefix joins the table)
    reserve(req, n)         blocks for n new tokens (None: the pool is dry -> preempt someone)
    set_batch(rows)         rewrite block_offsets / kv_lens in place (+ the validity mask)
    ... forward writes K/V into the reserved slots ...
    commit(req)             sync_new_tokens: the new tokens get logical ids
    observe(req, mass)      attention received, for H2O / Scissorhands
    evict(req)              the policy marks tokens dead (naive-evict, vtoken)
    reclaim(reqs)           vtoken: relocate (one copy for all) + free tail blocks; naive-evict:
                            free fully dead blocks
    update(req, remaining)  admission learns what the request now holds
    release(req)            finished, cancelled or preempted: every block back to the pool
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from trtllm_vtoken.core import BlockPool, TokenTable
from trtllm_vtoken.policies import EvictionPolicy, policy_view
from trtllm_vtoken.policies.request_settings import EvictionSettings, PolicySpec
from trtllm_vtoken.reclaim import (
    AdmissionConfig,
    AdmissionController,
    ReclaimBackend,
    ReclaimConfig,
)
from trtllm_vtoken.reclaim.copy import AccountingCopyExecutor, TorchCopyExecutor
from trtllm_vtoken.reclaim.dead_blocks import release_dead_blocks
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.kv_cache import PagedKVCache
from trtllm_vtoken.runtime.model import LlamaConfig
from trtllm_vtoken.runtime.prefix_caching import PrefixCaching


@dataclass
class KVStats:
    tokens_evicted: int = 0
    tokens_evicted_by_policy: dict[str, int] = field(default_factory=dict)
    """The same, by the policy's name (requests may follow different ones)."""
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
        self.prefix = PrefixCaching(self.pool) if config.prefix_caching else None
        self.table = TokenTable(tpb, self.prefix.cache.is_shared if self.prefix else self.pool.is_shared)
        self.cache: PagedKVCache | None = None
        if simulated_bytes_per_token is None:
            self.cache = PagedKVCache(
                config.num_blocks, tpb, model_config.num_hidden_layers, model_config.num_key_value_heads,
                model_config.head_dim, config.max_batch_size, config.max_blocks_per_seq,
                dtype=getattr(torch, config.dtype), device=config.device,
            )
        self.spec: PolicySpec | None = None if config.variant == "native" else config.policy_spec()
        self.policy: EvictionPolicy | None = None if self.spec is None else self.spec.make()
        """The engine's own policy (requests that set no eviction of their own run with it)."""
        self._policies: dict[PolicySpec, EvictionPolicy] = {} if self.spec is None else {self.spec: self.policy}
        self._policy_of: dict[int, EvictionPolicy | None] = {}
        self._name_of: dict[int, str] = {}
        self.needs_attention = self.policy is not None and _observes(self.policy)
        self.backend: ReclaimBackend | None = None
        if config.variant == "vtoken":
            reclaim = ReclaimConfig(config.mode, config.fragmentation_threshold, config.check_invariants)
            executor = (TorchCopyExecutor([self.cache.pool], kernel=config.relocation_kernel)
                        if self.cache is not None
                        else AccountingCopyExecutor(simulated_bytes_per_token))
            self.backend = ReclaimBackend(self.table, self.pool, executor, reclaim)
        self.admission = AdmissionController(self.pool, AdmissionConfig(
            config.variant, config.mode, config.fragmentation_threshold, config.evacuation_headroom),
            reclaimable=(lambda: self.prefix.cache.num_reclaimable) if self.prefix else None)
        self.stats = KVStats()
        self._staged: dict[int, tuple[list[int], int]] = {}  # req -> (block list, kv_len after write)

    # ---- policies ------------------------------------------------------------------------------
    def resolve(self, eviction: EvictionSettings | None) -> PolicySpec | None:
        """The policy spec a request with these settings runs with (None: it evicts nothing).
        Raises ValueError for settings this engine cannot honour."""
        if eviction is None or eviction.is_default:
            return self.spec
        if self.config.variant == "native" and eviction.policy != "native":
            raise ValueError("this engine runs variant 'native' (no eviction): a request cannot name a "
                             "policy or budget here")
        return eviction.resolve(self.spec)

    def policy_of(self, req_id: int) -> EvictionPolicy | None:
        return self._policy_of.get(req_id)

    # ---- admission -----------------------------------------------------------------------------
    def final_budget(self, total_tokens: int, spec: PolicySpec | None = None) -> int | None:
        """Live tokens a request of ``total_tokens`` keeps at completion (None: no eviction)."""
        return None if spec is None else spec.budget.target(total_tokens)

    def check_fits_alone(self, prompt_len: int, max_tokens: int, spec: PolicySpec | None = None) -> None:
        """Raises ValueError if the request could not run even with the whole pool to itself."""
        cfg = self.config
        if prompt_len + max_tokens > cfg.max_seq_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"max_seq_len {cfg.max_seq_len}")
        usable = cfg.num_blocks - cfg.evacuation_headroom
        probe = AdmissionController(BlockPool(usable, cfg.tokens_per_block),
                                    AdmissionConfig(cfg.variant, cfg.mode, cfg.fragmentation_threshold))
        if not probe.can_admit(prompt_len, max_tokens, self.final_budget(prompt_len + max_tokens, spec)):
            raise ValueError(f"request needs more KV blocks than the pool's {usable} usable blocks "
                             f"(prompt {prompt_len} + max_tokens {max_tokens} tokens, "
                             f"tokens_per_block {cfg.tokens_per_block})")

    def admit(self, req_id: int, token_ids: list[int], remaining: int, spec: PolicySpec | None = None) -> int | None:
        """Registers the request if admission allows; its prefill writes ``token_ids``. Returns
        how many of them are cached already (their KV is there: prefill the rest), or None if it
        does not fit now (nothing changed)."""
        cfg, prefill_len = self.config, len(token_ids)
        cached, reclaimable = self.prefix.probe(token_ids) if self.prefix else (0, 0)
        # A shared prefix is kept on top of the budget (its tokens are protected): count it in.
        shared = cached * cfg.tokens_per_block
        budget = self.final_budget(prefill_len + remaining - shared, spec)
        budget = None if budget is None else budget + shared
        if cfg.admission == "greedy":
            free = self.pool.num_free + (self.prefix.cache.num_reclaimable - reclaimable if self.prefix else 0)
            if free - cfg.evacuation_headroom < -(-prefill_len // cfg.tokens_per_block) - cached:
                return None
            self.admission.admit(req_id, prefill_len, remaining, budget, force=True, cached_blocks=cached)
        elif not self.admission.admit(req_id, prefill_len, remaining, budget, cached_blocks=cached,
                                      cached_reclaimable=reclaimable):
            return None
        self.table.add_request(req_id)
        policy = None if spec is None else self._policies.setdefault(spec, spec.make())
        self._policy_of[req_id] = policy
        self._name_of[req_id] = "native" if spec is None else spec.name
        self.needs_attention = self.needs_attention or (policy is not None and _observes(policy))
        if self.prefix is None:
            return 0
        blocks = self.prefix.begin(req_id, token_ids)
        self.table.sync_new_tokens(req_id, blocks, len(blocks) * cfg.tokens_per_block)
        return self.prefix.cached_tokens(req_id)

    # ---- one step ------------------------------------------------------------------------------
    def reserve(self, req_id: int, num_new: int) -> list[int] | None:
        """Slots for ``num_new`` tokens after the request's KV, allocating blocks as needed.
        Returns the flat slots, or None (nothing changed) if the pool lacks the blocks."""
        seq, tpb = self.table.seq(req_id), self.config.tokens_per_block
        start, blocks = seq.kv_len, list(seq.block_ids)
        missing = -(-(start + num_new) // tpb) - len(blocks)
        if missing > 0:
            fresh = self.prefix.allocate(missing) if self.prefix else self.pool.allocate(missing)
            if fresh is None:
                return None
            blocks += fresh
        self._staged[req_id] = (blocks, start + num_new)
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, self.pool.num_used)
        return self.staged_slots(req_id)

    # ---- prefix caching (no-ops without it) -----------------------------------------------------
    def store_prompt(self, req_id: int, token_ids: list[int]) -> None:
        """After ``reserve`` for the prefill: keys the prompt's full blocks (written by this step's
        prefill forward, which runs before any later request's forward can read them)."""
        if self.prefix is not None:
            self.prefix.store_prompt(req_id, self._staged[req_id][0], token_ids)

    def store_written(self, req_id: int, token_ids: Callable[[], list[int]]) -> None:
        """After a decode step's commit: keys the block it filled, if any (``token_ids``: the
        request's written tokens, asked for only then)."""
        if self.prefix is not None:
            seq = self.table.seq(req_id)
            if seq.kv_len % self.config.tokens_per_block == 0 and seq.num_tokens == seq.kv_len:
                self.prefix.store(req_id, seq.block_ids, token_ids())

    def mass_cuts(self, req_id: int) -> list[int]:
        """Query counts at which the request's prefill forward cuts its attention mass."""
        return self.prefix.mass_cuts(req_id) if self.prefix is not None else []

    def prefill_mass(self, req_id: int, mass: torch.Tensor, cut_mass: torch.Tensor | None) -> torch.Tensor:
        """What the request's policy observes for its prefill: ``mass`` plus its cached prefix's."""
        if self.prefix is None:
            return mass
        return self.prefix.prefill_mass(req_id, self.table.seq(req_id).block_ids, mass, cut_mass)

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
        return self.config.variant != "native" and not (self.backend is not None and self.config.mode == "dense")

    def commit(self, req_id: int) -> None:
        """The reserved tokens are written: they join the token table with the next logical ids."""
        start = time.perf_counter()
        blocks, total = self._staged.pop(req_id)
        self.table.sync_new_tokens(req_id, blocks, total)
        self.stats.table_seconds += time.perf_counter() - start

    def observe(self, req_id: int, mass: torch.Tensor) -> None:
        """Credits attention mass per physical position [>= kv_len] to the live tokens there."""
        policy = self._policy_of.get(req_id)
        if policy is None or not _observes(policy):
            return
        start = time.perf_counter()
        seq = self.table.seq(req_id)
        tokens = seq.token_at[: seq.kv_len]
        live = self.table.position_live_mask(req_id)
        policy.observe(req_id, tokens[live].astype(np.int64), mass[: seq.kv_len].cpu().numpy()[live])
        self.stats.policy_seconds += time.perf_counter() - start

    def evict(self, req_id: int) -> list[int]:
        """Applies the request's policy's decision; returns the logical ids it evicted."""
        policy = self._policy_of.get(req_id)
        if policy is None:
            return []
        start = time.perf_counter()
        doomed = policy.select(policy_view(self.table, req_id)).tolist()
        if doomed:
            if self.prefix is not None:  # its chain ends before compaction may write there
                self.prefix.cut(req_id, self.table.seq(req_id).block_ids, doomed)
            self.table.evict_tokens(req_id, doomed)
            self.stats.tokens_evicted += len(doomed)
            by_policy = self.stats.tokens_evicted_by_policy
            by_policy[self._name_of[req_id]] = by_policy.get(self._name_of[req_id], 0) + len(doomed)
        self.stats.policy_seconds += time.perf_counter() - start
        return doomed

    def reclaim(self, req_ids: list[int], pressure: bool = False) -> int:
        """Frees what the variant can free of these requests; returns the blocks freed. vtoken
        copies every request's moves at once (one launch on CUDA)."""
        if self.backend is not None:
            on_cuda = self.cache is not None and self.cache.pool.is_cuda and not self.config.synchronous_copies
            stream = torch.cuda.current_stream() if on_cuda else None
            return self.backend.reclaim(req_ids, pressure=pressure, stream=stream)
        freed = 0
        if self.config.variant == "naive-evict":
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
        blocks = self.table.remove_request(req_id)
        if self.prefix is not None:
            self.prefix.end(req_id, blocks)
        else:
            self.pool.free(blocks)
        self.admission.finish(req_id)
        policy = self._policy_of.pop(req_id, None)
        self._name_of.pop(req_id, None)
        if policy is not None:
            policy.forget(req_id)

    # ---- reporting -----------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks a new allocation can get: free ones plus cached ones no request holds."""
        return self.pool.num_free + (self.prefix.cache.num_reclaimable if self.prefix else 0)

    def usage(self) -> KVUsage:
        """Blocks requests hold (cached blocks no request holds are free-able, not counted), the
        live tokens in them (a token of a shared block once) and their slots."""
        ids = self.table.request_ids()
        used = self.pool.num_blocks - self.num_available
        live = sum(self.table.num_live(r) for r in ids)
        if self.prefix is not None and self.prefix.cache.shared:
            tpb = self.config.tokens_per_block
            for block_id in self.prefix.cache.shared:  # shared blocks are full of protected live tokens
                live -= (self.prefix.cache.holders(block_id) - 1) * tpb
        return KVUsage(used, live, used * self.config.tokens_per_block)

    def check_integrity(self) -> None:
        self.table.check_integrity()
        self.pool.check_integrity()
        references = sum(len(self.table.block_ids(r)) for r in self.table.request_ids())
        staged = sum(len(b) - len(self.table.block_ids(r)) for r, (b, _) in self._staged.items())
        if self.prefix is not None:
            self.prefix.cache.check_integrity()
            references += len(self.prefix.cache.key_of)
        if references + staged != sum(self.pool.ref_counts):
            raise RuntimeError(f"leaked or double-held blocks: {references + staged} references held, "
                               f"{sum(self.pool.ref_counts)} counted by the pool")


def _observes(policy: EvictionPolicy) -> bool:
    """Does the policy learn from attention mass (the forward must then return it)?"""
    return type(policy).observe is not EvictionPolicy.observe
