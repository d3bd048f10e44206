# SPDX-License-Identifier: Apache-2.0
"""``VTokenKVCacheManager``: TensorRT-LLM's ``KVCacheManager`` (PyTorch backend, V1, 1.2.1) with
vToken's token tables, policy and dense compaction.

The class is built on the base it extends (``build_manager_class(KVCacheManager)``) so that the
same code runs on the real class inside the executor worker and on the test double built from the
1.2.1 signatures in CPU tests. Overrides, in the order an iteration calls them (hooks.md §9):

    prepare_resources(N)   super (add_sequence / add_token on the physical length); the rows of the
                           recorded queries follow the batch
    update_resources(N)    super; then ONE step for the batch (``VTokenState.run``): the tables
                           learn the prompts and new tokens, the policy decides for all at once
                           (prefill mass summed in the forward; decode mass from the recorded
                           queries, one padded pass for all decode rows and one copy of the
                           batch's [B, L] mass to the host), dense compaction copies every
                           request's moves in one launch on the side stream, the execution
                           stream waits on it (I3), and
                           rewind_kv_cache returns each request's freed tail before the scheduler
                           of N+1 counts free blocks
    free_resources         drop the token table, then super
    (both)                 publish vToken's counters for the Triton model's metrics (stats.py)
    add_dummy_requests     CUDA-graph padding requests: super only; vToken treats them as empty
    get_needed_resource_to_completion   the reference runtime's admission demand (budget-aware)

Under tensor / pipeline parallelism every rank's manager runs the same step: the mass is summed
over the ranks before scoring and, with ``check_invariants``, the table digests are compared
after it (``ranks.py``, ``trtllm_vtoken.consistency``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trtllm_vtoken.consistency import RankConsistency
from trtllm_vtoken.integration.trtllm.arming import RECORD_KEY, worker_record
from trtllm_vtoken.integration.trtllm.ranks import parallel_layout_problem, worker_ranks
from trtllm_vtoken.integration.trtllm.scores import QueryRecorder, batch_decode_attention_mass
from trtllm_vtoken.integration.trtllm.settings import VTokenSettings
from trtllm_vtoken.integration.trtllm.state import VTokenState
from trtllm_vtoken.integration.trtllm.stats import StatsFile, state_snapshot


def layer_offsets(manager: Any) -> dict[int, int]:
    """The manager's global layer id -> local layer index (``KVCacheManager.layer_offsets``: with
    pipeline parallelism a rank holds only its own layers, ``pp_layers``; ``get_buffers`` takes the
    global id, ``kv_cache_pool_mapping`` rows are local)."""
    offsets = getattr(manager, "layer_offsets", None)
    if offsets is None:
        return {layer: layer for layer in range(len(manager.kv_cache_pool_mapping))}
    return dict(offsets)


def manager_pools(manager: Any) -> list[torch.Tensor]:
    """The manager's primary pools as 6-D HND tensors ``[blocks, layers_in_pool, kv_factor,
    num_kv_heads, tokens_per_block, head_dim]``, built as views from each pool's first layer
    (``get_buffers(layer, kv_layout="HND")`` is that layer's slice of the pool)::

        kv_cache_pool_mapping[local] = (pool, index in pool)     local = layer_offsets[global]
        get_buffers(global of the pool's first local layer)  ->  [P, kv, H, tpb, D]  -> 6-D view
    """
    mapping = manager.kv_cache_pool_mapping.tolist()  # [num_local_layers, 2]: (pool, layer in pool)
    global_of = {local: layer for layer, local in layer_offsets(manager).items()}
    first_layer: dict[int, int] = {}
    layers_in_pool: dict[int, int] = {}
    for local, (pool, index) in enumerate(mapping):
        layers_in_pool[pool] = max(layers_in_pool.get(pool, 0), index + 1)
        if index == 0:
            first_layer[pool] = global_of[local]
    views = []
    for pool in sorted(first_layer):
        layer = manager.get_buffers(first_layer[pool], kv_layout="HND")  # [P, kv, H, tpb, D]
        pages, kv, heads, tpb, dim = layer.shape
        half = heads * tpb * dim
        view = layer.as_strided((pages, layers_in_pool[pool], kv, heads, tpb, dim),
                                (layer.stride(0), kv * half, half, tpb * dim, dim, 1))
        if layer.stride(0) != layers_in_pool[pool] * kv * half:
            raise RuntimeError("unexpected KV pool layout: blocks are not [layers, K/V, heads, tokens, dim]")
        views.append(view)
    return views


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

    class VTokenKVCacheManager(base):
        def __init__(self, kv_cache_config, kv_cache_type, *args, vtoken_settings: VTokenSettings | None = None,
                     **kwargs) -> None:
            if getattr(kv_cache_config, "enable_partial_reuse", False) and \
                    getattr(kv_cache_config, "enable_block_reuse", False):
                raise ValueError("vToken needs kv_cache_config.enable_partial_reuse=False (a partly matched block "
                                 "is taken over and rewritten, which the shared-prefix rule does not cover)")
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
            self.vtoken_queries = QueryRecorder(kwargs.get("max_batch_size", 1), len(self.kv_cache_pool_mapping),
                                                pools[0].shape[5], pools[0].device)
            self._vtoken_rows: dict[int, int] = {}
            self._vtoken_num_contexts = 0
            self._vtoken_parked: dict[int, tuple[str, torch.Tensor | None]] = {}
            self._vtoken_steps = 0
            self.vtoken_consistency = RankConsistency(worker_ranks(kwargs.get("mapping")))
            self._vtoken_prefix: dict[int, list[int]] = {}  # request -> its reusable prompt blocks
            self._vtoken_shared: frozenset[int] = frozenset()
            self.vtoken = VTokenState(settings, self.tokens_per_block, pools[0].shape[0], pools,
                                      self._vtoken_batch_mass, reduce_mass=self.vtoken_consistency.reduce_mass,
                                      shared_blocks=(lambda: self._vtoken_shared) if self._vtoken_reuse else None)
            self.vtoken_stats = StatsFile(settings.stats_file, settings.stats_interval_s) \
                if settings.stats_file else None
            self._vtoken_publish(force=True)  # the worker's record: vToken armed here (arming.py)

        # ---- iteration hooks -----------------------------------------------------------------
        def prepare_resources(self, scheduled_batch) -> None:
            super().prepare_resources(scheduled_batch)
            if self._vtoken_rows and self.vtoken.needs_attention:
                self._vtoken_park()
            # Rows of the recorded queries follow the batch order: context first, then generation.
            rows = [r.py_request_id for r in scheduled_batch.context_requests + scheduled_batch.generation_requests]
            self._vtoken_rows = {req_id: i for i, req_id in enumerate(rows)}
            self._vtoken_num_contexts = len(scheduled_batch.context_requests)
            self.vtoken_queries.start_batch()

        def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None) -> None:
            super().update_resources(scheduled_batch, attn_metadata, kv_cache_dtype_byte_size)
            # Prompts too: the policy sees their prefill attention and may evict before decoding.
            written = [(r.py_request_id, self.get_cache_indices(r), r.prompt_len)
                       for r in scheduled_batch.context_requests]
            if self._vtoken_reuse:
                self._vtoken_share_prompts(written)
            written += [(r.py_request_id, self.get_cache_indices(r), 1) for r in scheduled_batch.generation_requests
                        if r.py_request_id in self.vtoken.step]
            executor = self.vtoken.step.executor
            stream = torch.cuda.current_stream() if executor is not None and executor.device.type == "cuda" else None
            out = self.vtoken.run(written, stream)
            if out is not None:
                for req_id, lost in zip(out.req_ids.tolist(), out.lost.tolist()):
                    if lost:
                        self._vtoken_release(req_id, lost)
                self._vtoken_steps += 1
                if self.vtoken.settings.check_invariants:  # every rank's table, after the same step
                    self.vtoken_consistency.check(self._vtoken_steps, self.vtoken.step, [self.get_num_free_blocks()])
            for request in scheduled_batch.context_requests + scheduled_batch.generation_requests:
                self._vtoken_rows.pop(request.py_request_id, None)  # consumed
                self._vtoken_parked.pop(request.py_request_id, None)
            self._vtoken_publish(force=False)

        def free_resources(self, request, pin_on_release: bool = False) -> None:
            req_id = request.py_request_id
            changed = self.vtoken.num_evicted(req_id) > 0
            self.vtoken.forget(req_id)
            if self._vtoken_prefix.pop(req_id, None) is not None:
                self._vtoken_shared = frozenset(b for blocks in self._vtoken_prefix.values() for b in blocks)
            if self._vtoken_reuse and changed:
                # Its blocks past the prompt no longer hold what its tokens say: release them
                # unstored (BlockManager::releaseBlocks stores for reuse only when given the request).
                self.impl.remove_sequence(req_id, None, pin_on_release)
            else:
                super().free_resources(request, pin_on_release)
            self._vtoken_publish(force=True)  # gauges must not keep a finished request

        def get_needed_resource_to_completion(self, request) -> int:
            # Block reuse protects the prompt's full blocks: their tokens are kept on top of the budget.
            protected = request.prompt_len // self.tokens_per_block * self.tokens_per_block if self._vtoken_reuse else 0
            return self.vtoken.needed_blocks(request.py_request_id, request.prompt_len, request.max_new_tokens,
                                             protected)

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
            positions = torch.arange(count)
            ids = torch.as_tensor(blocks, dtype=torch.long)[positions // self.tokens_per_block]
            return pool[ids.to(pool.device), index, 0, :, (positions % self.tokens_per_block).to(pool.device)]

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
            """TensorRT-LLM drops the request's last ``num_tokens`` physical tokens and the blocks
            they leave empty; its block list must then be vToken's, or KV would be corrupted."""
            self.rewind_kv_cache(_RequestRef(req_id), num_tokens)
            held = list(self.get_cache_indices(_RequestRef(req_id)))
            if held != self.vtoken.step.block_ids(req_id):
                raise RuntimeError(f"TensorRT-LLM holds blocks {held} for request {req_id} after rewinding "
                                   f"{num_tokens} tokens, vToken {self.vtoken.step.block_ids(req_id)}")

        def _vtoken_share_prompts(self, written) -> None:
            """Block reuse: the blocks that are or may become reusable while a request runs are its
            prompt's full blocks -- recovered from the reuse tree by ``add_sequence`` (shared with
            other requests) or stored into it by ``store_context_blocks`` after the context step
            (the full blocks of the prompt and the first sampled token, ``len(tokens) - 1``). vToken
            leaves them as they are: no move into or out of them, no eviction of their tokens."""
            for req_id, blocks, prompt_len in written:
                self._vtoken_prefix[req_id] = list(blocks[: prompt_len // self.tokens_per_block])
            self._vtoken_shared = frozenset(b for blocks in self._vtoken_prefix.values() for b in blocks)

        def _vtoken_park(self) -> None:
            """The batch prepared last is still in flight while the next one is prepared (pipeline
            parallelism: ``PyExecutor._executor_loop_pp`` prepares and forwards batch N+1 before it
            calls ``update_resources(N)``), and the next forward overwrites the recorder. Its
            requests' recordings are kept per request until their update: decode queries copied on
            the stream (after forward N, before forward N+1), prefill mass as it is."""
            recorder = self.vtoken_queries
            for req_id, row in self._vtoken_rows.items():
                if row < self._vtoken_num_contexts:
                    self._vtoken_parked[req_id] = ("prefill", recorder.prefill.get(row))
                elif recorder.q is not None:
                    self._vtoken_parked[req_id] = ("decode", recorder.q[row - self._vtoken_num_contexts].clone())
            self._vtoken_rows = {}

        def _vtoken_batch_mass(self, rows: list[tuple[int, int, list[int]]]) -> np.ndarray:
            """The batch's mass [B, max kv_len] float32, zero past each row's kv_len, for rows
            (request id, kv_len, block ids): a prompt's as the forward summed it, the decode rows'
            recomputed from their queries for all of them at once (one pass per pool), and one
            copy to the host for the whole batch."""
            pools = self.vtoken.step.executor.pools
            out = torch.zeros(len(rows), max(kv_len for _, kv_len, _ in rows), dtype=torch.float32,
                              device=pools[0].device)
            decode: list[tuple[int, torch.Tensor]] = []  # (row in out, the request's queries)
            for i, (req_id, kv_len, _) in enumerate(rows):
                kind, recorded = self._vtoken_recording(req_id)
                if kind == "decode":
                    decode.append((i, recorded))
                elif recorded is not None:  # a prompt: its mass was summed during the forward
                    part = recorded[:kv_len]
                    out[i, : len(part)] = part
            if decode:
                index = [i for i, _ in decode]
                q = torch.stack([recorded for _, recorded in decode])  # [Bd, local layers, heads, dim]
                blocks, kv_lens = [rows[i][2] for i in index], [rows[i][1] for i in index]
                mapping = self.kv_cache_pool_mapping.tolist()  # [local layers, 2]: (pool, layer in pool)
                for pool_index, pool in enumerate(pools):  # a pool per num_kv_heads
                    local = [layer for layer, (p, _) in enumerate(mapping) if p == pool_index]
                    part = batch_decode_attention_mass(q[:, local], pool, blocks, kv_lens,
                                                       [mapping[layer][1] for layer in local])
                    out[index, : part.shape[1]] += part
            return out.cpu().numpy()

        def _vtoken_recording(self, req_id: int) -> tuple[str, torch.Tensor | None]:
            """What the forward recorded for a request: ("prefill", its prompt's mass or None) or
            ("decode", its queries [local layers, heads, dim]), parked or in the recorder."""
            parked = self._vtoken_parked.get(req_id)
            if parked is not None:
                return parked
            row = self._vtoken_rows.get(req_id)
            if row is None:
                raise RuntimeError(f"request {req_id} is updated but was not in a prepared batch")
            if row < self._vtoken_num_contexts:
                return "prefill", self.vtoken_queries.prefill.get(row)
            return "decode", self.vtoken_queries.q[row - self._vtoken_num_contexts]

    VTokenKVCacheManager.__qualname__ = f"VTokenKVCacheManager[{base.__name__}]"
    return VTokenKVCacheManager


class _RequestRef:
    """What ``rewind_kv_cache`` / ``get_cache_indices`` read of a request: its id."""

    def __init__(self, req_id: int) -> None:
        self.py_request_id = req_id
