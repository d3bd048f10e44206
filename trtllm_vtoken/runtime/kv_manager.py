# SPDX-License-Identifier: Apache-2.0
"""The reference runtime's KV-cache manager: block pool, KV pool, admission and, for the evicting
variants, the one batched step (``trtllm_vtoken.step``), in the roles TensorRT-LLM's
``KVCacheManager`` plays.

Per iteration the engine calls:

    reserve(req, n)            blocks for n new tokens (False: the pool is dry -> preempt someone)
    set_batch(rows)            rewrite block_offsets / kv_lens in place (+ the validity mask)
    ... forward writes K/V into the reserved slots ...
    step(rows, mass)           once, for every request that goes on: the new tokens join; vtoken
                               and naive-evict run ``DecodeStep`` (the policy's batched decision,
                               eviction, compaction, one copy); admission learns what each holds
    next_position(req)         the RoPE position of the request's next token (logical in "keep"
                               mode, physical in "shift" mode, where the step re-rotates the keys)
    release(req)               finished, cancelled or preempted: every block back to the pool

``native`` keeps plain block lists (``BlockLists``): no token table, no policy, no step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from trtllm_vtoken.core import BlockPool
from trtllm_vtoken.reclaim.admission import AdmissionConfig, AdmissionController
from trtllm_vtoken.reclaim.copy import AccountingCopyExecutor, TorchCopyExecutor
from trtllm_vtoken.runtime.block_lists import BlockLists
from trtllm_vtoken.reclaim.rerotate import KeyRerotation
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.kv_cache import PagedKVCache
from trtllm_vtoken.runtime.model import LlamaConfig
from trtllm_vtoken.step import DecodeStep, StepConfig, StepInput, StepOutput, StepStats


@dataclass
class KVStats:
    peak_blocks_used: int = 0
    mask_seconds: float = 0.0
    """Host time building the validity mask (naive-evict, lazy mode)."""
    lists_seconds: float = 0.0
    """native: host time appending the new tokens to the block lists."""


@dataclass(frozen=True)
class KVUsage:
    blocks_used: int
    live_tokens: int
    slots_held: int

    @property
    def utilization(self) -> float:
        """Live tokens over slots in allocated blocks: the memory doing useful work."""
        return self.live_tokens / self.slots_held if self.slots_held else 0.0


def make_step(config: EngineConfig, num_blocks: int, pool: BlockPool, executor,
              rerotation: KeyRerotation | None = None) -> DecodeStep:
    """The step an engine of ``config`` runs (vtoken: its compaction mode; naive-evict: dead
    blocks). Shift positions commit lazy plans in their own step: the keys turn right after."""
    compaction = config.mode if config.variant == "vtoken" else "dead-blocks"
    background = compaction == "lazy" and config.lazy_background and rerotation is None
    return DecodeStep(StepConfig(compaction, config.fragmentation_threshold, config.check_invariants, config.step_impl,
                                 background),
                      num_blocks, config.tokens_per_block, config.make_policy(), executor, pool.is_shared,
                      lambda: pool.shared, rerotation=rerotation)


class KVCacheManager:
    def __init__(self, config: EngineConfig, model_config: LlamaConfig,
                 simulated_bytes_per_token: int | None = None) -> None:
        """``simulated_bytes_per_token``: no KV tensors at all (the simulated-attention backend);
        relocations are planned and committed exactly and their bytes counted, nothing is copied."""
        self.config = config
        tpb = config.tokens_per_block
        self.pool = BlockPool(config.num_blocks, tpb)
        self.cache: PagedKVCache | None = None
        if simulated_bytes_per_token is None:
            self.cache = PagedKVCache(
                config.num_blocks, tpb, model_config.num_hidden_layers, model_config.num_key_value_heads,
                model_config.head_dim, config.max_batch_size, config.max_blocks_per_seq,
                dtype=getattr(torch, config.dtype), device=config.device,
            )
        self.step: DecodeStep | None = None
        self.rerotation: KeyRerotation | None = None
        """Shift positions: the pass the step runs after each compaction that shortens a request."""
        self.lists: BlockLists | None = None
        if config.variant == "native":
            self.lists = BlockLists(tpb)
        else:
            executor = None
            if config.variant == "vtoken":
                executor = (TorchCopyExecutor([self.cache.pool], kernel=config.relocation_kernel)
                            if self.cache is not None else AccountingCopyExecutor(simulated_bytes_per_token))
            if config.positions == "shift" and self.cache is not None:
                self.rerotation = KeyRerotation([self.cache.pool], model_config.rope, kernel=config.relocation_kernel)
            self.step = make_step(config, config.num_blocks, self.pool, executor, self.rerotation)
        self.layout = self.step if self.step is not None else self.lists
        """Who knows the requests' blocks and lengths: the step, or native's block lists."""
        self.needs_attention = self.step is not None and self.step.observes_attention()
        self.admission = AdmissionController(self.pool, AdmissionConfig(
            config.variant, config.mode, config.fragmentation_threshold, config.evacuation_headroom))
        self.stats = KVStats()
        self._staged: dict[int, tuple[list[int], int]] = {}  # req -> (new blocks, new tokens)

    @property
    def step_stats(self) -> StepStats:
        """What the step did (zeros for native, which has none)."""
        return self.step.stats if self.step is not None else StepStats()

    # ---- admission -----------------------------------------------------------------------------
    def final_budget(self, total_tokens: int) -> int | None:
        """Live tokens a request of ``total_tokens`` keeps at completion (None: no eviction)."""
        policy = self.step.policy if self.step is not None else None
        return None if policy is None else policy.budget.target(total_tokens)

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
        self.layout.add_request(req_id)
        return True

    # ---- one iteration -------------------------------------------------------------------------
    def reserve(self, req_id: int, num_new: int) -> bool:
        """Room for ``num_new`` tokens after the request's KV, allocating blocks as needed
        (``staged_slots`` names the slots). False, changing nothing, if the pool lacks the blocks."""
        tpb, layout = self.config.tokens_per_block, self.layout
        missing = -(-(layout.kv_len(req_id) + num_new) // tpb) - layout.num_blocks(req_id)
        fresh: list[int] = []
        if missing > 0:
            fresh = self.pool.allocate(missing)
            if fresh is None:
                return False
        self._staged[req_id] = (fresh, num_new)
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, self.pool.num_used)
        return True

    def staged_blocks(self, req_id: int) -> tuple[list[int], int]:
        """The request's block list with the blocks ``reserve`` added, and its length after the write."""
        fresh, num_new = self._staged[req_id]
        return self.layout.block_ids(req_id) + fresh, self.layout.kv_len(req_id) + num_new

    def staged_tokens(self, req_id: int) -> int:
        """The request's logical length once its reserved tokens are written."""
        return self.layout.num_tokens(req_id) + self._staged[req_id][1]

    def staged_slots(self, req_id: int) -> list[int]:
        """The flat slots ``reserve`` handed out for the request's pending write."""
        blocks, total = self.staged_blocks(req_id)
        tpb, start = self.config.tokens_per_block, self.layout.kv_len(req_id)
        return [blocks[p // tpb] * tpb + p % tpb for p in range(start, total)]

    def unreserve(self, req_id: int) -> None:
        """Gives back blocks ``reserve`` allocated that were never committed."""
        fresh, _ = self._staged.pop(req_id)
        self.pool.free(fresh)

    def set_batch(self, req_ids: list[int]) -> torch.Tensor | None:
        """Writes the rows' block lists and lengths (with their reserved tokens) into the cache's
        static tables. Returns the validity mask [B, max_blocks * tpb] when dead tokens may still
        sit below kv_len (naive-evict, lazy mode), else None."""
        if self.cache is None:
            return None
        rows = [self.staged_blocks(r) for r in req_ids]
        self.cache.set_batch([blocks for blocks, _ in rows], [length for _, length in rows])
        if not self.masks_positions:
            return None
        start = time.perf_counter()
        width = self.cache.block_offsets.shape[1] * self.config.tokens_per_block
        valid = np.zeros((len(req_ids), width), bool)
        held = self.step.batch_tokens(req_ids) >= 0  # live tokens at the positions already written
        valid[:, : min(held.shape[1], width)] = held[:, :width]
        for i, req_id in enumerate(req_ids):
            valid[i, self.layout.kv_len(req_id) : rows[i][1]] = True  # this step's new tokens
        self.stats.mask_seconds += time.perf_counter() - start
        return torch.from_numpy(valid).to(self.cache.pool.device)

    @property
    def masks_positions(self) -> bool:
        """Dead tokens may sit below kv_len (naive-evict, lazy mode): attention needs a mask."""
        return self.step is not None and self.step.config.compaction != "dense"

    def step_batch(self, req_ids: list[int], mass=None) -> StepOutput | None:
        """The iteration's end for the requests that go on: their written tokens join (native:
        the block lists); the step evicts and compacts (one copy for all); admission is updated.

        Args:
            mass: attention per physical position [B, >= L] (or the step's ``Mass`` function),
                when the policy observes it.
        """
        staged = [self._staged.pop(r) for r in req_ids]
        if self.step is None:
            start = time.perf_counter()
            for req_id, (fresh, num_new) in zip(req_ids, staged):
                self.lists.append(req_id, fresh, num_new)
            self.stats.lists_seconds += time.perf_counter() - start
            return None
        if not req_ids:
            return None
        offsets = np.cumsum([0] + [len(fresh) for fresh, _ in staged])
        on_cuda = self.cache is not None and self.cache.pool.is_cuda and not self.config.synchronous_copies
        # Memory pressure: the pool could not give every running request a block for its next token.
        pressure = self.pool.num_free < len(req_ids) + self.config.evacuation_headroom
        out = self.step.run(StepInput(req_ids, [n for _, n in staged], offsets, [b for f, _ in staged for b in f],
                                      mass=mass if self.needs_attention else None, pressure=pressure,
                                      stream=torch.cuda.current_stream() if on_cuda else None))
        self.pool.free(out.table.freed.tolist())
        return out

    def update(self, req_ids: list[int], remaining: list[int]) -> None:
        """Admission learns what each request now holds, and how many tokens it may still write."""
        if self.step is not None:  # the step's counters, read for the batch at once
            tokens, live, held = self.step.counters(req_ids)
        else:
            lists = self.lists
            tokens = live = [lists.kv_len(r) for r in req_ids]
            held = [lists.num_blocks(r) for r in req_ids]
        for req_id, n, k, h, rest in zip(req_ids, tokens, live, held, remaining):
            self.admission.update(req_id, logical_len=n, live=k, remaining=rest, held=h)

    def next_position(self, req_id: int) -> int:
        """RoPE position of the request's next token: its logical position in "keep" mode, its
        physical one (kv_len) in "shift" mode, where the step re-rotates the cached keys."""
        if self.config.positions == "shift":
            return self.layout.kv_len(req_id)
        return self.layout.num_tokens(req_id)

    def release(self, req_id: int) -> None:
        """Returns every block of the request to the pool and drops its state everywhere."""
        if req_id in self._staged:
            self.unreserve(req_id)
        self.pool.free(self.layout.remove_request(req_id))
        self.admission.finish(req_id)

    # ---- reporting -----------------------------------------------------------------------------
    def usage(self) -> KVUsage:
        layout = self.layout
        used = self.pool.num_used
        return KVUsage(used, sum(layout.num_live(r) for r in layout.request_ids()), used * self.config.tokens_per_block)

    def check_integrity(self) -> None:
        """The pool, the step's tables (I2, batch layout) and the blocks they hold agree."""
        if self.step is not None:
            self.step.check_integrity()
        self.pool.check_integrity()
        layout = self.layout
        held = sum(layout.num_blocks(r) for r in layout.request_ids())
        staged = sum(len(fresh) for fresh, _ in self._staged.values())
        if held + staged != self.pool.num_used:
            raise RuntimeError(f"leaked or double-held blocks: requests hold {held} (+{staged} reserved), "
                               f"the pool has {self.pool.num_used} in use")
