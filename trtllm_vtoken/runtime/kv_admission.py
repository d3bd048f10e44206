# SPDX-License-Identifier: Apache-2.0
"""The reference KV-cache manager's admission (``KVCacheManager``'s first calls for a request):
its final budget, whether it could ever fit, and its registration, with prefix caching the cached
prefix it takes, held in common or copied into blocks of its own (``EngineConfig.prefix_reuse``)."""

from __future__ import annotations

from collections.abc import Collection

from trtllm_vtoken.core import BlockPool
from trtllm_vtoken.policies import EvictionPolicy
from trtllm_vtoken.policies.request_settings import PolicySpec
from trtllm_vtoken.reclaim.admission import AdmissionConfig, AdmissionController


class KVAdmission:
    """Admission of ``KVCacheManager`` (a mixin: it reads the manager's ``config``, ``pool``,
    ``cache``, ``prefix``, ``step`` or ``lists``, ``admission``, ``writes``, ``evictions`` and
    ``_policies``, and sets ``needs_attention``, ``step_drafts``: request -> the draft tokens
    each of its decode steps may carry (only requests that draft), and ``lag_start``: the requests whose first decode step,
    deferred, is still to run, ``decode_lags``)."""

    def final_budget(self, total_tokens: int, spec: PolicySpec | None = None) -> int | None:
        """The most live tokens a request of ``total_tokens`` keeps after an eviction, on its way
        to completion (``Budget.most_kept``; None: no eviction)."""
        return None if spec is None else spec.budget.most_kept(total_tokens)

    def check_fits_alone(self, prompt_len: int, max_tokens: int, spec: PolicySpec | None = None,
                         drafts: int = 0) -> int:
        """The draft tokens each of the request's decode steps may carry: ``drafts`` where the
        request, drafting them, could run with the whole pool to itself, else 0 (it then never
        drafts; a property of the request and the pool alone, never of the batch). Raises
        ValueError if it could not run even without drafts."""
        cfg = self.config
        if prompt_len + max_tokens > cfg.max_seq_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"max_seq_len {cfg.max_seq_len}")
        usable = cfg.num_blocks - cfg.evacuation_headroom
        probe = AdmissionController(BlockPool(usable, cfg.tokens_per_block),
                                    AdmissionConfig(cfg.variant, cfg.mode, cfg.fragmentation_threshold))
        budget = self.final_budget(prompt_len + max_tokens, spec)
        lags = self.decode_lags(None if spec is None else self._policies.setdefault(spec, spec.make()))
        for allowed in dict.fromkeys((drafts, 0)):
            first, rest, step_tokens = self.prefill_shape(prompt_len, allowed, lags)
            if probe.can_admit(first, max_tokens + rest, budget, step_tokens=step_tokens):
                return allowed
        raise ValueError(f"request needs more KV blocks than the pool's {usable} usable blocks "
                         f"(prompt {prompt_len} + max_tokens {max_tokens} tokens, "
                         f"tokens_per_block {cfg.tokens_per_block})")

    def admit(self, req_id: int, token_ids: list[int], remaining: int, spec: PolicySpec | None = None,
              drafts: int = 0, in_chunks: Collection[int] = ()) -> int | None:
        """Registers the request if admission allows; its prefill writes ``token_ids``, each decode
        step 1 + ``drafts`` tokens at most (``check_fits_alone``'s). ``in_chunks``: the running
        requests whose prompts have chunks to come. Returns how many of them are cached already
        (their KV is there: prefill the rest), or None if it does not fit now (nothing changed)."""
        cfg, prefill_len = self.config, len(token_ids)
        # A private request (it may evict; prefix_reuse="copy") copies its cached prefix into
        # blocks of its own: its decisions then depend on no other request (prefix_caching.py).
        private = self.prefix is not None and spec is not None and cfg.prefix_reuse == "copy"
        # A block that an in-flight background compaction touches is not shared before it commits.
        relocating = self.step.relocating_blocks() if self.step is not None and self.prefix else set()
        busy = relocating | self.prefix.busy_for(private) if self.prefix else relocating
        if self.prefix and not private and cfg.admission == "greedy":
            busy = busy | self.held_by_evicting_prompts(in_chunks)
        policy = None if spec is None else self._policies.setdefault(spec, spec.make())
        window = None if policy is None else policy.observed_prefill_queries()
        # A policy that adds the cached prefix's attention mass to its own takes only blocks that carry
        # it (the simulated backend, without a KV cache, computes its mass from the layout instead).
        needs_payload = policy is not None and policy.observes_attention() and window is None and \
            self.cache is not None
        # Chunked prefill: a request that may evict decides after its first chunk; the cached prefix
        # it takes ends before that, as a longer one would skip the decision (prefix_caching.py).
        decides_at = None if spec is None else cfg.prefill_chunk_tokens
        cached, reclaimable = self.prefix.probe(token_ids, busy, window, needs_payload, decides_at) \
            if self.prefix else (0, 0)
        lags = self.decode_lags(policy)
        take_prefix = self._admit_blocks(req_id, prefill_len, remaining, spec, drafts, lags,
                                         0 if private else cached, reclaimable)
        # A copy keeps its cached sources out of the blocks it may take, a sharer keeps the shared
        # prefix on top of its budget: a prefix the pool cannot hold beside the request would keep
        # it waiting for ever. It prefills its whole prompt instead (a copy's tokens and decisions
        # are the same: it shares nothing either way).
        if not take_prefix and not (cached and self._admit_blocks(req_id, prefill_len, remaining, spec, drafts, lags,
                                                                  0, 0)):
            return None
        if drafts:
            self.step_drafts[req_id] = drafts
        if lags:
            self.lag_start.add(req_id)
        if self.step is not None:
            self.step.add_request(req_id, policy)
            self.needs_attention = self.needs_attention or (policy is not None and policy.observes_attention())
        else:
            self.lists.add_request(req_id)
        self.evictions.admit(req_id, "native" if spec is None else spec.name)
        if self.prefix is None:
            return 0
        blocks = self.prefix.begin(req_id, token_ids, busy, self._copy_blocks if private else None, window,
                                   needs_payload, take_prefix, decides_at)
        self.writes.add_prefix(req_id, blocks)
        return self.prefix.cached_tokens(req_id)

    def held_by_evicting_prompts(self, in_chunks: Collection[int]) -> set[int]:
        """The blocks of the requests of ``in_chunks`` (prompts with chunks to come) that may evict,
        which greedy admission does not let a newcomer share. A block shared is protected for
        each holder, on top of its budget; a prompt in chunks that cannot fit its next chunk
        beside such blocks preempts the newer prompts and then itself, and greedy admission
        (fits now) admits them together again, for ever. Its blocks may be shared again once its
        last chunk is scheduled: a decode row short of room preempts the newest request and goes
        on, so the oldest request always advances."""
        return {block for req_id in in_chunks if self.policy_of(req_id) is not None
                for block in self.writes.held_blocks(req_id)}

    def _admit_blocks(self, req_id: int, prefill_len: int, remaining: int, spec: PolicySpec | None, drafts: int,
                      lags: bool, held: int, reclaimable: int) -> bool:
        """Admission's block count for a request whose decode steps carry ``drafts`` (and lag:
        ``decode_lags``), holding
        ``held`` cached blocks in common and keeping ``reclaimable`` unheld cached blocks from
        being reclaimed (a copy's sources): True, registered with the admission controller, or
        False (nothing changed)."""
        cfg = self.config
        # A shared prefix is kept on top of the budget (its tokens are protected): count it in.
        shared = held * cfg.tokens_per_block
        budget = self.final_budget(prefill_len + remaining - shared, spec)
        budget = None if budget is None else budget + shared
        # chunked prefill: up to its first chunk's end (after a cached prefix held in common)
        first, rest, step_tokens = self.prefill_shape(prefill_len, drafts, lags, held * cfg.tokens_per_block)
        if cfg.admission == "greedy":
            free = self.pool.num_free + (self.prefix.cache.num_reclaimable - reclaimable if self.prefix else 0)
            if free - cfg.evacuation_headroom < -(-first // cfg.tokens_per_block) - held:
                return False
            self.admission.admit(req_id, first, remaining + rest, budget, force=True, cached_blocks=held,
                                 step_tokens=step_tokens)
            return True
        return self.admission.admit(req_id, first, remaining + rest, budget, cached_blocks=held,
                                    cached_reclaimable=reclaimable, step_tokens=step_tokens)

    def prefill_shape(self, prefill_len: int, drafts: int = 0, lags: bool = False,
                      cached: int = 0) -> tuple[int, int, int]:
        """(tokens the request holds after its first prefill forward, prompt tokens after it,
        most tokens one step writes before an eviction): the whole prompt at once, or its chunks
        (``EngineConfig.enable_chunked_prefill``), the first ending at the first chunk end after
        its ``cached`` prompt tokens; a decode step writes its token and ``drafts``, and where its
        first decode step lags (``decode_lags``), the next step's as well."""
        chunk, decode = self.config.prefill_chunk_tokens, (1 + drafts) * (2 if lags else 1)
        if chunk is None or prefill_len <= chunk:
            return prefill_len, 0, decode
        first = min(prefill_len, (cached // chunk + 1) * chunk)  # the scheduler's first chunk end
        return first, prefill_len - first, max(chunk, decode)

    def decode_lags(self, policy: EvictionPolicy | None) -> bool:
        """Whether a request of this policy writes two decode steps' tokens before its first
        decode eviction. The overlap scheduler defers the step of a row whose policy observes
        attention to the next iteration, after that iteration's reservation
        (``runtime/overlap.py``); its prompt, decided at once (``prefill_decision="at_once"``),
        is evicted before the first decode, so that decode's step runs after the second decode's
        slot is reserved. From then on each deferred step takes in the next forward's token too:
        one token a step again (``KVCacheManager.update``). With ``decode_decision="at_once"`` a
        decode step that may evict runs before the next reservation, as in the plain order."""
        cfg = self.config
        return (cfg.overlap_scheduler and cfg.prefill_decision == "at_once" and cfg.decode_decision == "lagged"
                and policy is not None and policy.observes_attention())

    def new_iteration(self) -> None:
        """Before an iteration's prefill forwards are scheduled (prefix caching: what earlier
        forwards wrote is readable)."""
        if self.prefix is not None:
            self.prefix.new_iteration()

    def _copy_blocks(self, source: list[int], destination: list[int]) -> None:
        if self.cache is not None:  # the simulated backend has no KV to copy
            self.cache.copy_blocks(source, destination)
