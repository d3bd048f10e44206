# SPDX-License-Identifier: Apache-2.0
"""The bounded attention-mass passes (``mass_torch.py``, what CPU hosts run) equal their
specification (``scores.py``) for random shapes, GQA groups, reused prefixes, windows, ragged
block tables and tight caps; and their transient memory, measured on the code path itself (meta
tensors at Llama-3.1-8B and 70B shapes, 32k tokens), stays under the cap."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trtllm_vtoken.bench.memory import PeakMemory
from trtllm_vtoken.integration.trtllm import mass
from trtllm_vtoken.integration.trtllm.mass import decode_mass, mass_backend, prefill_mass
from trtllm_vtoken.integration.trtllm.mass_plan import DEFAULT_CAP_BYTES, DecodeMassPlan, PrefillMassPlan
from trtllm_vtoken.integration.trtllm.mass_torch import decode_mass_torch, prefill_mass_torch
from trtllm_vtoken.integration.trtllm.scores import batch_decode_attention_mass, prefill_attention_mass


def random_prefill(seed: int, dtype: torch.dtype):
    """A context row of random shape: (q, k, past_k or None, window or None)."""
    rng = np.random.default_rng(seed)
    kv_heads, group = int(rng.integers(1, 4)), int(rng.choice([1, 2, 3, 4]))
    dim, tokens, past = int(rng.choice([8, 16, 24])), int(rng.integers(1, 90)), int(rng.choice([0, 0, 5, 33]))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, kv_heads * group, dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    past_k = torch.randn(past, kv_heads, dim, generator=gen).to(dtype) if past else None
    window = [None, 1, 7, 200][int(rng.integers(0, 4))]
    return q, k, past_k, window


def random_decode(seed: int, dtype: torch.dtype):
    """A batch of decode rows over a shuffled pool: (q, pool, block_lists, kv_lens, layers)."""
    rng = np.random.default_rng(seed)
    kv_heads, group, dim, tpb = int(rng.integers(1, 4)), int(rng.choice([1, 2, 4])), 16, int(rng.choice([2, 4, 8]))
    rows, layers, pool_layers = int(rng.integers(1, 6)), int(rng.integers(1, 3)), 3
    kv_lens = [int(n) for n in rng.integers(1, 40, size=rows)]
    order = rng.permutation(sum(-(-n // tpb) + 1 for n in kv_lens))
    block_lists, used = [], 0
    for n in kv_lens:  # each list one block longer than its length needs, blocks anywhere in the pool
        count = -(-n // tpb) + 1
        block_lists.append([int(b) for b in order[used : used + count]])
        used += count
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(len(order), pool_layers, 2, kv_heads, tpb, dim, generator=gen).to(dtype)
    q = torch.randn(rows, layers, kv_heads * group, dim, generator=gen).to(dtype)
    return q, pool, block_lists, kv_lens, [int(x) for x in rng.choice(pool_layers, size=layers, replace=False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(12))
def test_prefill_pass_equals_its_specification(seed, dtype):
    q, k, past_k, window = random_prefill(seed, dtype)
    want = prefill_attention_mass(q, k, chunk=5, past_k=past_k, window=window)
    for cap in (DEFAULT_CAP_BYTES, 4096, 1 << 20):  # tight caps: key tiles and one-query tiles
        torch.testing.assert_close(prefill_mass_torch(q, k, past_k, window, cap), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(12))
def test_decode_pass_equals_its_specification(seed, dtype):
    q, pool, block_lists, kv_lens, layers = random_decode(seed, dtype)
    want = batch_decode_attention_mass(q, pool, block_lists, kv_lens, layers)
    tight = 256  # the smallest power of two that holds a row's scores and a block of its keys
    while True:
        try:
            DecodeMassPlan.of(len(kv_lens), -(-max(kv_lens) // pool.shape[4]), pool.shape[4], q.shape[2],
                              pool.shape[3], q.shape[3], pool.element_size(), tight)
            break
        except ValueError:
            tight *= 2
    for cap in (DEFAULT_CAP_BYTES, tight):  # tight: a row, and a block or two of its keys, at a time
        got = decode_mass_torch(q, pool, block_lists, kv_lens, layers, cap)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("version, usable", [("3.1.0", False), ("3.2.0", True), ("3.6.0+git1a2b3c", True),
                                             ("4.0.0", True), ("2.3.1", False), ("unknown", False)])
def test_cuda_pools_take_the_kernels_only_with_a_triton_they_support(monkeypatch, version, usable):
    """Torch builds before 2.6 ship Triton 3.0 / 3.1, which the kernels do not build with: their
    CUDA pools take the torch passes (``TRITON_MIN``)."""
    monkeypatch.setattr(mass.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(mass.importlib.metadata, "version", lambda name: version)
    mass.triton_version.cache_clear(), mass.triton_usable.cache_clear()
    try:
        assert mass.triton_usable() is usable
        assert mass.mass_backend("cuda") == ("triton" if usable else "torch")
        assert mass.describe_cuda() == (f"Triton kernels (triton {version})" if usable else
                                        f"torch passes (triton {version}: the kernels need 3.2 or later)")
    finally:
        monkeypatch.undo()
        mass.triton_version.cache_clear(), mass.triton_usable.cache_clear()


def test_cpu_tensors_take_the_torch_pass_and_bad_input_is_refused():
    q, pool, block_lists, kv_lens, layers = random_decode(0, torch.float32)
    assert mass_backend("cpu") == "torch" and mass_backend(torch.device("meta")) == "torch"
    torch.testing.assert_close(decode_mass(q, pool, block_lists, kv_lens, layers),
                               decode_mass_torch(q, pool, block_lists, kv_lens, layers))
    with pytest.raises(ValueError, match="kv_len 0"):
        decode_mass(q, pool, block_lists, [0] + kv_lens[1:], layers)
    with pytest.raises(ValueError, match="cap"):
        PrefillMassPlan.of(1 << 20, 8, 1, 128, cap_bytes=1 << 20)
    with pytest.raises(ValueError, match="cap"):
        DecodeMassPlan.of(1, 1 << 14, 32, 64, 8, 128, 2, cap_bytes=1 << 20)
    with pytest.raises(ValueError, match="positive int"):
        PrefillMassPlan.of(10, 8, 1, True)


# (heads, kv_heads, head_dim): Llama-3.1-8B and Llama-3.1-70B's attention
SHAPES = {"llama-3.1-8b": (32, 8, 128), "llama-3.1-70b": (64, 8, 128)}


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_prefill_pass_stays_under_the_cap_at_32k_tokens(model):
    heads, kv_heads, dim = SHAPES[model]
    tokens = 32 * 1024
    q = torch.empty(tokens, heads, dim, dtype=torch.bfloat16, device="meta")
    k = torch.empty(tokens, kv_heads, dim, dtype=torch.bfloat16, device="meta")
    plan = PrefillMassPlan.of(tokens, heads, kv_heads, dim)
    # The prompt's last queries attend to every key: their tiles are the widest, where the pass
    # peaks (a window of them runs just those tiles, in a fraction of the time on meta tensors).
    with PeakMemory() as memory:
        mass = prefill_mass(q, k, window=4 * plan.query_tile)
    assert mass.shape == (tokens,)
    result = tokens * 4  # the mass itself: what the hook keeps, not workspace
    assert memory.peak - result <= plan.workspace_bytes <= DEFAULT_CAP_BYTES
    assert memory.largest <= DEFAULT_CAP_BYTES
    # what the unbounded specification's first chunk of 256 queries alone would take
    assert 256 * heads * tokens * 4 >= 16 * DEFAULT_CAP_BYTES


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_decode_pass_stays_under_the_cap_at_32k_tokens(model):
    heads, kv_heads, dim = SHAPES[model]
    tokens, tpb, rows, layers = 32 * 1024, 32, 3, 2
    blocks = tokens // tpb
    pool = torch.empty(rows * blocks, layers, 2, kv_heads, tpb, dim, dtype=torch.bfloat16, device="meta")
    q = torch.empty(rows, layers, heads, dim, dtype=torch.bfloat16, device="meta")
    block_lists = [list(range(r * blocks, (r + 1) * blocks)) for r in range(rows)]
    plan = DecodeMassPlan.of(rows, blocks, tpb, heads, kv_heads, dim, 2)
    with PeakMemory() as memory:
        mass = decode_mass(q, pool, block_lists, [tokens] * rows)
    assert mass.shape == (rows, tokens)
    fixed = rows * tokens * (4 + 8 + 1) + rows * blocks * 8  # result, the table and its mask: O(tokens)
    assert memory.peak - fixed <= plan.workspace_bytes <= DEFAULT_CAP_BYTES
    assert memory.largest <= DEFAULT_CAP_BYTES


def test_decode_pass_allocates_its_workspace_once_for_all_layers():
    """Tiles allocated per layer and chunk were fresh memory the CPU faulted in page by page every
    time (1.5 million page faults at batch 64 x 4k): the pass's allocations of a tile's size or
    more do not grow with the layers or the key tiles a tight cap cuts."""
    rows, tpb, blocks, heads, kv_heads, dim = 3, 16, 64, 8, 2, 32
    pool = torch.empty(rows * blocks, 6, 2, kv_heads, tpb, dim, dtype=torch.bfloat16, device="meta")
    block_lists = [list(range(r * blocks, (r + 1) * blocks)) for r in range(rows)]
    cap = 256 << 10
    plan = DecodeMassPlan.of(rows, blocks, tpb, heads, kv_heads, dim, 2, cap)
    assert plan.key_blocks < blocks  # several key tiles per row chunk
    tile = plan.rows * plan.key_blocks * kv_heads * tpb * dim * 2  # one tile of gathered keys
    counts = []
    for layers in (1, 6):
        q = torch.empty(rows, layers, heads, dim, dtype=torch.bfloat16, device="meta")
        with PeakMemory() as memory:
            decode_mass(q, pool, block_lists, [blocks * tpb] * rows, list(range(layers)), cap)
        counts.append(sum(size >= tile for size in memory.sizes))
    assert counts[0] == counts[1] <= 4
