# SPDX-License-Identifier: Apache-2.0
"""``VTokenKVCacheManager``: TensorRT-LLM's ``KVCacheManager`` (PyTorch backend, V1, 1.2.1) with
vToken's token tables, policy and dense compaction.

The class is built on the base it extends (``build_manager_class(KVCacheManager)``) so that the
same code runs on the real class inside the executor worker and on the test double built from the
1.2.1 signatures in CPU tests. Overrides, in the order ``PyExecutor._executor_loop`` calls them
(``py_executor.py``; the loop's double in ``tests/integration/trtllm121``):

    _pause_requests        a paused request is freed (free_resources below)
    prepare_resources(N)   first, for the batches still in flight (the overlap loop's N-1): a
                           count-based policy's step, or an attention policy's mass enqueued behind
                           their forwards and copied to the host without blocking (mass_copy.py)
                           and, deciding at once (decode_decision), the step of the requests whose
                           tokens up to N-1's may evict, reading their rows of that copy; then
                           super (add_sequence / add_token on the physical length); the rows of
                           the recorded queries follow the batch
    ... forward N, sampling, _handle_responses: requests that finished with N are freed ...
    update_resources(N)    super; then ONE step for the requests of N still held and not stepped
                           above (finished ones are gone: a stop / EOS token or max_tokens on the
                           first token, every dummy of KvCacheCreator's estimation run at LLM()
                           start), with their tokens up to N's own (lagged: every token allocated,
                           N+1's included): the tables learn the prompts and new tokens, the
                           policy decides for all at once (prefill mass summed in the forward;
                           decode mass from the recorded queries, one pass for all decode rows
                           and one copy of the batch's [B, L] mass to the host, enqueued at the
                           next prepare when there is one), dense compaction copies every
                           request's moves in one launch on the side stream, the execution stream
                           waits on it (I3), and rewind_kv_cache returns each request's freed
                           tail before the scheduler of N+1 counts free blocks
    free_resources         drop the token table (and empty the step's slots of its prompt blocks
                           past its row: chunked prefill with block reuse), then super
    (both)                 publish vToken's counters for the Triton model's metrics (stats.py)
    add_dummy_requests     warm-up and CUDA-graph padding requests: super only; never prepared,
                           never in vToken's tables, padding rows are treated as empty

A request MAX_UTILIZATION pauses is prefilled again later, whole: TensorRT-LLM moves its generated
tokens into its prompt (``LlmRequest::pause``) and recomputes their KV. vToken treats it as a new
request: its table starts over the whole history, the policy sees that prefill's attention and
the budget applies at once, so the tokens evicted before the pause are recomputed and the policy
chooses again (a score policy from the new prefill's mass: what it had accumulated is gone).

Admission is TensorRT-LLM's own: 1.2's executor schedules with the C++ capacity scheduler over
``impl`` (``BindCapacityScheduler(..., kv_cache_manager.impl, ...)``), which never calls a Python
override. It counts the free blocks the C++ manager holds, so the blocks vToken's rewinds returned
are there for the next iteration's admission; and it counts each request's next block from its
logical length (``getNeededBlocksOneStep``), which is exact because every request gives tokens up
a whole block at a time (``state.make_step``: its physical length stays congruent modulo the block).

Under tensor / pipeline parallelism every rank's manager runs the same step: the mass is summed
over the ranks before scoring and, with ``check_invariants``, the table digests are compared
after it (``ranks.py``, ``trtllm_vtoken.consistency``). The LLM arguments' check refuses pipeline
parallelism for now (``settings.py``: TensorRT-LLM's pipeline-parallel loop never pauses what
MAX_UTILIZATION pauses).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trtllm_vtoken.consistency import RankConsistency
from trtllm_vtoken.integration.trtllm.arming import RECORD_KEY, worker_record
from trtllm_vtoken.integration.trtllm.batches import PreparedBatches
from trtllm_vtoken.integration.trtllm.pools import layer_offsets, manager_pools
from trtllm_vtoken.integration.trtllm.ranks import parallel_layout_problem, worker_ranks
from trtllm_vtoken.integration.trtllm.manager_mass import ManagerMass
from trtllm_vtoken.integration.trtllm.mass_copy import StreamMarks
from trtllm_vtoken.integration.trtllm.scores import QueryRecorder
from trtllm_vtoken.integration.trtllm.settings import VTokenSettings
from trtllm_vtoken.integration.trtllm.state import VTokenState
from trtllm_vtoken.integration.trtllm.stats import StatsFile, state_snapshot
from trtllm_vtoken.reclaim.upload import to_device


def check_parallel_layout(mapping: Any, settings: VTokenSettings) -> None:
    """ValueError for a parallel layout vToken does not support (``ranks.parallel_layout_problem``).
    Tensor and pipeline parallelism are supported with every policy: attention mass is summed over
    the ranks before scoring (``ranks.py``), position policies and Random decide alike by
    construction (Random is seeded per request id, which every rank shares)."""
    problem = parallel_layout_problem(mapping)
    if problem:
        raise ValueError(f"vToken ({settings.policy}): {problem}")


def build_manager_class(base: type) -> type:
    """``VTokenKVCacheManager`` over ``base`` (TensorRT-LLM's ``KVCacheManager``)."""

    class VTokenKVCacheManager(ManagerMass, base):
        def __init__(self, kv_cache_config, kv_cache_type, *args, vtoken_settings: VTokenSettings | None = None,
                     **kwargs) -> None:
            self._vtoken_reuse = bool(getattr(kv_cache_config, "enable_block_reuse", False))
            if kwargs.get("max_beam_width", 1) != 1:
                raise ValueError("vToken needs max_beam_width=1")
            settings = vtoken_settings or VTokenSettings.from_env()  # RuntimeError if none were sent
            check_parallel_layout(kwargs.get("mapping"), settings)
            if settings.positions != "keep":
                raise ValueError("the PyTorch backend runs positions='keep' (unfused RoPE, logical position ids); "
                                 "positions='shift' is for the trtllm-build engine path (engine_runner)")
            super().__init__(kv_cache_config, kv_cache_type, *args, **kwargs)
            pools = manager_pools(self)
            self._vtoken_local = layer_offsets(self)
            # A decoding request holds a block at least and decodes one token and its draft tokens
            # (speculative decoding): no batch has more decode queries than max_batch_size rows of
            # them, the pool's blocks or max_num_tokens allow.
            drafts = getattr(kwargs.get("spec_config"), "max_total_draft_tokens", None) or 0
            decode_rows = min(min(kwargs.get("max_batch_size", 1), pools[0].shape[0]) * (1 + drafts),
                              kwargs.get("max_num_tokens", 8192))
            self._vtoken_cap = settings.mass_workspace_mib << 20
            self._vtoken_stream = StreamMarks(pools[0].device)
            self.vtoken_queries = QueryRecorder(decode_rows, len(self.kv_cache_pool_mapping), pools[0].shape[5],
                                                pools[0].device, settings.make_policy().observed_prefill_queries(),
                                                self._vtoken_cap)
            self._vtoken_held: set[int] = set()  # requests prepared and not freed since
            self._vtoken_steps = 0
            self.vtoken_consistency = RankConsistency(worker_ranks(kwargs.get("mapping")))
            self._vtoken_prefix: dict[int, list[int]] = {}  # request -> its reusable prompt blocks
            self._vtoken_shared: frozenset[int] = frozenset()
            self.vtoken = VTokenState(settings, self.tokens_per_block, pools[0].shape[0], pools,
                                      self._vtoken_batch_mass, reduce_mass=self.vtoken_consistency.reduce_mass,
                                      shared_blocks=(lambda: self._vtoken_shared) if self._vtoken_reuse else None)
            self._vtoken_batches = PreparedBatches(self.vtoken_queries, self.vtoken.needs_attention)
            self.vtoken_stats = StatsFile(settings.stats_file, settings.stats_interval_s) \
                if settings.stats_file else None
            self._vtoken_publish(force=True)  # the worker's record: vToken armed here (arming.py)

        # ---- iteration hooks -----------------------------------------------------------------
        def prepare_resources(self, scheduled_batch) -> None:
            # A policy that decides from counts needs nothing of a forward: the batches whose
            # forwards were launched and not yet updated (the overlap loop's batch N, when
            # _executor_loop_overlap prepares N+1 before _forward_step(N+1) and update_resources(N))
            # take their step now, before add_token places this batch's tokens, so this batch's
            # forward reads the compacted layout: no lag, the plain loop's decisions. (In the plain
            # loop update_resources has stepped them already: nothing is left to do here.)
            # A policy that observes attention: the batches in flight get their mass enqueued now,
            # behind their forwards and before this batch's, so that their updates wait for it and
            # not for this batch's forward (mass_copy.py). With decode_decision="at_once" their
            # requests whose step may evict take it now, from that mass (the host waits for their
            # own batch's forward): this batch's forward reads the plain loop's layout. The others
            # evict nothing: their update, without this batch's token, runs beside it.
            # A prompt chunk that is not its prompt's last (chunked prefill) takes its step now
            # with any policy: its next chunk, in this batch, must be written after the compacted
            # layout of the ones before it (the host waits for that batch's forward, as the plain
            # loop does; not for this one's). Only those requests: the batch's other rows keep the
            # order they have without chunks, so no request decides otherwise for what runs beside it.
            for prepared in self._vtoken_batches.in_flight():
                if not self.vtoken.needs_attention:
                    self._vtoken_step(prepared, through_only=True)
                    prepared.stepped.update(prepared.through)
                    continue
                now = prepared.continuing() - prepared.stepped
                if now:
                    self._vtoken_step(prepared, through_only=True, only=now)
                    prepared.stepped.update(now)
                if prepared.mass is None:
                    self._vtoken_enqueue_mass(prepared)
                evicting = self._vtoken_may_evict(prepared) if self.vtoken.settings.decode_decision == "at_once" \
                    else None
                if evicting:
                    self._vtoken_step(prepared, through_only=False, only=evicting)
                    prepared.stepped.update(evicting)
            super().prepare_resources(scheduled_batch)
            self._vtoken_held.update(r.py_request_id for r in scheduled_batch.all_requests())
            self._vtoken_batches.prepared(scheduled_batch)

        def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None) -> None:
            super().update_resources(scheduled_batch, attn_metadata, kv_cache_dtype_byte_size)
            prepared = self._vtoken_batches.take(scheduled_batch)
            # Speculative decoding: super() rewound each decode row's rejected draft tokens
            # (``py_rewind_len``, for the requests neither complete nor paused back to context):
            # the table never learns them, nor does their queries' mass reach the policy.
            for req in scheduled_batch.generation_requests:
                rewind = getattr(req, "py_rewind_len", 0)
                if rewind > 0 and req.py_request_id in self._vtoken_held and \
                        req.state.name not in ("GENERATION_COMPLETE", "CONTEXT_INIT"):
                    self._vtoken_batches.rewound(prepared, req.py_request_id, rewind)
            # Count-based policies, and observing ones deciding at once, take in the tokens up to
            # this batch's own only (a later batch's were or will be taken in by its successor's
            # step): so a step here never counts the next batch's token, and evicts nothing where
            # prepare_resources found that this batch's tokens alone evict nothing.
            self._vtoken_step(prepared, through_only=not self.vtoken.needs_attention or
                              self.vtoken.settings.decode_decision == "at_once")
            self._vtoken_publish(force=False)

        def _vtoken_step(self, prepared, through_only: bool, only: set[int] | None = None) -> None:
            """One step for the batch's requests. The executor loop frees the requests that
            finished with a batch (_handle_responses, a stop or EOS token, max_tokens reached:
            KvCacheCreator's estimation requests finish on their first token) BEFORE it calls
            update_resources with the whole batch: those are gone from TensorRT-LLM's manager and
            from vToken's tables, and are skipped. Without ``through_only`` (attention-observing
            policies deciding lagged) a step takes in every token TensorRT-LLM allocated for a
            request: under the overlap loop that includes the token the next batch's forward
            (already launched) writes, so the plan counts its slot as taken; the decode queries of
            this batch attended to the tokens up to its own (``through``). ``through_only``: only
            those, and requests with none new are skipped.
            ``only``: these requests of the batch; the batch's requests stepped already are left out."""
            scheduled_batch, step = prepared.batch, self.vtoken.step
            written = self._vtoken_written(prepared, through_only, only)
            if self._vtoken_reuse:
                blocks_of = {req_id: blocks for req_id, blocks, _, _ in written}
                self._vtoken_share_prompts([(r.py_request_id, blocks_of[r.py_request_id], r.prompt_len)
                                            for r in scheduled_batch.context_requests if r.py_request_id in blocks_of])
            executor = step.executor
            stream = torch.cuda.current_stream() if executor is not None and executor.device.type == "cuda" else None
            out = self.vtoken.run(written, stream, prepared)
            if out is not None:
                for req_id, lost in zip(out.req_ids.tolist(), out.lost.tolist()):
                    if lost:
                        self._vtoken_release(req_id, lost)
                self._vtoken_steps += 1
                if self.vtoken.settings.check_invariants:  # every rank's table, after the same step
                    self.vtoken_consistency.check(self._vtoken_steps, step, [self.get_num_free_blocks()])

        def free_resources(self, request, pin_on_release: bool = False) -> None:
            req_id = request.py_request_id
            self._vtoken_held.discard(req_id)
            self._vtoken_batches.forget(req_id)
            changed = self.vtoken.num_evicted(req_id) > 0
            # Its prompt blocks stop being shared on its account first: the step empties the slots
            # of the blocks no other running request holds (TensorRT-LLM may hand them out again).
            prefix = self._vtoken_prefix.pop(req_id, None)
            if prefix is not None:
                self._vtoken_shared = frozenset(b for blocks in self._vtoken_prefix.values() for b in blocks)
            step = self.vtoken.step
            past_row = [] if not prefix else sorted(set(prefix) - set(step.block_ids(req_id)))
            self.vtoken.forget(req_id)
            # Chunked prefill: its prompt blocks past its row, allocated ahead and stored for reuse
            # before its later chunks ran, may carry the slots of a request that reused them and
            # left while they were shared on this one's account. The row's were emptied above;
            # these are now, but for those another request holds.
            if past_row:
                step.forget_blocks(past_row)
            if self._vtoken_reuse and changed:
                # Its blocks past the prompt no longer hold what its tokens say: release them
                # unstored (BlockManager::releaseBlocks stores for reuse only when given the request).
                self.impl.remove_sequence(req_id, None, pin_on_release)
            else:
                super().free_resources(request, pin_on_release)
            self._vtoken_publish(force=True)  # gauges must not keep a finished request

        # ---- vToken's view -------------------------------------------------------------------
        def local_layer(self, layer_idx: int) -> int:
            """This rank's index of the model's global layer ``layer_idx``."""
            try:
                return self._vtoken_local[layer_idx]
            except KeyError:
                raise RuntimeError(f"layer {layer_idx} is not held by this rank (its layers: "
                                   f"{sorted(self._vtoken_local)})") from None

        def vtoken_cached_keys(self, request_id: int, layer_idx: int, count: int) -> torch.Tensor:
            """The keys of the request's first ``count`` positions in the model's layer
            ``layer_idx``, read from this rank's pool through its block list: [count, kv_heads,
            head_dim] (HND inside a block)."""
            pool_index, index = self.kv_cache_pool_mapping[self.local_layer(layer_idx)].tolist()
            pool = self.vtoken.step.executor.pools[pool_index]  # [blocks, layers, kv, H, tpb, D]
            blocks = self.get_batch_cache_indices([request_id])[0]
            positions = np.arange(count)
            ids = np.asarray(blocks, dtype=np.int64)[positions // self.tokens_per_block]
            # during the forward: uploads that do not wait for the stream (upload.py)
            return pool[to_device(ids, torch.int64, pool.device), index, 0, :,
                        to_device(positions % self.tokens_per_block, torch.int64, pool.device)]

        def vtoken_evicted(self, request_id: int) -> int:
            """Logical minus physical tokens of a request (0 for unknown and padding rows)."""
            return self.vtoken.num_evicted(request_id)

        def vtoken_prompt_len(self, request_id: int, prompt_len: int) -> int:
            """Prompt tokens still in the request's physical KV (``prompt_len`` if unknown)."""
            return self.vtoken.prompt_tokens_held(request_id, prompt_len)

        def _vtoken_publish(self, force: bool) -> None:
            if self.vtoken_stats is not None:
                self.vtoken_stats.maybe_write(
                    lambda: {**state_snapshot(self.vtoken, self.get_num_free_blocks(), self.get_max_resource_count()),
                             RECORD_KEY: worker_record("vtoken", self.vtoken.settings, base.__module__,
                                                       manager=type(self).__qualname__,
                                                       steps=self._vtoken_steps,
                                                       requests_seen=self.vtoken.requests_seen)},
                    force)

        def _vtoken_release(self, req_id: int, num_tokens: int) -> None:
            """TensorRT-LLM drops the request's last ``num_tokens`` tokens and the blocks they leave
            empty; its block list must then begin with vToken's and hold no more than the table's
            tokens and those allocated ahead, or KV would be corrupted.

            Allocated ahead are the prompt tokens of chunks still to come (chunked prefill:
            ``add_sequence`` took the whole prompt's blocks at the first chunk). TensorRT-LLM
            rewinds from the end of its list, so the blocks it lets go are the last ones, never
            written; the table's freed tail stays in its list, as blocks the next chunks write::

                before   [ table's blocks (live | freed tail) | allocated ahead        ]
                after    [ table's blocks (live)  | freed tail , allocated ahead - lost ]
            """
            step = self.vtoken.step
            self.rewind_kv_cache(_RequestRef(req_id), num_tokens)
            held, mine = list(self.get_cache_indices(_RequestRef(req_id))), step.block_ids(req_id)
            ahead = self._vtoken_batches.reserved.get(req_id, 0) - step.num_tokens(req_id)
            want = -(-(step.kv_len(req_id) + max(ahead, 0)) // self.tokens_per_block)
            if held[: len(mine)] != mine or len(held) != want:
                raise RuntimeError(f"TensorRT-LLM holds blocks {held} for request {req_id} after rewinding "
                                   f"{num_tokens} tokens, vToken {mine} and {max(ahead, 0)} tokens allocated ahead")

        def vtoken_prompt_after(self, request_id: int) -> int:
            """Prompt tokens after the chunk the forward in progress computes for the request (0
            without chunked prefill, or for a decode row)."""
            return self._vtoken_batches.prompt_after(request_id)

        def _vtoken_share_prompts(self, written) -> None:
            """Block reuse: the blocks that are or may become reusable while a request runs are its
            prompt's full blocks -- recovered from the reuse tree by ``add_sequence`` (shared with
            other requests) or stored into it by ``store_context_blocks`` after the context step
            (the full blocks of the prompt and the first sampled token, ``len(tokens) - 1``). vToken
            leaves them as they are: no move into or out of them, no eviction of their tokens."""
            for req_id, blocks, prompt_len in written:
                self._vtoken_prefix[req_id] = list(blocks[: prompt_len // self.tokens_per_block])
            self._vtoken_shared = frozenset(b for blocks in self._vtoken_prefix.values() for b in blocks)

    VTokenKVCacheManager.__qualname__ = f"VTokenKVCacheManager[{base.__name__}]"
    return VTokenKVCacheManager


class _RequestRef:
    """What ``rewind_kv_cache`` / ``get_cache_indices`` read of a request: its id."""

    def __init__(self, req_id: int) -> None:
        self.py_request_id = req_id
