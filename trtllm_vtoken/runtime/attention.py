# SPDX-License-Identifier: Apache-2.0
"""Paged attention in torch, reading K/V through the block-offsets table.

For each batch row: the new tokens' queries (``q_lens`` of them, the last ``q_lens`` physical
positions of the row) attend to every position in ``[0, kv_len)`` that is valid, and causally
among themselves. Physical order need not be logical order (compaction permutes tokens), which
is fine: keys carry their RoPE from their original position and attention over past tokens is
order-independent; only the new tokens, which are always physically last, need the causal mask.
"""

from __future__ import annotations

import math

import torch

from trtllm_vtoken.runtime.batch_invariance import KEY_MULTIPLE, padded
from trtllm_vtoken.runtime.kv_cache import PagedKVCache


def paged_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    q_lens: torch.Tensor,
    valid: torch.Tensor | None = None,
    return_mass: bool = False,
    mass_cuts: torch.Tensor | None = None,
    mass_from: torch.Tensor | None = None,
    row_multiple: int = 0,
    mass_blocks: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """
    Args:
        q: [B, Tq, num_heads, head_dim], queries padded to the longest row (Tq = q_lens.max()).
        q_lens: [B] int, real queries per row; padded queries produce zeros.
        valid: [B, max_blocks * tokens_per_block] bool or None; False masks a position (dead token,
            naive-evict and lazy mode). None: every position below kv_len is attended (dense mode).
        return_mass: also return the attention each position received, summed over heads and real
            queries (for H2O / Scissorhands). Shape: [B, max_blocks * tokens_per_block].
        mass_cuts: [B, K] int: also the mass of the first ``mass_cuts[b, j]`` queries of row b
            (0 <= cut <= q_len), for each j. Shape then: [B, K + 1, max_blocks *
            tokens_per_block], the cuts then the total. A prefill cut at each block end gives
            what the prompt's first blocks paid each other, which depends on those blocks'
            tokens alone (prefix caching keeps it with them).
        mass_from: [B] int: the total counts row b's queries from ``mass_from[b]`` on only (H2O's
            ``prefill_window``: a prompt's last queries); the cuts still count from query 0.
        row_multiple: > 0: batch-invariant (``runtime/batch_invariance.py``): each row attends
            alone, over its own keys padded to a multiple of ``KEY_MULTIPLE``, with its queries
            padded so that each KV head's products run on a multiple of ``row_multiple`` rows.
        mass_blocks: (offset, tokens_per_block), batch-invariant forwards only: the mass per block
            of ``tokens_per_block`` query positions, query 0 at ``offset`` in its block, each a
            chain of elementwise adds (heads in order, then the block's queries in order) that no
            shape changes: [1, 2, blocks, max_blocks * tokens_per_block], every query's weights
            then the ones ``mass_from`` counts, blocks up to the row's last query. ``mass_cuts`` is
            not taken (``fold_blocks`` gives the mass up to any block end). One row (a prefill)
            with ``row_multiple`` only: ValueError otherwise.
    Returns:
        out [B, Tq, num_heads, head_dim] and the mass (or None).
    """
    k, v = cache.gather(layer, q.shape[0])  # [B, Hkv, L, D]
    kv_lens = cache.kv_lens[: q.shape[0]].long()
    if mass_blocks is not None and (not row_multiple or q.shape[0] != 1):
        raise ValueError("mass_blocks sums one prefill row's mass in an order no shape changes: batch-invariant "
                         f"forwards (row_multiple > 0) of one row only, got row_multiple {row_multiple} and "
                         f"{q.shape[0]} rows")
    if row_multiple:
        return _attend_each_row(q, k, v, kv_lens, q_lens, valid, return_mass, mass_cuts, mass_from, row_multiple,
                                mass_blocks)
    return _attend(q, k, v, kv_lens, q_lens, valid, return_mass, mass_cuts, mass_from)


def _attend_each_row(q, k, v, kv_lens, q_lens, valid, return_mass, mass_cuts, mass_from, row_multiple,
                     mass_blocks=None):
    """``_attend`` for each row alone, with shapes that depend on the row alone: its keys
    [0, kv_len) padded with masked ones to a multiple of KEY_MULTIPLE, its queries with padding
    ones to a multiple of ``row_multiple / gcd(row_multiple, group)``. Same results as the whole
    batch's, to float rounding; bitwise the same whatever the batch."""
    batch, tq, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    query_multiple = row_multiple // math.gcd(row_multiple, group)
    out = q.new_zeros(q.shape)
    mass = None
    for b, (kv_len, q_len) in enumerate(zip(kv_lens.tolist(), q_lens.tolist())):
        keys = padded(max(kv_len, 1), KEY_MULTIPLE)
        queries = padded(max(q_len, 1), query_multiple)
        row = slice(b, b + 1)
        row_out, row_mass = _attend(
            _resized(q[row, :q_len], queries, dim=1), _resized(k[row], keys, dim=2), _resized(v[row], keys, dim=2),
            kv_lens[row], q_lens[row], None if valid is None else _resized(valid[row], keys, dim=1), return_mass,
            None if mass_cuts is None else mass_cuts[row], None if mass_from is None else mass_from[row],
            mass_blocks)
        out[b, :q_len] = row_out[0, :q_len]
        if row_mass is not None:
            if mass is None:
                mass = row_mass.new_zeros((batch, *row_mass.shape[1:-1], k.shape[2]))
            width = min(keys, k.shape[2])
            mass[b, ..., :width] = row_mass[0, ..., :width]
    return out, mass


def _block_mass(probs: torch.Tensor, qi: torch.Tensor, mass_from: torch.Tensor | None, offset: int,
                tokens_per_block: int) -> torch.Tensor:
    """``paged_attention``'s ``mass_blocks``: probs [B, Hkv, group, Tq, L] -> [B, 2, blocks, L]."""
    batch, _, _, tq, length = probs.shape
    heads = probs.reshape(batch, -1, tq, length)
    per_query = heads[:, 0].clone()  # [B, Tq, L]
    for head in range(1, heads.shape[1]):
        per_query += heads[:, head]
    observed = per_query if mass_from is None else \
        per_query * (qi[None, :] >= mass_from.to(probs.device)[:, None])[:, :, None]
    blocks = -(-(offset + tq) // tokens_per_block)
    sums = []
    for weights in (per_query, observed):
        # zero queries before query 0 and after the last: 0 + x is x, so each block sums its own
        # queries alone, in order, wherever the forward's queries begin and end
        rows = torch.cat([weights.new_zeros(batch, offset, length), weights,
                          weights.new_zeros(batch, blocks * tokens_per_block - offset - tq, length)], dim=1)
        rows = rows.view(batch, blocks, tokens_per_block, length)
        total = rows[:, :, 0].clone()
        for query in range(1, tokens_per_block):
            total += rows[:, :, query]
        sums.append(total)
    return torch.stack(sums, dim=1)


def _resized(t: torch.Tensor, count: int, dim: int) -> torch.Tensor:
    """``t`` cut or padded with zeros (False) along ``dim`` to ``count``, contiguous."""
    have = t.shape[dim]
    if have >= count:
        return t.narrow(dim, 0, count).contiguous()
    pad_shape = list(t.shape)
    pad_shape[dim] = count - have
    return torch.cat([t, t.new_zeros(pad_shape)], dim=dim)


def _attend(q, k, v, kv_lens, q_lens, valid, return_mass, mass_cuts, mass_from, mass_blocks=None):
    """Attention of queries [B, Tq, Hq, D] over keys and values [B, Hkv, L, D] (the arguments
    of ``paged_attention``)."""
    batch, tq, num_heads, head_dim = q.shape
    num_kv_heads, length = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    pos = torch.arange(length, device=q.device)
    qi = torch.arange(tq, device=q.device)
    q_lens = q_lens.to(q.device).long()
    # Query i of row b sits at physical position kv_len - q_len + i.
    q_pos = kv_lens[:, None] - q_lens[:, None] + qi[None, :]  # [B, Tq]
    allowed = pos[None, None, :] <= q_pos[:, :, None]  # causal over the new tokens, [B, Tq, L]
    allowed &= pos[None, None, :] < kv_lens[:, None, None]
    if valid is not None:
        allowed &= valid[:, None, :length]
    real_query = qi[None, :] < q_lens[:, None]  # [B, Tq]
    allowed &= real_query[:, :, None]

    qh = q.permute(0, 2, 1, 3).reshape(batch, num_kv_heads, group * tq, head_dim)
    scores = torch.matmul(qh.float(), k.float().transpose(-1, -2)) / math.sqrt(head_dim)
    scores = scores.view(batch, num_kv_heads, group, tq, length)
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with nothing allowed -> zeros
    out = torch.matmul(probs.view(batch, num_kv_heads, group * tq, length), v.float())
    out = out.view(batch, num_heads, tq, head_dim).permute(0, 2, 1, 3).to(q.dtype)
    if not return_mass:
        return out, None
    if mass_blocks is not None:
        real = int(q_lens[0])  # one row: its padding queries would only add zero blocks
        return out, _block_mass(probs[..., :real, :], qi[:real], mass_from, *mass_blocks)
    if mass_cuts is None and mass_from is None:
        return out, probs.sum(dim=(1, 2, 3))
    per_query = probs.sum(dim=(1, 2))  # [B, Tq, L]
    if mass_from is None:
        total = per_query.sum(dim=1)
    else:
        total = (per_query * (qi[None, :] >= mass_from.to(q.device)[:, None])[:, :, None]).sum(dim=1)
    if mass_cuts is None:
        return out, total
    cumulative = per_query.cumsum(dim=1)  # [B, Tq, L]: queries [0, q] together
    cuts = mass_cuts.to(q.device).long()
    taken = cumulative.gather(1, (cuts - 1).clamp(min=0)[:, :, None].expand(-1, -1, length))
    return out, torch.cat([taken * (cuts > 0)[:, :, None], total[:, None]], dim=1)
