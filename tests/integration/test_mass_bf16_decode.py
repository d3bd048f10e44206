# SPDX-License-Identifier: Apache-2.0
"""The C++ bf16 decode mass pass (``mass_cpp.decode_mass_bf16``, ``cpp/core/decode_mass.cpp``), with
AMX tiles and with AVX-512 BF16 dot products (each kind this CPU runs, the passes limited to it:
``isa_ceiling``), equals its specification (``scores.batch_decode_attention_mass``) on random pools, block tables, lengths,
GQA groups and layer maps, at every edge of its tiles, and at real geometries (head dims on and off the tiles' 32 dims,
tokens_per_block below 16, groups wider than a tile's 16 query heads) with whatever the pool holds
past each row's length (NaN here); gives the same result for any thread count; keeps its workspace
in the one tensor it allocates, under the cap at Llama-3.1-70B shapes and 32k tokens; refuses bad
input before writing anything; and steps aside (the torch pass runs) wherever it does not apply.
Skipped where the C++ core is not built or the CPU or OS has neither AMX-BF16 nor AVX-512 BF16."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.integration.test_mass_passes import SHAPES, random_decode
from trtllm_vtoken.bench.memory import PeakMemory
from trtllm_vtoken.core import native
from trtllm_vtoken.integration.trtllm.mass import decode_mass, decode_pass
from trtllm_vtoken.integration.trtllm.mass_cpp import bf16_kind, decode_bf16_plan, decode_mass_bf16
from trtllm_vtoken.integration.trtllm.mass_plan import DEFAULT_CAP_BYTES
from trtllm_vtoken.integration.trtllm.mass_torch import decode_mass_torch
from trtllm_vtoken.integration.trtllm.scores import batch_decode_attention_mass

pytestmark = pytest.mark.skipif(bf16_kind() is None,
                                reason="needs the C++ core on a CPU and OS with AMX-BF16 or AVX-512 BF16")
KINDS = pytest.mark.parametrize("isa_ceiling", ["amx", "avx512-bf16"], indirect=True)
"""Each test below runs once per kind of the pass this CPU has."""


@KINDS
@pytest.mark.parametrize("seed", range(16))
def test_bf16_decode_pass_equals_its_specification(seed, isa_ceiling):
    q, pool, block_lists, kv_lens, layers = random_decode(seed, torch.bfloat16)
    want = batch_decode_attention_mass(q, pool, block_lists, kv_lens, layers)
    got = decode_mass_bf16(q, pool, block_lists, kv_lens, layers, threads=1)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    for threads in (2, 3):  # threads take whole rows
        assert torch.equal(decode_mass_bf16(q, pool, block_lists, kv_lens, layers, threads=threads), got)


def shuffled_block_lists(kv_lens, tpb, gen):
    """(pool blocks, each row's block list): the blocks its length needs, anywhere in a pool of
    four blocks more (which no row holds)."""
    needed = [-(-n // tpb) for n in kv_lens]
    order = torch.randperm(sum(needed) + 4, generator=gen).tolist()
    return len(order), [order[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(kv_lens))]


def nan_filled_pool(num_blocks, layers, kv_heads, tpb, dim, block_lists, kv_lens, gen):
    """A pool whose every position no row attends holds NaN (unwritten memory may hold anything);
    the attended keys and every value random."""
    pool = torch.full((num_blocks, layers, 2, kv_heads, tpb, dim), float("nan"), dtype=torch.bfloat16)
    pool[:, :, 1] = torch.randn(num_blocks, layers, kv_heads, tpb, dim, generator=gen).bfloat16()
    for blocks, n in zip(block_lists, kv_lens):
        for i in range(-(-n // tpb)):
            live = min(tpb, n - i * tpb)
            pool[blocks[i], :, 0, :, :live] = torch.randn(layers, kv_heads, live, dim, generator=gen).bfloat16()
    return pool


# (query heads, KV heads, head_dim, tokens_per_block): SmolLM2-135M; Llama-3.1-8B at 64 tokens per
# block; Phi-3's head_dim 96 (three tiles of 32 dims); head_dim 80 (two tiles and a partial one) with
# a group of 20 query heads (two tiles of heads) and blocks of 8 tokens; Gemma-2's head_dim 256.
GEOMETRIES = [(9, 3, 64, 32), (32, 8, 128, 64), (32, 32, 96, 16), (20, 1, 80, 8), (8, 4, 256, 128)]


@KINDS
@pytest.mark.parametrize("heads,kv_heads,dim,tpb", GEOMETRIES)
def test_bf16_decode_pass_reads_real_geometries_from_a_fragmented_pool(heads, kv_heads, dim, tpb, isa_ceiling):
    """Blocks anywhere in the pool, lengths cut inside a block and on its edge, queries as a strided
    view (the manager's buffer [layers, max_batch, ...] seen per row), NaN past every length."""
    gen = torch.Generator().manual_seed(dim + tpb)
    layers, pool_layers = 2, 3
    kv_lens = [1, tpb, 3 * tpb + 5, 130]
    num_blocks, block_lists = shuffled_block_lists(kv_lens, tpb, gen)
    pool = nan_filled_pool(num_blocks, pool_layers, kv_heads, tpb, dim, block_lists, kv_lens, gen)
    buffer = torch.randn(layers, 6, heads, dim, generator=gen).bfloat16()
    q = buffer[:, : len(kv_lens)].transpose(0, 1)  # [rows, layers, heads, dim], not contiguous
    assert not q.is_contiguous()
    want = batch_decode_attention_mass(q, pool, block_lists, kv_lens, [2, 0])
    assert decode_pass(q, pool, kv_lens) == isa_ceiling
    got = decode_mass(q, pool, block_lists, kv_lens, [2, 0])
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert not got.isnan().any()
    sums = got.sum(dim=1)  # each query head's weights sum to 1 over what it attends
    torch.testing.assert_close(sums, torch.full_like(sums, float(layers * heads)), rtol=1e-5, atol=1e-4)


@KINDS
def test_bf16_decode_pass_at_the_tiles_edges(isa_ceiling):
    """Every edge of the tiles at once: blocks of 1 to 128 tokens (tiles of 1, 2 or 16 keys),
    head dims from 2 to 160 on and off the 32-dim chunk (partial chunks of 2 to 30 dims), groups
    of 1, 2, 16 and 17 query heads (one tile of heads, or two), lengths of one position, a block
    and a position past it, and two threads."""
    gen = torch.Generator().manual_seed(5)
    for tpb, dim, (heads, kv_heads) in itertools.product([1, 2, 16, 128], [2, 30, 32, 34, 66, 160],
                                                         [(1, 1), (16, 1), (17, 1), (6, 3)]):
        kv_lens = [1, 2 * tpb + 1, 37, 5 * tpb]
        num_blocks, block_lists = shuffled_block_lists(kv_lens, tpb, gen)
        pool = torch.randn(num_blocks, 2, 2, kv_heads, tpb, dim, generator=gen).bfloat16()
        q = torch.randn(len(kv_lens), 2, heads, dim, generator=gen).bfloat16()
        want = batch_decode_attention_mass(q, pool, block_lists, kv_lens, [1, 0])
        got = decode_mass_bf16(q, pool, block_lists, kv_lens, [1, 0], threads=2)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=lambda m: f"{tpb=} {dim=} {heads=}: {m}")


@KINDS
def test_pools_and_rows_it_does_not_take_go_to_the_torch_pass(isa_ceiling):
    q, pool, block_lists, kv_lens, layers = random_decode(4, torch.bfloat16)
    assert decode_pass(q, pool, kv_lens) == isa_ceiling
    for other_q, other_pool in ((q.float(), pool.float()), (q.half(), pool.half()), (q.float(), pool)):
        assert decode_bf16_plan(other_q, other_pool, kv_lens, DEFAULT_CAP_BYTES) is None
        assert decode_pass(other_q, other_pool, kv_lens) == "torch"
    core = native.load()
    assert core.decode_mass_bf16_applies(8, 64) and core.decode_mass_bf16_applies(128, 80)
    assert not core.decode_mass_bf16_applies(24, 64) and not core.decode_mass_bf16_applies(32, 15)
    odd = torch.zeros(4, 1, 2, 1, 32, 15, dtype=torch.bfloat16)
    assert decode_bf16_plan(torch.zeros(1, 1, 1, 15, dtype=torch.bfloat16), odd, [3], DEFAULT_CAP_BYTES) is None
    # a cap below one thread's workspace: the torch pass runs
    small = core.decode_mass_workspace_bytes(max(kv_lens), pool.shape[4], pool.shape[5], len(kv_lens), 1) - 1
    assert decode_mass_bf16(q, pool, block_lists, kv_lens, layers, cap_bytes=small) is None
    assert decode_pass(q, pool, kv_lens, cap_bytes=small) == "torch"
    cap = max(small, 1 << 16)
    torch.testing.assert_close(decode_mass(q, pool, block_lists, kv_lens, layers, cap),
                               decode_mass_torch(q, pool, block_lists, kv_lens, layers, cap))
    with pytest.raises(ValueError, match="kv_len 0"):  # the same refusal as the torch pass's
        decode_mass(q, pool, block_lists, [0] + kv_lens[1:], layers)


def test_bad_input_is_refused_before_anything_is_written():
    core = native.load()
    q = torch.randn(2, 1, 4, 32).bfloat16()
    keys = torch.randn(6, 2, 2, 2, 16, 32).bfloat16()[:, :, 0]  # [blocks, layers, kv heads, tpb, dim]
    table = torch.tensor([[0, 1], [2, 3]])
    kv_lens, layers = torch.tensor([20, 32]), torch.tensor([1])
    size = core.decode_mass_workspace_bytes(32, 16, 32, 2, 1)
    mass, narrow = torch.full((2, 32), 7.0), torch.full((2, 31), 7.0)

    def call(**changed):
        args = dict(q=q, keys=keys, block_table=table, kv_lens=kv_lens, layers=layers,
                    workspace=torch.empty(size, dtype=torch.uint8), threads=1, mass=mass) | changed
        core.decode_mass_bf16(**args)

    cases = [(dict(q=q.float()), "bfloat16"), (dict(workspace=torch.empty(size - 1, dtype=torch.uint8)), "workspace"),
             (dict(block_table=torch.tensor([[0, 1], [2, 6]])), "block 6 outside"),
             (dict(block_table=torch.tensor([[0, 1], [-1, 3]])), "block -1 outside"),
             (dict(kv_lens=torch.tensor([20, 33])), "kv_len 33"), (dict(kv_lens=torch.tensor([0, 32])), "kv_len 0"),
             (dict(layers=torch.tensor([2])), "pool layer 2"), (dict(q=q[:, :, :3]), "evenly"),
             (dict(q=q[:1]), "a row per query row"), (dict(mass=narrow), "kv_len 32"),
             (dict(keys=keys.transpose(3, 4)), "contiguous last"), (dict(q=q[..., :16]), "head_dim")]
    for changed, message in cases:
        with pytest.raises(ValueError, match=message):
            call(**changed)
    assert torch.equal(mass, torch.full((2, 32), 7.0)) and torch.equal(narrow, torch.full((2, 31), 7.0))
    call()
    assert torch.equal(mass[0, 20:], torch.zeros(12)) and not torch.equal(mass[1], torch.full((32,), 7.0))


@KINDS
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_bf16_decode_pass_stays_under_the_cap_at_32k_tokens(model, isa_ceiling):
    heads, kv_heads, dim = SHAPES[model]
    tokens, tpb, rows, layers = 32 * 1024, 32, 3, 2
    gen = torch.Generator().manual_seed(1)
    # eight real blocks, every row's 1,024 block ids cycling through them: 32k positions to read,
    # not 6 GiB of pool
    pool = torch.randn(8, layers, 2, kv_heads, tpb, dim, generator=gen).bfloat16()
    block_lists = [[(r + i) % 8 for i in range(tokens // tpb)] for r in range(rows)]
    q = torch.randn(rows, layers, heads, dim, generator=gen).bfloat16()
    kv_lens = [tokens, tokens - 1, tokens - tpb]
    threads, size = decode_bf16_plan(q, pool, kv_lens, DEFAULT_CAP_BYTES, threads=2)
    assert threads == 2 and size <= DEFAULT_CAP_BYTES
    with PeakMemory() as memory:
        mass = decode_mass_bf16(q, pool, block_lists, kv_lens, threads=2)
    result = rows * tokens * 4  # the mass itself: what the manager keeps, not workspace
    assert memory.peak - result == size and memory.largest <= DEFAULT_CAP_BYTES
    sums = mass.sum(dim=1)
    torch.testing.assert_close(sums, torch.full_like(sums, float(layers * heads)), rtol=1e-4, atol=1e-2)
    # the 32k positions of a row repeat eight blocks' keys: positions a block apart weigh the same
    torch.testing.assert_close(mass[0, : tokens - 8 * tpb], mass[0, 8 * tpb :], rtol=1e-5, atol=1e-9)
