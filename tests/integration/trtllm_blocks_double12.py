# SPDX-License-Identifier: Apache-2.0
"""Doubles of TensorRT-LLM 1.2's pure-Python paged-KV bookkeeping, the ``trtllm-build`` path's
block manager: ``tensorrt_llm/runtime/kv_cache_manager.py`` (``Block``, ``GenerationSequence``,
``BlocksManager``, ``KVCacheManager``) and ``tensorrt_llm/runtime/memory_pools/``
(``PoolsKVCacheManager``, ``MemoryPoolsAllocator``, ``Pool``), all read at NVIDIA/TensorRT-LLM
commit 7ed07f0691dff2c1c89196adee670ce9f4f15f67. Written from the behaviour read there, not
copied; each behaviour names the function it imitates. Beam width 1 and no sink tokens only
(vToken refuses both), so the beam-sharing and sink-bubble branches are not modelled.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch


class BlockDouble12:
    """``Block``: an index into the pool and a reference count (``add_link`` / ``remove_link`` /
    ``has_link``)."""

    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.ref_count = 0

    def add_link(self) -> None:
        self.ref_count += 1

    def remove_link(self) -> None:
        self.ref_count -= 1

    def has_link(self) -> bool:
        return self.ref_count > 0


class GenerationSequenceDouble12:
    """``GenerationSequence(seq_idx, batch_idx)``: hashed by ``seq_idx``, equal when both match."""

    def __init__(self, seq_idx: int, batch_idx: int) -> None:
        self.seq_idx, self.batch_idx = seq_idx, batch_idx

    def get_batch_idx(self) -> int:
        return self.batch_idx

    def __eq__(self, other) -> bool:
        return getattr(other, "seq_idx", None) == self.seq_idx and getattr(other, "batch_idx", None) == self.batch_idx

    def __hash__(self) -> int:
        return self.seq_idx


class BlocksManagerDouble12:
    """``BlocksManager(*, num_layers, num_blocks, block_size, max_blocks_per_seq, beam_width)``."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, max_blocks_per_seq: int = 128,
                 beam_width: int = 1) -> None:
        assert beam_width == 1, "the double models beam width 1"
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.max_blocks_per_seq, self.beam_width = max_blocks_per_seq, beam_width
        # __init__: every block starts in the free list, in index order.
        self.free_blocks = [BlockDouble12(i) for i in range(num_blocks)]
        self.allocated_blocks: dict = defaultdict(lambda: [[]])

    def has_free_block(self) -> bool:
        return bool(self.free_blocks)

    def allocate(self, owner, share_across_beam: bool = False) -> None:
        """``allocate``: takes the first free block (``free_blocks.pop(0)``), links it, appends it
        to the owner's list; RuntimeError "Can't allocate new block for KV cache" when none is left."""
        if not self.has_free_block():
            raise RuntimeError("Can't allocate new block for KV cache")
        block = self.free_blocks.pop(0)
        block.add_link()
        self.allocated_blocks[owner][0].append(block)

    def free(self, owner) -> None:
        """``free``: unlinks every block of the owner, appends unlinked ones to the free list,
        forgets the owner."""
        for block in self.allocated_blocks[owner][0]:
            block.remove_link()
            if not block.has_link():
                self.free_blocks.append(block)
        self.allocated_blocks.pop(owner)

    def get_k_or_v_block_offset(self, block_idx: int, field_idx: int) -> int:
        """``get_k_or_v_block_offset``: ``block * num_layers * 2 + field`` (0 = K, 1 = V)."""
        return block_idx * self.num_layers * 2 + field_idx

    def get_offset_array(self, beam_width: int) -> torch.Tensor:
        """``get_offset_array``: int32 [number of owners, beam_width, 2, max_blocks_per_seq], row
        = the owner's batch index, entries past its blocks 0."""
        out = torch.zeros(len(self.allocated_blocks), beam_width, 2, self.max_blocks_per_seq, dtype=torch.int32)
        for owner, beams in self.allocated_blocks.items():
            for j, block in enumerate(beams[0]):
                for field in (0, 1):
                    out[owner.get_batch_idx(), 0, field, j] = self.get_k_or_v_block_offset(block.idx, field)
        return out


class KVCacheManagerDouble12:
    """``KVCacheManager(*, num_layers, num_blocks, block_size, tokens_per_block, max_blocks_per_seq,
    max_attention_window_size, sink_token_len, beam_width=1, use_one_more_block=False)``."""

    def __init__(self, *, num_layers, num_blocks, block_size, tokens_per_block, max_blocks_per_seq,
                 max_attention_window_size, sink_token_len, beam_width=1, use_one_more_block=False) -> None:
        assert sink_token_len == 0, "the double models no sink tokens"
        self.blocks_manager = BlocksManagerDouble12(num_layers=num_layers, num_blocks=num_blocks,
                                                    block_size=block_size, max_blocks_per_seq=max_blocks_per_seq,
                                                    beam_width=beam_width)
        self.tokens_per_block = tokens_per_block
        self.max_attention_window_size = max_attention_window_size
        self.beam_width = beam_width
        self.max_token_num = max_attention_window_size + (tokens_per_block if use_one_more_block else 0)
        self.lens: list[int] = []
        self.sequences: list = []

    def add_sequence(self, sequence, context_len: int, always_share_across_beam: bool = False) -> None:
        """``add_sequence``: records the length and allocates ceil(min(len, max_token_num) / tpb) blocks."""
        self.lens.append(context_len)
        self.sequences.append(sequence)
        for _ in range(math.ceil(min(context_len, self.max_token_num) / self.tokens_per_block)):
            self.blocks_manager.allocate(sequence)

    def step(self, finished: list[bool]) -> None:
        """``step``: per unfinished sequence, a block when its next token starts one (its length
        is a multiple of tokens_per_block, cyclically past max_token_num, where nothing is
        allocated any more), then length + 1; finished sequences are freed and the others'
        batch indices compacted."""
        for seq in self.sequences:
            b = seq.get_batch_idx()
            next_index = self.lens[b] % self.max_token_num
            if not finished[b] and next_index % self.tokens_per_block == 0 and self.lens[b] < self.max_token_num:
                self.blocks_manager.allocate(seq)
            self.lens[b] += 1
        for b, done in enumerate(finished):
            if done:
                self.blocks_manager.free(self.sequences[b])
        self.lens = [n for n, done in zip(self.lens, finished) if not done]
        kept = [seq for seq, done in zip(self.sequences, finished) if not done]
        for b, seq in enumerate(kept):
            seq.batch_idx = b
        self.sequences = kept

    def get_block_offsets(self, beam_width: int) -> torch.Tensor:
        return self.blocks_manager.get_offset_array(beam_width)


@dataclass
class PoolDouble12:
    """``memory_pools/pool.py``: ``Pool(num_kv_heads, num_layers)``."""

    num_kv_heads: int
    num_layers: int


class PoolsKVCacheManagerDouble12:
    """``PoolsKVCacheManager(pools_metadata, max_blocks_per_seq, num_blocks, tokens_per_block,
    head_size, max_attention_window_size, beam_width, sink_token_len)``: one KVCacheManager per
    pool, every call forwarded to each; offsets stacked over pools."""

    def __init__(self, pools_metadata, max_blocks_per_seq, num_blocks, tokens_per_block, head_size,
                 max_attention_window_size, beam_width, sink_token_len) -> None:
        self._kv_cache_managers = [
            KVCacheManagerDouble12(num_layers=pool.num_layers, num_blocks=num_blocks,
                                   block_size=pool.num_kv_heads * tokens_per_block * head_size,
                                   tokens_per_block=tokens_per_block, max_blocks_per_seq=max_blocks_per_seq,
                                   max_attention_window_size=max_attention_window_size,
                                   sink_token_len=sink_token_len, beam_width=beam_width)
            for pool in pools_metadata]

    def add_sequence(self, sequence, context_len: int, always_share_across_beam: bool = False) -> None:
        for manager in self._kv_cache_managers:
            manager.add_sequence(sequence, context_len, always_share_across_beam)

    def step(self, finished: list[bool]) -> None:
        for manager in self._kv_cache_managers:
            manager.step(finished)

    def get_block_offsets(self, beam_width: int) -> torch.Tensor:
        return torch.stack([m.get_block_offsets(beam_width) for m in self._kv_cache_managers])

    def get_single_kv_cache_manager(self):
        assert len(self._kv_cache_managers) == 1, "More then one kv cache manager exists"
        return self._kv_cache_managers[0]

    def has_single_pool(self) -> bool:
        return len(self._kv_cache_managers) == 1


class MemoryPoolsAllocatorDouble12:
    """``MemoryPoolsAllocator(num_blocks, tokens_per_block, head_size)``: ``allocate`` makes one
    pool per distinct KV head count, [num_blocks, layers, 2, kv_heads, tokens_per_block,
    head_size] (kept in ``_pool_pointers``), and the layer -> (pool, layer in pool) mapping."""

    def __init__(self, num_blocks: int, tokens_per_block: int, head_size: int) -> None:
        self._num_blocks, self._tokens_per_block, self._head_size = num_blocks, tokens_per_block, head_size
        self._pool_pointers: list[torch.Tensor] = []
        self._pools_metadata: list[PoolDouble12] = []
        self._pool_mapping = None

    def allocate(self, dtype, num_kv_heads_per_layer: list[int], device="cpu") -> None:
        mapping = [[-1, -1] for _ in num_kv_heads_per_layer]
        for pool_index, heads in enumerate(sorted(set(num_kv_heads_per_layer))):
            layers = [i for i, h in enumerate(num_kv_heads_per_layer) if h == heads]
            self._pool_pointers.append(torch.empty(self._num_blocks, len(layers), 2, heads, self._tokens_per_block,
                                                   self._head_size, dtype=dtype, device=device))
            self._pools_metadata.append(PoolDouble12(num_kv_heads=heads, num_layers=len(layers)))
            for index_in_pool, layer in enumerate(layers):
                mapping[layer] = [pool_index, index_in_pool]
        self._pool_mapping = torch.tensor(mapping, dtype=torch.int32)

    @classmethod
    def prepare_num_kv_heads_per_layer(cls, kv_head: int, num_layers: int) -> list[int]:
        return [kv_head] * num_layers

    @property
    def pools_metadata(self):
        return self._pools_metadata

    @property
    def pool_mapping(self):
        return self._pool_mapping
