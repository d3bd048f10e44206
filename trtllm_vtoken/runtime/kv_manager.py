# SPDX-License-Identifier: Apache-2.0
"""The reference runtime's KV-cache manager: block pool, KV pool, admission and, for the evicting
variants, the one batched step (``trtllm_vtoken.step``), in the roles TensorRT-LLM's
``KVCacheManager`` plays.

Per iteration the engine calls:

    admit(req, ids, ...)       admission (``kv_admission.py``; with prefix caching the cached
                               prefix's blocks are taken, or copied; ``store_prompt`` keys the
                               full blocks of its first forward after reserve)
    reserve_decode(rows)       a block for each decode row's next token that needs one, at once, when
                               the free list covers them all (False, nothing changed: reserve one by one)
    reserve(req, n)            blocks for n new tokens (False: the pool is dry -> preempt someone)
    set_batch(rows)            rewrite block_offsets / kv_lens in place (+ the validity mask)
    ... forward writes K/V into the reserved slots ...
    start_step(rows, mass)     once, for every row the forward ran: the new tokens join; vtoken
                               and naive-evict run ``DecodeStep`` (the policy's batched decision,
                               eviction, compaction, one copy), its native call beside the engine's
                               sampling where it can (``overlap``)
    ... sampling; a request that finishes is released (after the step) ...
    finish_step()              the step completed, its released blocks freed
    update(rows)               admission learns what each request going on holds
    next_position(req)         the RoPE position of the request's next token (logical in "keep"
                               mode, physical in "shift" mode, where the step re-rotates the keys)
    store_written(rows)        prefix caching: keys the blocks the step's tokens filled
    release(req)               finished, cancelled or preempted: every block back to the pool
                               (with prefix caching, keyed blocks stay cached)

``native`` keeps plain block lists (``BlockLists``): no token table, no policy, no step. Requests
may bring their own eviction settings (``resolve``): each runs with its policy in the one step.
With prefix caching the step protects shared blocks and, between its decision and the token
table, cuts each evicting request's cached chain (``PrefixCaching.cut``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from trtllm_vtoken.core import BlockPool
from trtllm_vtoken.policies import EvictionPolicy
from trtllm_vtoken.policies.request_settings import EvictionSettings, PolicySpec
from trtllm_vtoken.reclaim.admission import AdmissionConfig, AdmissionController
from trtllm_vtoken.reclaim.copy import AccountingCopyExecutor, TorchCopyExecutor
from trtllm_vtoken.reclaim.rerotate import KeyRerotation
from trtllm_vtoken.runtime.block_lists import BlockLists
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine_step import make_step
from trtllm_vtoken.runtime.kv_admission import KVAdmission
from trtllm_vtoken.runtime.kv_cache import PagedKVCache
from trtllm_vtoken.runtime.kv_prefix import KVPrefixCalls
from trtllm_vtoken.runtime.kv_stats import EvictionCounter, KVStats, KVUsage
from trtllm_vtoken.runtime.model import LlamaConfig
from trtllm_vtoken.runtime.pending_writes import PendingWrites
from trtllm_vtoken.runtime.prefix_caching import PrefixCaching
from trtllm_vtoken.step import DecodeStep, StepInput, StepOutput, StepStats


class KVCacheManager(KVAdmission, KVPrefixCalls):
    def __init__(self, config: EngineConfig, model_config: LlamaConfig,
                 simulated_bytes_per_token: int | None = None) -> None:
        """``simulated_bytes_per_token``: no KV tensors at all (the simulated-attention backend);
        relocations are planned and committed exactly and their bytes counted, nothing is copied."""
        self.config = config
        tpb = config.tokens_per_block
        self.pool = BlockPool(config.num_blocks, tpb)
        # Shift positions turn every surviving key of a request that lost tokens, shared prefix
        # blocks included: caching them would hand other requests keys turned for another length.
        self.prefix = PrefixCaching(self.pool) if config.prefix_caching and config.positions != "shift" else None
        """Prefix caching (None when off, and in "shift" positions)."""
        self.cache: PagedKVCache | None = None
        if simulated_bytes_per_token is None:
            self.cache = PagedKVCache(
                config.num_blocks, tpb, model_config.num_hidden_layers, model_config.num_key_value_heads,
                model_config.head_dim, config.max_batch_size, config.max_blocks_per_seq,
                dtype=getattr(torch, config.dtype), device=config.device, fp8=config.kv_cache_dtype == "fp8",
            )
        self.step: DecodeStep | None = None
        self.rerotation: KeyRerotation | None = None
        """Shift positions: the pass the step runs after each compaction that shortens a request."""
        self.lists: BlockLists | None = None
        self.spec: PolicySpec | None = None if config.variant == "native" else config.policy_spec()
        """The engine's own policy (requests that set no eviction of their own run with it)."""
        self._policies: dict[PolicySpec, EvictionPolicy] = {}
        self.step_drafts: dict[int, int] = {}  # request -> draft tokens its decode steps may carry (> 0 only)
        self.lag_start: set[int] = set()  # requests whose first decode step, deferred, has not run (``decode_lags``)
        if config.variant == "native":
            self.lists = BlockLists(tpb)
        else:
            executor = None
            if config.variant == "vtoken":
                # FP8 codes move as bytes (the relocation kernel copies rows of bytes of any dtype).
                pool = None if self.cache is None else self.cache.pool if self.cache.kv_scales is None else \
                    self.cache.pool.view(torch.uint8)
                executor = (TorchCopyExecutor([pool], kernel=config.relocation_kernel)
                            if self.cache is not None else AccountingCopyExecutor(simulated_bytes_per_token))
            if config.positions == "shift" and self.cache is not None:
                self.rerotation = KeyRerotation([self.cache.pool], model_config.rope, kernel=config.relocation_kernel)
            self._policies[self.spec] = self.spec.make()
            self.step = make_step(config, config.num_blocks, self.pool, executor, self.rerotation, self.prefix,
                                  self._policies[self.spec])
        self.layout = self.step if self.step is not None else self.lists
        """Who knows the requests' blocks and lengths: the step, or native's block lists."""
        self.needs_attention = self.step is not None and self.step.observes_attention()
        self.admission = AdmissionController(self.pool, AdmissionConfig(
            config.variant, config.mode, config.fragmentation_threshold, config.evacuation_headroom),
            reclaimable=(lambda: self.prefix.cache.num_reclaimable) if self.prefix else None)
        self.stats = KVStats()
        self.evictions = EvictionCounter(self.stats)
        self.writes = PendingWrites(tpb, self.layout, self.prefix.allocate if self.prefix else self.pool.allocate,
                                    lambda: self.pool.num_free)
        """Cached prefixes and this iteration's reservations, not yet in the layout."""
        self._stepping = False  # start_step began a step that finish_step has not completed
        self._finished: StepOutput | None = None  # completed early (a release waited for it)

    @property
    def policy(self) -> EvictionPolicy | None:
        """The engine's own policy (None for native)."""
        return None if self.spec is None else self._policies[self.spec]

    @property
    def step_stats(self) -> StepStats:
        """What the step did (zeros for native, which has none)."""
        return self.step.stats if self.step is not None else StepStats()

    # ---- policies ----------------------------------------------------------------------------
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
        return self.step.policy_of(req_id) if self.step is not None else None

    def decides_from_counts(self, req_id: int) -> bool:
        """The request's policy evicts and decides from counts alone (not from attention):
        nothing of a forward is needed to decide what it evicts after that forward."""
        policy = self.policy_of(req_id)
        return policy is not None and not policy.observes_attention()

    # ---- one iteration -------------------------------------------------------------------------
    def reserve(self, req_id: int, num_new: int) -> bool:
        """Room for ``num_new`` tokens after the request's KV, allocating blocks as needed
        (``staged_slots`` names the slots). False, changing nothing, if the pool lacks the blocks."""
        return self._reserved(self.writes.reserve(req_id, num_new))

    def reserve_decode(self, req_ids: list[int]) -> bool:
        """``reserve(req, 1)`` for every request at once when the free list covers them all (the
        same blocks to the same requests); False, changing nothing, otherwise
        (``PendingWrites.reserve_decode``)."""
        return self._reserved(self.writes.reserve_decode(req_ids))

    def extend_reservation(self, req_id: int, num_more: int) -> bool:
        """Room for ``num_more`` tokens more after this iteration's reservation (draft tokens);
        False, changing nothing, if the pool lacks the blocks."""
        return self._reserved(self.writes.extend(req_id, num_more))

    def drop_reserved(self, req_id: int, num_tokens: int) -> None:
        """Forgets the last ``num_tokens`` reserved for the request (rejected draft tokens, before
        the step takes the iteration in) and frees the blocks they leave empty."""
        self.writes.unstage(req_id, num_tokens, self.pool.free)

    def staged_slots(self, req_id: int) -> list[int]:
        """The flat slots ``reserve`` handed out for the request's pending write."""
        return self.writes.staged_slots(req_id)

    def _reserved(self, done: bool) -> bool:
        if done:  # blocks requests hold (cached blocks no request holds are free-able, not counted)
            self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, self.pool.num_blocks - self.num_available)
        return done

    def set_batch(self, req_ids: list[int]) -> torch.Tensor | None:
        """Writes the rows' block lists and lengths (with their reserved tokens) into the cache's
        static tables. Returns the validity mask [B, max_blocks * tpb] when dead tokens may still
        sit below kv_len (naive-evict, lazy mode), else None."""
        if self.cache is None:
            return None
        rows = [self.writes.staged_blocks(r) for r in req_ids]
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
        """The iteration's end for these requests at once: ``start_step`` then ``finish_step``."""
        self.start_step(req_ids, mass)
        return self.finish_step()

    def start_step(self, req_ids: list[int], mass=None, overlap: bool = False, forward_between: bool = False,
                   prompt_goes_on: bool = False, unobserved: list[int] | None = None) -> None:
        """The iteration's end for the requests the forward ran: their written tokens join
        (native: the block lists); the step evicts and compacts (one copy for all). ``overlap``:
        the step's native call may run beside the engine's next work (``DecodeStep.start``)
        until ``finish_step``, which frees the released blocks; a release in between waits for it.
        ``forward_between``: a forward runs before ``finish_step`` that writes the batch's newest
        tokens; the step's copy waits for ``finish_step`` (``DecodeStep.start``).
        ``prompt_goes_on``: a prompt prefilled in chunks has more to come; lazy compaction in the
        background then commits at once, as under memory pressure: admission counts one chunk
        beside a prompt's budget, and its next chunk needs the blocks that holes hold.

        Args:
            mass: attention per physical position [B, >= L] (or the step's ``Mass`` function),
                when the policy observes it.
            unobserved: per request, its newest tokens the mass does not cover
                (``StepInput.unobserved``: a step beside the next forward takes that forward's in).
        """
        self.finish_step()  # a step begun before and not finished
        if not req_ids:
            return
        if forward_between and self.lag_start:  # deferred steps: from now on each takes in the next token too
            self.lag_start.difference_update(req_ids)
        fresh_lists, num_new = self.writes.take(req_ids)
        if self.step is None:
            start = time.perf_counter()
            self.lists.append_batch(req_ids, fresh_lists, num_new)
            self.stats.lists_seconds += time.perf_counter() - start
            return
        on_cuda = self.cache is not None and self.cache.pool.is_cuda and not self.config.synchronous_copies
        # Memory pressure: the pool could not give every running request the blocks of its next
        # decode tokens (its token and drafts: at most ceil((1 + drafts) / tokens_per_block) blocks).
        # Every one, not only this step's rows: the overlap scheduler steps an iteration's rows in
        # two calls, and the next reservation is for all of them.
        pressure = self.pool.num_free < self._next_decode_blocks() + self.config.evacuation_headroom
        self.step.start(StepInput.of_lists(req_ids, num_new, fresh_lists, mass=mass if self.needs_attention else None,
                                           unobserved=unobserved if self.needs_attention else None,
                                           pressure=pressure, commit_at_once=prompt_goes_on,
                                           stream=torch.cuda.current_stream() if on_cuda else None),
                        overlap=overlap, forward_between=forward_between)
        self._stepping = True

    def _next_decode_blocks(self) -> int:
        """Most blocks the running requests' next decode reservation takes."""
        drafts, running = self.step_drafts, self.admission.running
        if not drafts:  # no request drafts: one block each at most
            return len(running)
        tpb = self.config.tokens_per_block
        return sum(-(-(1 + drafts.get(r, 0)) // tpb) for r in running)

    def finish_step(self) -> StepOutput | None:
        """Completes the step ``start_step`` began (waits for its native call), frees the blocks
        it released; returns its output (None: no step, or native)."""
        self._land()
        out, self._finished = self._finished, None
        return out

    def _land(self) -> None:
        """The step in flight, if any, completed; its output kept for ``finish_step``."""
        if self._stepping:
            self._stepping = False
            out = self.step.finish()
            if out.num_freed:
                self._free(out.table.freed.tolist())
            if out.num_evicted:
                self.evictions.count(out.req_ids, out.victim_offsets)
            self._finished = out

    def update(self, req_ids: list[int], remaining: list[int], unprefilled: list[int] | None = None) -> None:
        """Admission learns what each request now holds, and how many tokens it may still write:
        ``remaining`` to generate and ``unprefilled`` prompt tokens still to prefill in chunks."""
        if self.step is not None:  # the step's counters, read for the batch at once
            tokens, live, held = self.step.counters(req_ids)
        else:
            lists = self.lists
            tokens = live = list(map(lists.kv_len, req_ids))
            held = list(map(lists.num_blocks, req_ids))
        drafts, lag_start = self.step_drafts, self.lag_start  # a decode step writes its token and drafts
        if unprefilled is None:
            for req_id, n, k, h, rest in zip(req_ids, tokens, live, held, remaining):
                self.admission.update(req_id, logical_len=n, live=k, remaining=rest, held=h,
                                      step_tokens=(1 + drafts.get(req_id, 0)) * (1 + (req_id in lag_start)))
            return
        chunk = self.config.prefill_chunk_tokens  # a prompt still in chunks writes one a step
        for req_id, n, k, h, rest, unwritten in zip(req_ids, tokens, live, held, remaining, unprefilled):
            decode = (1 + drafts.get(req_id, 0)) * (1 + (req_id in lag_start))
            self.admission.update(req_id, logical_len=n, live=k, remaining=rest + unwritten, held=h,
                                  step_tokens=max(min(chunk, unwritten), decode) if unwritten else decode)

    def next_position(self, req_id: int) -> int:
        """RoPE position of the request's next token: its logical position in "keep" mode, its
        physical one (kv_len) in "shift" mode, where the step re-rotates the cached keys."""
        cached = self.writes.cached_tokens(req_id) + self.writes.earlier_tokens(req_id)
        if self.config.positions == "shift":
            return self.layout.kv_len(req_id) + cached
        return self.layout.num_tokens(req_id) + cached

    def release(self, req_id: int, token_ids: Callable[[int], list[int]] | None = None) -> None:
        """Returns every block of the request to the pool (keyed ones stay cached) and drops its
        state everywhere. ``token_ids`` (a request that finished): its tokens, as for
        ``store_written``; the blocks its last step filled are keyed first."""
        self._land()  # a step in flight completes first (it may hold the request)
        if token_ids is not None and req_id in self.layout:
            self.store_written([req_id], token_ids)
        blocks, pending = self.layout.remove_request(req_id), self.writes.drop(req_id)
        if self.step is not None and pending:  # not in its table row: the step's slots are emptied here
            self.step.forget_blocks(pending)
        blocks += pending
        if self.prefix is not None:
            self.prefix.end(req_id, blocks)
        else:
            self.pool.free(blocks)
        self.admission.finish(req_id)
        self.step_drafts.pop(req_id, None)
        self.lag_start.discard(req_id)
        self.evictions.release(req_id)

    def _free(self, blocks: list[int]) -> None:
        """Blocks the step released (a keyed one stays cached)."""
        if self.prefix is not None:
            self.prefix.cache.release(blocks)
        else:
            self.pool.free(blocks)

    # ---- reporting -----------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks a new allocation can get: free ones plus cached ones no request holds."""
        return self.pool.num_free + (self.prefix.cache.num_reclaimable if self.prefix else 0)

    def usage(self) -> KVUsage:
        """Blocks requests hold (cached blocks no request holds are free-able, not counted), the
        live tokens in them (a token of a shared block once) and their slots."""
        layout = self.layout
        used = self.pool.num_blocks - self.num_available
        live = sum(layout.num_live(r) for r in layout.request_ids())
        if self.prefix is not None and self.prefix.cache.shared:
            tpb = self.config.tokens_per_block
            for block_id in self.prefix.cache.shared:  # shared blocks are full of protected live tokens
                live -= (self.prefix.cache.holders(block_id) - 1) * tpb
        return KVUsage(used, live, used * self.config.tokens_per_block)

    def check_integrity(self) -> None:
        """The pool, the step's tables (I2, batch layout) and the blocks they hold agree."""
        if self.step is not None:  # blocks no request holds: free ones, cached ones nobody holds
            self.step.check_integrity([*self.pool.free_ids, *(self.prefix.cache.unheld if self.prefix else ())])
        self.pool.check_integrity()
        layout = self.layout
        held = sum(layout.num_blocks(r) for r in layout.request_ids())
        prefixes, staged = self.writes.num_blocks()
        held += prefixes
        if self.prefix is not None:
            self.prefix.cache.check_integrity()
            held += len(self.prefix.cache.key_of)  # the cache's own reference on each keyed block
        references = sum(self.pool.ref_counts)
        if held + staged != references:
            raise RuntimeError(f"leaked or double-held blocks: requests (and the prefix cache) hold {held} "
                               f"(+{staged} reserved), the pool counts {references} references")
