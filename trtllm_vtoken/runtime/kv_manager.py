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
    set_batch(rows)            rewrite block_offsets / kv_lens in place (+ the validity mask;
                               the step calls: ``kv_step_calls.py``)
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

from collections.abc import Callable

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
from trtllm_vtoken.runtime.kv_step_calls import KVStepCalls
from trtllm_vtoken.runtime.kv_stats import EvictionCounter, KVStats, KVUsage
from trtllm_vtoken.runtime.model import LlamaConfig
from trtllm_vtoken.runtime.pending_writes import PendingWrites
from trtllm_vtoken.runtime.prefix_caching import PrefixCaching
from trtllm_vtoken.step import DecodeStep, StepOutput, StepStats


class KVCacheManager(KVAdmission, KVPrefixCalls, KVStepCalls):
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
