# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/pyexecutor/resource_manager.py`` ``KVCacheManager`` (V1, 1.2-era copy,
index id 3501434665) and of the C++ block manager behind ``impl`` (``kvCacheManager.cpp``).

Imitated, per behaviour:
- ``__init__``: the real keyword-only signature; ``pp_layers`` / ``num_local_layers`` /
  ``layer_offsets`` (global layer id -> local index) from ``mapping``; kv heads per local layer
  divided by ``tp_size``; ``kv_factor`` 1 for ``SELFKONLY``; ``dtype`` a ``DataType``.
- One primary pool per distinct kv-head count (the C++ groups layers with equal heads), each
  ``[blocks, layers_in_pool, kv_factor, heads, tokens_per_block, head_dim]`` (HND inside a block)
  in the cache dtype; ``kv_cache_pool_mapping`` ``[num_local_layers, 2]`` = (pool, index in pool)
  (``impl.get_layer_to_pool_mapping()``). Blocks: ``max_tokens // tokens_per_block`` (64 without).
- ``get_buffers(layer_idx, kv_layout)``: ``layer_offsets[layer_idx]`` (a KeyError for a layer of
  another pipeline rank), then the layer's slice of its pool reshaped, never transposed, to
  ``[P, kv, H, tpb, D]`` (HND) or ``[P, kv, tpb, H, D]`` (NHD).
- ``prepare_resources``: ``add_sequence(id, prompt_len, sampling_config.beam_width)`` for a first
  context chunk, ``add_token`` per generation request; a block is taken from the FRONT of the free
  queue when the length crosses a block boundary (``LRUEvictionPolicy::getFreeBlock``).
- ``rewind_kv_cache(request, n)``: ``removeToken`` n times (``KVCacheManager::rewindKVCache``):
  only the C++ sequence's token count drops; a block emptied by it goes back to the FRONT of the
  free queue (``WindowBlockManager::releaseLastBlock`` -> ``releaseBlock(block, true)``). The
  request object is untouched.
- ``free_resources``: ``remove_sequence``: every block back to the END of the queue
  (``releaseBlock(block)`` = ``toFront`` false).
- ``update_resources``: rewinds ``py_rewind_len`` of generation requests (speculative decoding).
- ``copy_batch_block_offsets``: per pool, ``block * layers_in_pool * kv_factor + {0, 1}``.
- ``get_needed_resource_to_completion``: blocks of ``orig_prompt_len + max_new_tokens``.
Beam width 1 only (vToken's requirement; the C++ ``removeToken`` checks it too).
"""

from __future__ import annotations

import math
from collections import deque

import torch

from ...bindings import CacheType, DataType


class BaseResourceManager:
    def prepare_resources(self, scheduled_batch) -> None:
        return None

    def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None) -> None:
        return None

    def free_resources(self, request) -> None:
        return None

    def shutdown(self) -> None:
        return None


class KVCacheManager(BaseResourceManager):
    def __init__(self, kv_cache_config, kv_cache_type, *, num_layers: int, num_kv_heads, head_dim: int,
                 tokens_per_block: int, max_seq_len: int, max_batch_size: int, mapping, dtype: DataType = DataType.HALF,
                 spec_config=None, layer_mask=None, vocab_size=None, max_num_tokens: int = 8192, model_config=None,
                 max_beam_width: int = 1, is_draft: bool = False, kv_connector_manager=None,
                 enable_indexer_k_cache: bool = False, indexer_k_cache_quant_block_size: int = 128,
                 indexer_k_cache_index_head_dim: int = 0, is_estimating_kv_cache: bool = False,
                 execution_stream=None, **kwargs) -> None:
        self.mapping, self.dtype, self.kv_cache_type = mapping, dtype, kv_cache_type
        self.pp_layers, self.num_layers = mapping.pp_layers(num_layers), num_layers
        self.num_local_layers = len(self.pp_layers)
        self.layer_offsets = {idx: offset for offset, idx in enumerate(self.pp_layers)}
        heads = num_kv_heads if isinstance(num_kv_heads, list) else [num_kv_heads] * num_layers
        self.num_kv_heads_per_layer = [-(-heads[layer] // mapping.tp_size) for layer in self.pp_layers]
        self.head_dim, self.tokens_per_block = head_dim, tokens_per_block
        self.max_seq_len, self.max_batch_size, self.max_beam_width = max_seq_len, max_batch_size, max_beam_width
        self.kv_factor = 1 if kv_cache_type == CacheType.SELFKONLY else 2
        self.enable_block_reuse = kv_cache_config.enable_block_reuse
        max_tokens = kv_cache_config.max_tokens
        self.blocks_in_primary_pool = (max_tokens // tokens_per_block) if max_tokens else 64
        pool_of_heads: dict[int, int] = {}
        rows, layers_in_pool = [], []
        for h in self.num_kv_heads_per_layer:
            pool = pool_of_heads.setdefault(h, len(pool_of_heads))
            if pool == len(layers_in_pool):
                layers_in_pool.append(0)
            rows.append((pool, layers_in_pool[pool]))
            layers_in_pool[pool] += 1
        self._pools = [torch.zeros(self.blocks_in_primary_pool, n, self.kv_factor, h, tokens_per_block, head_dim,
                                   dtype=dtype.value) for h, n in zip(pool_of_heads, layers_in_pool)]
        self.kv_cache_pool_mapping = torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)
        self.num_pools = len(self._pools)
        self.max_blocks_per_seq = math.ceil(max_seq_len / tokens_per_block)
        self._free = deque(range(self.blocks_in_primary_pool))
        self._blocks: dict[int, list[int]] = {}
        self._num_tokens: dict[int, int] = {}

    # ---- the C++ side (impl) --------------------------------------------------------------------
    def _add_sequence(self, req_id: int, length: int, beam_width: int) -> None:
        if beam_width != 1:
            raise NotImplementedError("this double models beam width 1 (vToken's requirement)")
        if req_id in self._blocks:
            raise RuntimeError(f"sequence {req_id} already exists")
        self._blocks[req_id], self._num_tokens[req_id] = [], 0
        for _ in range(length):
            self._add_token(req_id)

    def _add_token(self, req_id: int) -> None:
        if self._num_tokens[req_id] % self.tokens_per_block == 0:
            if not self._free:
                raise RuntimeError("no free blocks left")
            self._blocks[req_id].append(self._free.popleft())
        self._num_tokens[req_id] += 1

    def _remove_token(self, req_id: int) -> None:
        if self._num_tokens[req_id] == 0:
            return
        self._num_tokens[req_id] -= 1
        if self._num_tokens[req_id] % self.tokens_per_block == 0:
            self._free.appendleft(self._blocks[req_id].pop())

    def num_tokens_in_sequence(self, req_id: int) -> int:
        """The C++ ``GenerationRequest::getNumTokens`` (test view)."""
        return self._num_tokens[req_id]

    # ---- BaseResourceManager --------------------------------------------------------------------
    def prepare_resources(self, scheduled_batch) -> None:
        for req in scheduled_batch.context_requests:
            if req.is_first_context_chunk:
                self._add_sequence(req.py_request_id, req.prompt_len, req.sampling_config.beam_width)
        for req in scheduled_batch.generation_requests:
            self._add_token(req.py_request_id)

    def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None) -> None:
        for request in scheduled_batch.generation_requests:
            if request.py_rewind_len > 0:
                self.rewind_kv_cache(request, request.py_rewind_len)

    def free_resources(self, request, pin_on_release: bool = False) -> None:
        self._free.extend(self._blocks.pop(request.py_request_id))
        del self._num_tokens[request.py_request_id]

    # ---- KVCacheManager -------------------------------------------------------------------------
    def rewind_kv_cache(self, request, rewind_len: int) -> None:
        for _ in range(rewind_len):
            self._remove_token(request.py_request_id)

    def get_cache_indices(self, request, window_size=None) -> list[int]:
        return list(self._blocks[request.py_request_id])

    def get_batch_cache_indices(self, request_ids, layer_idx=None) -> list[list[int]]:
        return [list(self._blocks[r]) for r in request_ids]

    def get_num_free_blocks(self) -> int:
        return len(self._free)

    def get_max_resource_count(self) -> int:
        return self.blocks_in_primary_pool

    def get_needed_resource_to_completion(self, request) -> int:
        return -(-(request.orig_prompt_len + request.max_new_tokens) // self.tokens_per_block)

    def get_buffers(self, layer_idx: int, kv_layout: str = "NHD") -> torch.Tensor:
        pool, index = self.kv_cache_pool_mapping[self.layer_offsets[layer_idx]].tolist()
        layer = self._pools[pool][:, index]  # [P, kv, H, tpb, D] in memory
        pages, kv, heads, tpb, dim = layer.shape
        assert kv_layout in ("NHD", "HND"), f"Unsupported kv_layout: {kv_layout}"
        return layer if kv_layout == "HND" else layer.reshape(pages, kv, tpb, heads, dim)

    def copy_batch_block_offsets(self, dst_tensor, request_ids, beam_width: int, num_context: int,
                                 num_seqs: int) -> None:
        for pool in range(self.num_pools):
            per_block = self._pools[pool].shape[1] * self.kv_factor
            for row, req_id in enumerate(request_ids[:num_seqs]):
                blocks = torch.tensor(self._blocks.get(req_id, []), dtype=torch.int32)
                dst_tensor[pool, row, 0, : len(blocks)] = blocks * per_block
                dst_tensor[pool, row, 1, : len(blocks)] = blocks * per_block + (self.kv_factor - 1)
