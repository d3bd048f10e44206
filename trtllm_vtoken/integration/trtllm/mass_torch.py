# SPDX-License-Identifier: Apache-2.0
"""The attention-mass passes in torch, in bounded memory: what hosts without Triton run (CPU).

Both equal their specification in ``scores.py`` to float32 rounding, and both allocate only what
their plan (``mass_plan.py``) names. They differ from it in how, not what:

- prefill: a query tile scores only the keys it may attend (the causal triangle, not the square),
  and the softmax runs in place in one preallocated buffer; its column sums are one product with
  the rows' inverse denominators. The keys are converted to float32 once per KV head.
- decode: one layer at a time, the keys are gathered through the block table in the pool's dtype
  (no copy of every layer at once) and converted while scored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from trtllm_vtoken.integration.trtllm.mass_plan import (
    DEFAULT_CAP_BYTES,
    DecodeMassPlan,
    PrefillMassPlan,
    padded_block_table,
)
from trtllm_vtoken.reclaim.upload import to_device


def prefill_mass_torch(q: torch.Tensor, k: torch.Tensor, past_k: torch.Tensor | None = None,
                       window: int | None = None, cap_bytes: int = DEFAULT_CAP_BYTES) -> torch.Tensor:
    """``scores.prefill_attention_mass`` (same arguments, same result) within ``cap_bytes``."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    num_past = 0 if past_k is None else past_k.shape[0]
    num_keys = num_past + num_tokens
    first = 0 if window is None else max(0, num_tokens - window)
    plan = PrefillMassPlan.of(num_keys, num_heads, num_kv_heads, head_dim, cap_bytes)
    mass = torch.zeros(num_keys, dtype=torch.float32, device=q.device)
    scores_buffer = torch.empty(plan.query_tile * group * num_keys, dtype=torch.float32, device=q.device)
    keys = torch.empty(num_keys if plan.keys_float32 else 0, head_dim, dtype=torch.float32, device=q.device)
    scale = 1.0 / math.sqrt(head_dim)
    for head in range(num_kv_heads):
        if plan.keys_float32:
            _copy_keys(keys, past_k, k, head, 0, num_keys)
        queries = q[:, head * group : (head + 1) * group]  # [T, g, D]: this KV head's query heads
        for start in range(first, num_tokens, plan.query_tile):
            end = min(num_tokens, start + plan.query_tile)
            rows = (queries[start:end].float() * scale).reshape((end - start) * group, head_dim)
            width = num_past + end  # the keys these queries may attend
            scores = scores_buffer[: rows.shape[0] * width].view(rows.shape[0], width)
            if plan.keys_float32:
                torch.mm(rows, keys[:width].T, out=scores)
            else:
                tile = torch.empty(plan.key_tile, head_dim, dtype=torch.float32, device=q.device)
                for low in range(0, width, plan.key_tile):
                    high = min(width, low + plan.key_tile)
                    _copy_keys(tile, past_k, k, head, low, high)
                    scores[:, low:high] = rows @ tile[: high - low].T
            # query j of the tile (position num_past + start + j) sees no key past itself
            future = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).triu_(1)
            scores.view(end - start, group, width)[:, :, num_past + start :].masked_fill_(future[:, None, :],
                                                                                           float("-inf"))
            mass[:width] += _softmax_column_sums(scores)
    return mass


def decode_mass_torch(q: torch.Tensor, pool: torch.Tensor, block_lists: Sequence[Sequence[int]],
                      kv_lens: Sequence[int], layers: Sequence[int] | None = None,
                      cap_bytes: int = DEFAULT_CAP_BYTES) -> torch.Tensor:
    """``scores.batch_decode_attention_mass`` (same arguments, same result) within ``cap_bytes``."""
    batch, num_layers, num_heads, head_dim = q.shape
    tpb, num_kv_heads = pool.shape[4], pool.shape[3]
    group = num_heads // num_kv_heads
    table = padded_block_table(block_lists, kv_lens, tpb, batch)
    width = max(kv_lens, default=0)
    out = torch.zeros(batch, width, dtype=torch.float32, device=pool.device)
    if width == 0:
        return out
    num_blocks = table.shape[1]
    plan = DecodeMassPlan.of(batch, num_blocks, tpb, num_heads, num_kv_heads, head_dim, pool.element_size(),
                             cap_bytes)
    device_table = to_device(table, torch.int64, pool.device)  # no host wait on CUDA (upload.py)
    dead = torch.arange(num_blocks * tpb, device=pool.device)[None, :] >= \
        to_device(kv_lens, torch.int64, pool.device)[:, None]  # [B, nb * tpb]
    pool_layers = list(layers) if layers is not None else list(range(num_layers))
    # The plan's workspace, allocated once and reused by every layer and chunk. A tile allocated
    # per step was fresh memory faulted in page by page each time: at batch 64 x 4k on the
    # project's VM, 1.5 million page faults and 2.4x the time of the pass without them.
    scores_buffer = torch.empty(plan.rows * num_heads * num_blocks * tpb, dtype=torch.float32, device=pool.device)
    tile_keys = plan.rows * plan.key_blocks * num_kv_heads * tpb * head_dim
    gather_buffer = torch.empty(tile_keys, dtype=pool.dtype, device=pool.device)  # the pool's dtype
    key_buffer = torch.empty(tile_keys, dtype=torch.float32, device=pool.device)
    tile_scores_buffer = None if plan.key_blocks == num_blocks else \
        torch.empty(plan.rows * num_heads * plan.key_blocks * tpb, dtype=torch.float32, device=pool.device)
    scale = 1.0 / math.sqrt(head_dim)
    for layer, pool_layer in enumerate(pool_layers):
        layer_keys = pool[:, pool_layer, 0]  # [blocks, Hkv, tpb, D], a view
        for low in range(0, batch, plan.rows):
            rows = slice(low, min(batch, low + plan.rows))
            r = rows.stop - rows.start
            scores = scores_buffer[: r * num_heads * num_blocks * tpb].view(r * num_kv_heads, group, num_blocks * tpb)
            qg = (q[rows, layer].float() * scale).view(r * num_kv_heads, group, head_dim)
            for first in range(0, num_blocks, plan.key_blocks):
                last = min(num_blocks, first + plan.key_blocks)
                kb = last - first
                count = r * kb * num_kv_heads * tpb * head_dim
                gathered = gather_buffer[:count].view(r * kb, num_kv_heads, tpb, head_dim)
                torch.index_select(layer_keys, 0, device_table[rows, first:last].reshape(-1), out=gathered)
                # one copy: heads before blocks, float32 -> [r * Hkv, kb * tpb, D]
                k = key_buffer[:count].view(r, num_kv_heads, kb, tpb, head_dim)
                k.copy_(gathered.view(r, kb, num_kv_heads, tpb, head_dim).transpose(1, 2))
                k = k.view(r * num_kv_heads, kb * tpb, head_dim)
                if first == 0 and last == num_blocks:
                    torch.bmm(qg, k.transpose(1, 2), out=scores)
                else:
                    tile = tile_scores_buffer[: r * num_heads * kb * tpb].view(r * num_kv_heads, group, kb * tpb)
                    torch.bmm(qg, k.transpose(1, 2), out=tile)
                    scores[:, :, first * tpb : last * tpb] = tile
            per_row = scores.view(r, num_kv_heads * group, num_blocks * tpb)
            per_row.masked_fill_(dead[rows, None, :], float("-inf"))
            out[rows] += _softmax_column_sums(per_row)[..., :width]
    return out


def _copy_keys(into: torch.Tensor, past_k: torch.Tensor | None, k: torch.Tensor, head: int, low: int,
               high: int) -> None:
    """``into[: high - low]`` = float32 keys of KV head ``head`` at positions [low, high) of the
    past keys followed by the row's own."""
    num_past = 0 if past_k is None else past_k.shape[0]
    if low < num_past:
        into[: min(high, num_past) - low].copy_(past_k[low : min(high, num_past), head])
    if high > num_past:
        into[max(low, num_past) - low : high - low].copy_(k[max(low, num_past) - num_past : high - num_past, head])


def _softmax_column_sums(scores: torch.Tensor) -> torch.Tensor:
    """Softmax of each row of ``scores`` [..., rows, keys] (in place), summed over the rows:
    [..., keys]. The sum is one product with the rows' inverse denominators."""
    scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
    inverse = scores.sum(dim=-1, keepdim=True).reciprocal_()  # [..., rows, 1]
    return (inverse.transpose(-1, -2) @ scores).squeeze(-2)
