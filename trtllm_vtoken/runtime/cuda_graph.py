# SPDX-License-Identifier: Apache-2.0
"""Decode steps captured as CUDA graphs, one per batch-size bucket.

A captured graph replays fixed kernels on fixed addresses, so everything a decode step reads is a
static buffer written in place before ``replay``:

    input_ids, positions, slots   int64 [bucket, 1]    this step's token, its RoPE position
                                                       (logical, or physical in shift mode) and KV slot
    cache.block_offsets           int32 [max_seqs, max_blocks_per_seq]   rewritten by set_batch
    cache.kv_lens                 int32 [max_seqs]                       rewritten by set_batch
    valid                         bool  [bucket, max_blocks_per_seq * tokens_per_block]
                                                       (naive-evict and lazy mode only)

Rows past the real batch are padding: slot -1 (the cache's scratch block), kv_len 0, so their
queries attend to nothing and their outputs are ignored. Attention reads every column of the
block-offsets table (``active_blocks`` = all), which is what makes one graph valid for any
sequence lengths. Relocation copies run on a side stream and the compute stream waits on their
event before replay (I3), exactly as in eager mode.
"""

from __future__ import annotations

import torch

from trtllm_vtoken.runtime.kv_cache import PagedKVCache
from trtllm_vtoken.runtime.model import LlamaForCausalLM


def buckets(max_batch_size: int) -> list[int]:
    """Captured batch sizes: powers of two up to, and including, ``max_batch_size``."""
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return sizes + [max_batch_size]


class _Captured:
    def __init__(self, bucket: int, cache: PagedKVCache, masked: bool) -> None:
        device = cache.pool.device
        width = cache.block_offsets.shape[1] * cache.tokens_per_block
        self.input_ids = torch.zeros(bucket, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(bucket, 1, dtype=torch.long, device=device)
        self.slots = torch.full((bucket, 1), -1, dtype=torch.long, device=device)
        self.q_lens = torch.ones(bucket, dtype=torch.long, device=device)
        self.logits_at = torch.zeros(bucket, dtype=torch.long, device=device)
        self.valid = torch.zeros(bucket, width, dtype=torch.bool, device=device) if masked else None
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None
        self.mass: torch.Tensor | None = None


class DecodeGraphs:
    """Captures and replays the model's decode step for one engine's cache.

    Args:
        masked: the engine passes a validity mask (naive-evict, lazy mode); fixed per engine.
        return_mass: the policy needs attention mass (H2O, Scissorhands); fixed per engine.
    """

    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, max_batch_size: int,
                 masked: bool, return_mass: bool) -> None:
        if not cache.pool.is_cuda:
            raise ValueError("CUDA graphs need the KV cache on a CUDA device")
        self.model, self.cache = model, cache
        self.masked, self.return_mass = masked, return_mass
        self.buckets = buckets(max_batch_size)
        self._graphs: dict[int, _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.captures = 0
        self.replays = 0

    def bucket_for(self, batch: int) -> int:
        for size in self.buckets:
            if size >= batch:
                return size
        raise ValueError(f"batch {batch} exceeds max_batch_size {self.buckets[-1]}")

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step for B rows whose tables ``cache.set_batch`` has just written.

        Args: input_ids, positions, slots: [B, 1] (any device); valid: [B, width] bool or None.
        Returns: logits [B, vocab] and mass [B, width] or None; views of the graph's static
        outputs, valid until the next replay (copy them out first).
        """
        batch = input_ids.shape[0]
        bucket = self.bucket_for(batch)
        captured = self._graphs.get(bucket) or self._capture(bucket)
        # Padding rows: no tokens in the tables, slot -1 (scratch block).
        self.cache.kv_lens[batch:bucket].zero_()
        captured.input_ids[:batch].copy_(input_ids, non_blocking=True)
        captured.positions[:batch].copy_(positions, non_blocking=True)
        captured.slots[:batch].copy_(slots, non_blocking=True)
        captured.slots[batch:].fill_(-1)
        if self.masked:
            if valid is None:
                raise ValueError("this engine's graphs were captured with a validity mask")
            captured.valid[:batch].copy_(valid, non_blocking=True)
        captured.graph.replay()
        self.replays += 1
        mass = captured.mass[:batch] if captured.mass is not None else None
        return captured.logits[:batch], mass

    def _forward(self, captured: _Captured):
        cache = self.cache
        cache.active_blocks = cache.block_offsets.shape[1]  # shapes independent of lengths
        return self.model(captured.input_ids, captured.positions, captured.slots, captured.q_lens,
                          cache, captured.valid, return_mass=self.return_mass,
                          logits_at=captured.logits_at)

    def _capture(self, bucket: int) -> _Captured:
        captured = _Captured(bucket, self.cache, self.masked)
        # Capture must not write real KV: warm-up and capture run with every row as padding.
        saved_lens = self.cache.kv_lens[:bucket].clone()
        self.cache.kv_lens[:bucket].zero_()
        side = torch.cuda.Stream(self.cache.pool.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisation stays out of the graph
                self._forward(captured)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(captured.graph, pool=self._pool):
            captured.logits, captured.mass = self._forward(captured)
        self.cache.kv_lens[:bucket].copy_(saved_lens)
        self._graphs[bucket] = captured
        self.captures += 1
        return captured
