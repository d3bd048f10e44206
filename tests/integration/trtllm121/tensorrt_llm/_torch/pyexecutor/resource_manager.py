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
- Block reuse (``enable_block_reuse``, True by default in ``KvCacheConfig``), read in
  ``kvCacheManager.cpp`` (1.2-era copy, index id 1277673704) and ``resource_manager.py`` (index id
  3501434665). A block enters the reuse tree, keyed by the token ids up to its end (a chain):
  (1) ``update_resources`` -> ``impl.store_context_blocks(request)`` for every context request:
  the full blocks of the first ``prompt_len - 1`` tokens (``chopVectorIntoBlocks(..., false)``);
  (2) ``free_resources`` -> ``impl.remove_sequence(id, request, pin)`` -> ``BlockManager::
  releaseBlocks(sequence, llmRequest)``: only if a request is given (and beam width 1, not cyclic,
  not a dummy) ``storeBlocksForReuse`` keys every block of the first ``len(tokens) - 1`` tokens,
  the partial last one too (``allowPartial`` true), by the request's tokens, prompt and generated;
  with no request (``None``) the blocks are released unstored. ``add_sequence`` with reuse
  recovers the longest chain of stored full blocks over the first ``prompt_len - 1`` tokens
  (shared: a reference per holder; a stored block with no holder is taken back out of the free
  queue) and sets the request's prepopulated length (``context_current_position``: the context
  forward computes only the rest), then allocates the rest. A block taken from the free queue for new content leaves the
  tree. Partial reuse is not modelled (vToken refuses it).
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
        self._refs = [0] * self.blocks_in_primary_pool
        self._tree: dict[tuple, int] = {}  # token ids up to a block's end -> the block holding their KV
        self._key_of: dict[int, tuple] = {}
        self.impl = _ImplDouble(self)

    # ---- the C++ side (impl) --------------------------------------------------------------------
    def _add_sequence(self, req_id: int, length: int, beam_width: int, request=None) -> None:
        if beam_width != 1:
            raise NotImplementedError("this double models beam width 1 (vToken's requirement)")
        if req_id in self._blocks:
            raise RuntimeError(f"sequence {req_id} already exists")
        self._blocks[req_id], self._num_tokens[req_id] = [], 0
        if self.enable_block_reuse and request is not None:
            tokens, tpb = request.get_tokens(0), self.tokens_per_block
            for end in range(tpb, length, tpb):  # full blocks within the first length - 1 tokens
                block = self._tree.get(tuple(tokens[:end]))
                if block is None:
                    break
                if self._refs[block] == 0:
                    self._free.remove(block)
                self._refs[block] += 1
                self._blocks[req_id].append(block)
                self._num_tokens[req_id] = end
            request.context_current_position = self._num_tokens[req_id]  # setPrepopulatedPromptLen
        for _ in range(length - self._num_tokens[req_id]):
            self._add_token(req_id)

    def _add_token(self, req_id: int) -> None:
        if self._num_tokens[req_id] % self.tokens_per_block == 0:
            if not self._free:
                raise RuntimeError("no free blocks left")
            block = self._free.popleft()
            key = self._key_of.pop(block, None)  # new content: the block leaves the reuse tree
            if key is not None:
                del self._tree[key]
            self._refs[block] += 1
            self._blocks[req_id].append(block)
        self._num_tokens[req_id] += 1

    def _remove_token(self, req_id: int) -> None:
        if self._num_tokens[req_id] == 0:
            return
        self._num_tokens[req_id] -= 1
        if self._num_tokens[req_id] % self.tokens_per_block == 0:
            block = self._blocks[req_id].pop()
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.appendleft(block)

    def _store(self, req_id: int, tokens: list[int], usable: int, allow_partial: bool) -> None:
        """``storeBlocks``: the request's blocks over its first ``usable`` tokens enter the tree
        under the token chain up to each block's end (a key already stored keeps its block)."""
        tpb = self.tokens_per_block
        ends = list(range(tpb, usable + 1, tpb)) + ([usable] if allow_partial and usable % tpb else [])
        for block, end in zip(self._blocks[req_id], ends):
            key = tuple(tokens[:end])
            if key not in self._tree and block not in self._key_of:
                self._tree[key], self._key_of[block] = block, key

    def _remove_sequence(self, req_id: int, request) -> None:
        if self.enable_block_reuse and request is not None and not request.is_dummy_request:
            tokens = request.get_tokens(0)
            self._store(req_id, tokens, len(tokens) - 1, allow_partial=True)
        for block in reversed(self._blocks.pop(req_id)):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
        del self._num_tokens[req_id]

    def stored_blocks(self) -> dict[tuple, int]:
        """The reuse tree (test view): token chain -> block."""
        return dict(self._tree)

    def num_tokens_in_sequence(self, req_id: int) -> int:
        """The C++ ``GenerationRequest::getNumTokens`` (test view)."""
        return self._num_tokens[req_id]

    # ---- BaseResourceManager --------------------------------------------------------------------
    def prepare_resources(self, scheduled_batch) -> None:
        for req in scheduled_batch.context_requests:
            if req.is_first_context_chunk:
                self._add_sequence(req.py_request_id, req.prompt_len, req.sampling_config.beam_width, req)
        for req in scheduled_batch.generation_requests:
            self._add_token(req.py_request_id)

    def update_resources(self, scheduled_batch, attn_metadata=None, kv_cache_dtype_byte_size=None) -> None:
        for request in scheduled_batch.generation_requests:
            if request.py_rewind_len > 0:
                self.rewind_kv_cache(request, request.py_rewind_len)
        for request in scheduled_batch.context_requests:
            self.impl.store_context_blocks(request)

    def free_resources(self, request, pin_on_release: bool = False) -> None:
        return self.impl.remove_sequence(request.py_request_id, request, pin_on_release)

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


class _ImplDouble:
    """The C++ manager's bindings that vToken and the Python wrapper call directly. Bound without
    argument names (``.def("remove_sequence", &BaseKVCacheManager::removeSequence)``, nanobind
    kvCacheManager bindings, index id 585945368), so positional only; ``llm_request`` is an
    ``OptionalRef<LlmRequest const>``, whose caster turns Python ``None`` into an empty reference
    (``type_caster<OptionalRef<T>>``, index id 1039870972)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self._manager = manager

    def store_context_blocks(self, request, /) -> None:
        manager = self._manager
        if manager.enable_block_reuse:
            tokens = request.get_tokens(0)
            manager._store(request.py_request_id, tokens, len(tokens) - 1, allow_partial=False)

    def remove_sequence(self, request_id: int, llm_request, pin_on_release: bool = False, /) -> None:
        self._manager._remove_sequence(request_id, llm_request)
