# SPDX-License-Identifier: Apache-2.0
"""A TensorRT-LLM KV-cache manager's pools and layers as vToken reads them: the global layer id ->
local index map of a pipeline rank, and the primary pools as 6-D HND views."""

from __future__ import annotations

from typing import Any

import torch


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
