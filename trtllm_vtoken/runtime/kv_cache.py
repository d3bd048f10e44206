# SPDX-License-Identifier: Apache-2.0
"""The KV pool and the block-offsets table, laid out like TensorRT-LLM's.

    pool:           [num_blocks + 1, num_layers, 2 (K, V), num_kv_heads, tokens_per_block, head_dim]
    block_offsets:  int32 [max_seqs, max_blocks_per_seq]    row = batch slot, entries = block ids
    kv_lens:        int32 [max_seqs]                          physical KV length per batch slot

``block_offsets`` and ``kv_lens`` are allocated once and rewritten in place before every step, so
a captured CUDA graph keeps reading the same memory (design §5). The pool's last block is a
scratch block outside the block pool: padding tokens (slot -1) write there, so writes need no
data-dependent indexing and a padded batch can be captured.

An FP8 pool (``kv_cache_dtype="fp8"``) holds float8_e4m3fn codes and one scale per layer, as
TensorRT-LLM's FP8 KV cache does (``kv_scales[layer]``: value = code x scale; 1.0 each, the value
TensorRT-LLM uses without a calibrated checkpoint): writes divide by it and saturate at +-448,
reads multiply back in the compute dtype. Everything that moves KV moves the codes as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PagedKVCache:
    def __init__(
        self,
        num_blocks: int,
        tokens_per_block: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fp8: bool = False,
    ) -> None:
        """``dtype``: the model's (K/V are written and read in it); ``fp8``: the pool stores
        float8_e4m3fn codes with a scale per layer instead."""
        self.tokens_per_block = tokens_per_block
        self.scratch_block = num_blocks
        self.compute_dtype = dtype
        self.pool = torch.zeros(
            num_blocks + 1, num_layers, 2, num_kv_heads, tokens_per_block, head_dim,
            dtype=torch.float8_e4m3fn if fp8 else dtype, device=device,
        )
        self.kv_scales = torch.ones(num_layers, dtype=torch.float32, device=device) if fp8 else None
        """FP8: each layer's scale (K and V alike); None for a pool in the model's dtype."""
        self.block_offsets = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.kv_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.active_blocks = max_blocks_per_seq
        """Columns of ``block_offsets`` that eager attention reads (the batch's longest row); a
        captured graph reads all of them."""

    def set_batch(self, block_lists: Sequence[Sequence[int]], kv_lens: Sequence[int]) -> None:
        """Rewrites rows ``[0, len(block_lists))`` of the static tables in place."""
        max_seqs, max_blocks = self.block_offsets.shape
        if len(block_lists) > max_seqs or any(len(b) > max_blocks for b in block_lists):
            raise ValueError(f"batch exceeds the block-offsets table [{max_seqs}, {max_blocks}]")
        self.active_blocks = max((len(b) for b in block_lists), default=1) or 1
        rows = torch.full((len(block_lists), max_blocks), self.scratch_block, dtype=torch.int32)
        for i, blocks in enumerate(block_lists):
            rows[i, : len(blocks)] = torch.tensor(list(blocks), dtype=torch.int32)
        self.block_offsets[: len(block_lists)].copy_(rows, non_blocking=True)
        self.kv_lens[: len(kv_lens)].copy_(torch.tensor(list(kv_lens), dtype=torch.int32), non_blocking=True)

    def copy_blocks(self, source: Sequence[int], destination: Sequence[int]) -> None:
        """Copies whole blocks, every layer's K and V: ``destination[i]`` gets ``source[i]``'s
        (a cached prefix a request takes as its own; on CUDA, on the current stream)."""
        if len(source) != len(destination):
            raise ValueError(f"{len(source)} source blocks for {len(destination)} destinations")
        if source:
            src = torch.tensor(list(source), dtype=torch.long, device=self.pool.device)
            dst = torch.tensor(list(destination), dtype=torch.long, device=self.pool.device)
            self.pool[dst] = self.pool[src]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores new K/V. slots: [T] flat slots, -1 for padding (written to the scratch block);
        k, v: [T, num_kv_heads, head_dim]."""
        tpb = self.tokens_per_block
        blocks = torch.where(slots >= 0, slots // tpb, self.scratch_block)
        offsets = slots % tpb
        self.pool[blocks, layer, 0, :, offsets] = self._stored(k, layer)
        self.pool[blocks, layer, 1, :, offsets] = self._stored(v, layer)

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block, every layer's K and V (what a block costs the device)."""
        return self.pool[0].numel() * self.pool.element_size()

    def _stored(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        if self.kv_scales is None:
            return x.to(self.pool.dtype)
        return (x.float() / self.kv_scales[layer]).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)

    def gather(self, layer: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``batch`` rows through the offsets table.

        Returns: two tensors [batch, num_kv_heads, active_blocks * tokens_per_block, head_dim];
        positions at or beyond ``kv_lens`` hold whatever their block holds and must be masked.
        In the pool's dtype, or for FP8 dequantized to the compute dtype.
        """
        blocks = self.block_offsets[:batch, : self.active_blocks].long()  # [B, nb]
        kv = self.pool[blocks, layer]  # [B, nb, 2, H, tpb, D]
        if self.kv_scales is not None:  # FP8 codes -> values, in the compute dtype
            kv = kv.to(self.compute_dtype) * self.kv_scales[layer].to(self.compute_dtype)
        kv = kv.permute(0, 2, 3, 1, 4, 5).flatten(3, 4)  # [B, 2, H, nb * tpb, D]
        return kv[:, 0], kv[:, 1]
