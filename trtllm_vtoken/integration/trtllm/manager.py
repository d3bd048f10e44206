# SPDX-License-Identifier: Apache-2.0
"""``VTokenKVCacheManager``: TensorRT-LLM's ``KVCacheManager`` (PyTorch backend, V1, 1.2.1) with
vToken's token tables, policy and dense compaction.

The class is built on the base it extends (``build_manager_class(KVCacheManager)``) so that the
same code runs on the real class inside the executor worker and on the test double built from the
1.2.1 signatures in CPU tests. Overrides, in the order an iteration calls them (hooks.md §9):

    update_resources(N)    super; the policy marks dead tokens of the prompts just prefilled and of
                           the decoded requests (prefill mass summed in the forward; decode mass
                           from the recorded queries)
    prepare_resources(N+1) dense compaction of every generation request on the side stream,
                           rewind_kv_cache of the freed tail (before super, so add_token allocates
                           against the physical length), super, then the tables learn the new
                           token / prompt; the execution stream waits on the copy events (I3)
    free_resources         drop the token table, then super
    (both)                 publish vToken's counters for the Triton model's metrics (stats.py)
    add_dummy_requests     CUDA-graph padding requests: super only; vToken treats them as empty
    get_needed_resource_to_completion   budget-aware (used by Python capacity schedulers)
"""

from __future__ import annotations

from typing import Any

import torch

from trtllm_vtoken.integration.trtllm.scores import QueryRecorder, decode_attention_mass
from trtllm_vtoken.integration.trtllm.settings import VTokenSettings
from trtllm_vtoken.integration.trtllm.state import VTokenState
from trtllm_vtoken.integration.trtllm.stats import StatsFile, state_snapshot


def manager_pools(manager: Any) -> list[torch.Tensor]:
    """The manager's primary pools as 6-D HND tensors ``[blocks, layers_in_pool, kv_factor,
    num_kv_heads, tokens_per_block, head_dim]``, built as views from each pool's first layer
    (``get_buffers(layer, kv_layout="HND")`` is that layer's slice of the pool)."""
    mapping = manager.kv_cache_pool_mapping.tolist()  # [num_layers, 2]: (pool, layer in pool)
    first_layer: dict[int, int] = {}
    layers_in_pool: dict[int, int] = {}
    for layer, (pool, index) in enumerate(mapping):
        layers_in_pool[pool] = max(layers_in_pool.get(pool, 0), index + 1)
        if index == 0:
            first_layer[pool] = layer
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


def build_manager_class(base: type) -> type:
    """``VTokenKVCacheManager`` over ``base`` (TensorRT-LLM's ``KVCacheManager``)."""

    class VTokenKVCacheManager(base):
        def __init__(self, kv_cache_config, kv_cache_type, *args, vtoken_settings: VTokenSettings | None = None,
                     **kwargs) -> None:
            if getattr(kv_cache_config, "enable_block_reuse", False):
                raise ValueError("vToken needs kv_cache_config.enable_block_reuse=False")
            if kwargs.get("max_beam_width", 1) != 1:
                raise ValueError("vToken needs max_beam_width=1")
            super().__init__(kv_cache_config, kv_cache_type, *args, **kwargs)
            settings = vtoken_settings or VTokenSettings.from_env()
            if settings.positions != "keep":
                raise ValueError("the PyTorch backend runs positions='keep' (unfused RoPE, logical position ids); "
                                 "positions='shift' is for the trtllm-build engine path (engine_runner)")
            pools = manager_pools(self)
            self.vtoken_queries = QueryRecorder(kwargs.get("max_batch_size", 1), len(self.kv_cache_pool_mapping),
                                                pools[0].shape[5], pools[0].device)
            self._vtoken_rows: dict[int, int] = {}
            self._vtoken_num_contexts = 0
            self.vtoken = VTokenState(settings, self.tokens_per_block, pools, self._vtoken_mass)
            self.vtoken_stats = StatsFile(settings.stats_file, settings.stats_interval_s) \
                if settings.stats_file else None

        # ---- iteration hooks -----------------------------------------------------------------
        def prepare_resources(self, scheduled_batch) -> None:
            generation = [r.py_request_id for r in scheduled_batch.generation_requests]
            stream = torch.cuda.current_stream() if self.vtoken.backend.executor and \
                self.vtoken.backend.executor.device.type == "cuda" else None
            self.vtoken.compact(generation, self._vtoken_release, stream)
            super().prepare_resources(scheduled_batch)
            for request in scheduled_batch.context_requests:
                self.vtoken.sync(request.py_request_id, self.get_cache_indices(request), request.prompt_len)
            for request in scheduled_batch.generation_requests:
                req_id = request.py_request_id
                if req_id in self.vtoken.table:
                    self.vtoken.sync(req_id, self.get_cache_indices(request), self.vtoken.table.kv_len(req_id) + 1)
            # Rows of the recorded queries follow the batch order: context first, then generation.
            rows = [r.py_request_id for r in scheduled_batch.context_requests] + generation
            self._vtoken_rows = {req_id: i for i, req_id in enumerate(rows)}
            self._vtoken_num_contexts = len(scheduled_batch.context_requests)
            self.vtoken_queries.start_batch()

        def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None) -> None:
            super().update_resources(scheduled_batch, attn_metadata, kv_cache_dtype_byte_size)
            # Prompts too: the policy sees their prefill attention and may evict before decoding.
            self.vtoken.after_forward([r.py_request_id for r in scheduled_batch.context_requests]
                                      + [r.py_request_id for r in scheduled_batch.generation_requests])
            self._vtoken_publish(force=False)

        def free_resources(self, request, *args, **kwargs) -> None:
            self.vtoken.forget(request.py_request_id)
            super().free_resources(request, *args, **kwargs)
            self._vtoken_publish(force=True)  # gauges must not keep a finished request

        def get_needed_resource_to_completion(self, request) -> int:
            total = request.prompt_len + request.max_new_tokens
            live = self.vtoken.final_live_tokens(total)
            held = len(self.vtoken.table.block_ids(request.py_request_id)) if request.py_request_id in \
                self.vtoken.table else 0
            return max(-(-live // self.tokens_per_block) + 1 - held, 0)  # + 1: the evacuation block

        # ---- vToken's view -------------------------------------------------------------------
        def vtoken_evicted(self, request_id: int) -> int:
            """Logical minus physical tokens of a request (0 for unknown and padding rows)."""
            return self.vtoken.num_evicted(request_id)

        def _vtoken_publish(self, force: bool) -> None:
            if self.vtoken_stats is not None:
                self.vtoken_stats.maybe_write(
                    lambda: state_snapshot(self.vtoken, self.get_num_free_blocks(), self.get_max_resource_count()),
                    force)

        def _vtoken_release(self, req_id: int, num_tokens: int) -> None:
            before = len(self.vtoken.table.block_ids(req_id)) + len(self.vtoken.blocks.freed)
            self.rewind_kv_cache(_RequestRef(req_id), num_tokens)
            held = self.get_cache_indices(_RequestRef(req_id))
            assert list(held) == self.vtoken.table.block_ids(req_id), (
                f"TensorRT-LLM holds {list(held)} for request {req_id}, vToken {self.vtoken.table.block_ids(req_id)}"
                f" (was {before} blocks)")

        def _vtoken_mass(self, req_id: int, kv_len: int, block_ids: list[int]) -> torch.Tensor:
            row = self._vtoken_rows[req_id]
            if row < self._vtoken_num_contexts:  # a prompt: its mass was summed during the forward
                prefill = self.vtoken_queries.prefill.get(row)
                return prefill[:kv_len] if prefill is not None else torch.zeros(kv_len)
            row -= self._vtoken_num_contexts
            pools = self.vtoken.backend.executor.pools
            layers = self.kv_cache_pool_mapping[:, 1].tolist()  # single pool: layer index inside it
            return decode_attention_mass(self.vtoken_queries.q[row], pools[0], block_ids, kv_len, layers)

    VTokenKVCacheManager.__qualname__ = f"VTokenKVCacheManager[{base.__name__}]"
    return VTokenKVCacheManager


class _RequestRef:
    """What ``rewind_kv_cache`` / ``get_cache_indices`` read of a request: its id."""

    def __init__(self, req_id: int) -> None:
        self.py_request_id = req_id
