# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/pyexecutor/resource_manager.py`` (index ids 77926604 and 3501434665; the
latter also defines ``KVCacheManagerV2``, so it is later than 1.2, but the V1 parts vToken uses
read the same in both):
``KVCacheManager`` (V1) over its C++ ``impl`` (``bindings/internal/batch_manager.py``) and the
``ResourceManager`` that the executor loop drives.

Imitated, per behaviour:
- ``KVCacheManager.__init__``: the real keyword-only signature; ``pp_layers`` /
  ``num_local_layers`` / ``layer_offsets`` (global layer id -> local index) from ``mapping``; kv
  heads per local layer divided by ``tp_size``; ``kv_factor`` 1 for ``SELFKONLY``; ``dtype`` a
  ``DataType``; ``self.impl`` the C++ manager with ``max_tokens // tokens_per_block`` blocks (64
  without ``max_tokens``).
- One primary pool per distinct kv-head count (the C++ groups layers with equal heads), each
  ``[blocks, layers_in_pool, kv_factor, heads, tokens_per_block, head_dim]`` (HND inside a block)
  in the cache dtype; ``kv_cache_pool_mapping`` ``[num_local_layers, 2]`` = (pool, index in pool)
  (``impl.get_layer_to_pool_mapping()``).
- ``get_buffers(layer_idx, kv_layout)``: ``layer_offsets[layer_idx]`` (a KeyError for a layer of
  another pipeline rank), then the layer's slice of its pool reshaped, never transposed, to
  ``[P, kv, H, tpb, D]`` (HND) or ``[P, kv, tpb, H, D]`` (NHD).
- ``prepare_resources``: ``impl.add_sequence(id, prompt_len, beam_width, req)`` for a first
  context chunk (the whole prompt's blocks, whatever the chunk), nothing for a later chunk,
  ``impl.add_token(id)`` per generation request and once more per draft token it carries
  (``get_draft_token_length``: the executor's placeholders), ``impl.refresh_blocks()``.
- ``update_resources``: generation requests not GENERATION_COMPLETE / CONTEXT_INIT rewind their
  ``py_rewind_len`` (speculative decoding; "With overlap scheduler, the scheduler pauses a
  request and frees KV cache at iteration N, while the previous batch (N-1) is still trying to
  update the KV cache"); every context request: ``impl.store_context_blocks(request)`` (after
  every chunk with chunked prefill: 1.2 stores a prompt's blocks before its later chunks write
  them; later versions wait for the last chunk, index id 56304441455).
- ``free_resources``: ``impl.remove_sequence(id, request, pin_on_release)``.
- ``rewind_kv_cache``: ``impl.rewind_kv_cache(id, n)``; the request object is untouched.
- ``get_cache_indices`` / ``get_batch_cache_indices``: ``impl.get_cache_block_ids(id, window)[0]``
  (an ``IndexError`` for a removed request); ``get_num_free_blocks``:
  ``impl.get_kv_cache_stats().free_num_blocks``; ``get_max_resource_count``: ``impl.max_num_blocks``.
- ``add_dummy_requests(request_ids, token_nums=None, is_gen=False, prepare_resource=True, ...)``:
  None when no block is free; else requests (``max_new_tokens`` 1, tokens ``[1] * token_num``,
  ``is_dummy_request``), added to the C++ manager directly (no ``prepare_resources``); a
  generation dummy has ``prompt_len = token_num - 1``, state GENERATION_IN_PROGRESS and
  ``max_num_draft_tokens`` draft tokens (1s), a KV slot each.
- ``copy_batch_block_offsets``: per pool, ``block * layers_in_pool * kv_factor + {0, 1}``.
- ``get_needed_resource_to_completion``: blocks of ``orig_prompt_len + max_new_tokens``.
- ``ResourceManager``: an ordered dict of managers; ``prepare_resources`` / ``update_resources``
  in order (only ``KVCacheManager`` instances get ``attn_metadata``), ``free_resources`` in
  reverse; the executor creator moves the KV-cache manager to the end.
Beam width 1 only (vToken's requirement; the C++ ``removeToken`` checks it too).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from ...bindings import CacheType, DataType
from ...bindings.internal.batch_manager import KVCacheManager as KVCacheManagerCpp
from .llm_request import LlmRequest, LlmRequestState, SamplingConfig, get_draft_token_length


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
                 spec_config=None, layer_mask=None, max_num_tokens: int = 8192, model_config=None,
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
        self.is_estimating_kv_cache = is_estimating_kv_cache
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
        self.impl = KVCacheManagerCpp(tokens_per_block=tokens_per_block, blocks_in_primary_pool=self.blocks_in_primary_pool,
                                      enable_block_reuse=self.enable_block_reuse, max_sequence_length=max_seq_len,
                                      enable_partial_reuse=kv_cache_config.enable_partial_reuse,
                                      copy_on_partial_reuse=kv_cache_config.copy_on_partial_reuse,
                                      onboard=self._copy_tokens)

    def _copy_tokens(self, source: int, block: int, count: int) -> None:
        """The KV of a block's first ``count`` tokens into another block, every pool and layer (the
        C++ transfer manager's ``onboard`` of a partly matched block, on the pools it owns)."""
        for pool in self._pools:
            pool[block, :, :, :, :count] = pool[source, :, :, :, :count]

    # ---- test views ---------------------------------------------------------------------------
    def stored_blocks(self) -> dict[tuple, int]:
        """The reuse tree (test view): token chain -> block."""
        return self.impl.stored_blocks()

    def num_tokens_in_sequence(self, req_id: int) -> int:
        """The C++ ``GenerationRequest::getNumTokens`` (test view)."""
        return self.impl.num_tokens(req_id)

    # ---- BaseResourceManager --------------------------------------------------------------------
    def prepare_resources(self, scheduled_batch) -> None:
        self.impl.sync_transfer_manager_with_buffer_manager()
        for req in scheduled_batch.context_requests:
            if req.is_first_context_chunk:
                self.impl.add_sequence(req.py_request_id, req.prompt_len, req.sampling_config.beam_width, req)
        for req in scheduled_batch.generation_requests:
            self.impl.add_token(req.py_request_id)
            for _ in range(get_draft_token_length(req)):
                self.impl.add_token(req.py_request_id)
        self.impl.refresh_blocks()

    def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None) -> None:
        for request in scheduled_batch.generation_requests:
            if request.state in (LlmRequestState.GENERATION_COMPLETE, LlmRequestState.CONTEXT_INIT):
                continue
            if request.py_rewind_len > 0:
                self.rewind_kv_cache(request, request.py_rewind_len)
        for request in scheduled_batch.context_requests:
            self.impl.store_context_blocks(request)

    def free_resources(self, request, pin_on_release: bool = False) -> None:
        return self.impl.remove_sequence(request.py_request_id, request, pin_on_release)

    def add_dummy_requests(self, request_ids, token_nums=None, is_gen: bool = False, prepare_resource: bool = True,
                           max_num_draft_tokens: int = 0, use_mrope: bool = False, max_beam_width: int = 1,
                           num_extra_decoding_steps: int = 0):
        if self.get_num_free_blocks() < 1:
            return None
        requests = []
        for i, req_id in enumerate(request_ids):
            token_num = token_nums[i] if token_nums is not None else 1 + max_num_draft_tokens
            req = LlmRequest(request_id=req_id, max_new_tokens=1, input_tokens=[1] * token_num,
                             sampling_config=SamplingConfig(max_beam_width), is_streaming=False)
            req.is_dummy_request = True
            if prepare_resource:
                self.impl.add_sequence(req_id, token_num, max_beam_width, req)
                for _ in range(num_extra_decoding_steps):
                    self.impl.add_token(req_id)
            if is_gen:
                req.state = LlmRequestState.GENERATION_IN_PROGRESS
                req.prompt_len = req.py_prompt_len = token_num - 1
                req.py_draft_tokens = [1] * max_num_draft_tokens
                if prepare_resource:
                    for _ in range(max_num_draft_tokens):
                        self.impl.add_token(req_id)
            requests.append(req)
        return requests

    # ---- KVCacheManager -------------------------------------------------------------------------
    def rewind_kv_cache(self, request, rewind_len: int) -> None:
        self.impl.rewind_kv_cache(request.py_request_id, rewind_len)

    def get_cache_indices(self, request, window_size=None) -> list[int]:
        return self.impl.get_cache_block_ids(request.py_request_id, window_size)[0]

    def get_batch_cache_indices(self, request_ids, layer_idx=None) -> list[list[int]]:
        return [beams[0] for beams in self.impl.get_batch_cache_block_ids(request_ids, None)]

    def get_num_free_blocks(self) -> int:
        return self.impl.get_kv_cache_stats().free_num_blocks

    def get_max_resource_count(self) -> int:
        return self.impl.max_num_blocks

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
                blocks = torch.tensor(self.impl.get_cache_block_ids(req_id)[0], dtype=torch.int32)
                dst_tensor[pool, row, 0, : len(blocks)] = blocks * per_block
                dst_tensor[pool, row, 1, : len(blocks)] = blocks * per_block + (self.kv_factor - 1)


class ResourceManager:
    def __init__(self, resource_managers: dict) -> None:
        self.resource_managers = OrderedDict(resource_managers)

    def get_resource_manager(self, name):
        return self.resource_managers.get(name)

    def prepare_resources(self, scheduled_batch) -> None:
        for manager in self.resource_managers.values():
            if manager is not None:
                manager.prepare_resources(scheduled_batch)

    def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None) -> None:
        for manager in self.resource_managers.values():
            if isinstance(manager, KVCacheManager):
                manager.update_resources(scheduled_batch, attn_metadata, kv_cache_dtype_byte_size)
            elif manager is not None:
                manager.update_resources(scheduled_batch)

    def free_resources(self, request) -> None:
        for manager in reversed(self.resource_managers.values()):
            if manager is not None:
                manager.free_resources(request)
