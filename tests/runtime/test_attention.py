# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import math

import torch

from trtllm_vtoken.runtime.attention import paged_attention
from trtllm_vtoken.runtime.kv_cache import PagedKVCache

TPB, HKV, HQ, D = 4, 2, 4, 8


def _loop_reference(q, cache, layer, blocks, kv_len, q_len, valid):
    """One row, written out position by position."""
    slots = [blocks[p // TPB] * TPB + p % TPB for p in range(kv_len)]
    k = torch.stack([cache.pool[s // TPB, layer, 0, :, s % TPB] for s in slots], dim=1)  # [Hkv, L, D]
    v = torch.stack([cache.pool[s // TPB, layer, 1, :, s % TPB] for s in slots], dim=1)
    out = torch.zeros(q_len, HQ, D)
    mass = torch.zeros(kv_len)
    for i in range(q_len):
        me = kv_len - q_len + i
        keys = [p for p in range(kv_len) if p <= me and valid[p]]
        for h in range(HQ):
            kh = k[h // (HQ // HKV), keys]
            probs = torch.softmax(kh @ q[i, h] / math.sqrt(D), dim=0)
            out[i, h] = probs @ v[h // (HQ // HKV), keys]
            mass[keys] += probs
    return out, mass


def test_paged_attention_matches_loop_reference_with_mask_and_mass():
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(16, TPB, num_layers=2, num_kv_heads=HKV, head_dim=D, max_seqs=2, max_blocks_per_seq=4)
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=gen))
    rows = [([9, 3, 12], 11, 3), ([5, 1], 6, 1)]  # (blocks, kv_len, new tokens)
    cache.set_batch([r[0] for r in rows], [r[1] for r in rows])
    q = torch.randn(2, 3, HQ, D, generator=gen)
    valid = torch.ones(2, 16, dtype=torch.bool)
    valid[0, [1, 4]] = False  # dead tokens in row 0
    valid[1, 2] = False
    out, mass = paged_attention(q, cache, 1, torch.tensor([3, 1]), valid, return_mass=True)
    for b, (blocks, kv_len, q_len) in enumerate(rows):
        want_out, want_mass = _loop_reference(q[b], cache, 1, blocks, kv_len, q_len, valid[b].tolist())
        torch.testing.assert_close(out[b, :q_len], want_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mass[b, :kv_len], want_mass, rtol=1e-5, atol=1e-5)
        assert torch.all(mass[b, kv_len:] == 0) and torch.all(out[b, q_len:] == 0)
        # each real query distributes one unit per head
        assert math.isclose(float(mass[b].sum()), q_len * HQ, rel_tol=1e-5)


def test_set_batch_rewrites_static_buffers_in_place():
    cache = PagedKVCache(8, TPB, 1, HKV, D, max_seqs=2, max_blocks_per_seq=3)
    offsets, lens = cache.block_offsets.data_ptr(), cache.kv_lens.data_ptr()
    cache.set_batch([[4, 2], [7]], [6, 3])
    cache.set_batch([[1]], [2])
    assert cache.block_offsets.data_ptr() == offsets and cache.kv_lens.data_ptr() == lens
    # unused columns point at the scratch block (8), never at a block of the pool
    assert cache.block_offsets.tolist() == [[1, 8, 8], [7, 8, 8]] and cache.kv_lens.tolist() == [2, 3]


def test_mass_cuts_sum_the_first_queries_only():
    """The cut at c is the mass of the first c queries (what a prefix of the prompt paid), the
    cut at q_len the total, a cut at 0 nothing: checked against the loop reference per query.
    The total follows the cuts; ``mass_from`` counts a row's last queries in the total only."""
    gen = torch.Generator().manual_seed(1)
    cache = PagedKVCache(16, TPB, num_layers=1, num_kv_heads=HKV, head_dim=D, max_seqs=2, max_blocks_per_seq=4)
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=gen))
    rows = [([9, 3, 12], 10, 6), ([5, 1], 7, 3)]  # (blocks, kv_len, new tokens)
    cache.set_batch([r[0] for r in rows], [r[1] for r in rows])
    q = torch.randn(2, 6, HQ, D, generator=gen)
    q_lens = torch.tensor([6, 3])
    cuts = torch.tensor([[2, 4, 6], [0, 1, 3]])
    _, total = paged_attention(q, cache, 0, q_lens, return_mass=True)
    _, cut = paged_attention(q, cache, 0, q_lens, return_mass=True, mass_cuts=cuts)
    length = total.shape[1]
    assert cut.shape == (2, 4, length)
    torch.testing.assert_close(cut[:, -1], total)
    torch.testing.assert_close(cut[:, -2], total)  # the cuts at q_len
    _, windowed = paged_attention(q, cache, 0, q_lens, return_mass=True, mass_cuts=cuts,
                                  mass_from=torch.tensor([4, 0]))
    torch.testing.assert_close(windowed[:, :-1], cut[:, :-1])  # the cuts count from query 0
    torch.testing.assert_close(windowed[0, -1], cut[0, 2] - cut[0, 1])  # queries 4 and 5 of row 0
    torch.testing.assert_close(windowed[1, -1], total[1])
    for row, (blocks, kv_len, q_len) in enumerate(rows):
        for j, c in enumerate(cuts[row].tolist()):
            expected = torch.zeros(length)
            for i in range(c):  # query i alone: the loop reference of a row whose last query is i
                _, mass = _loop_reference(q[row, i : i + 1], cache, 0, blocks, kv_len - q_len + i + 1, 1,
                                          [True] * 16)
                expected[: len(mass)] += mass
            torch.testing.assert_close(cut[row, j], expected)
