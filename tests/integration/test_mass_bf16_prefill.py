# SPDX-License-Identifier: Apache-2.0
"""The C++ bf16 prefill mass pass (``mass_cpp.py``, ``cpp/core/prefill_mass.cpp``), with AMX tiles
or AVX-512 BF16 dot products (whichever this CPU runs: ``bf16_kind``), equals its
specification (``scores.py``) on random shapes, GQA groups, head dims off the tiles' 32, reused
prefixes, windows and strided inputs; gives the same result for any thread count; keeps its
workspace in the one tensor it allocates, under the cap at Llama-3.1-70B shapes and 32k tokens;
and steps aside (the torch pass runs) wherever it does not apply. Skipped where the C++ core is
not built or the CPU or OS has neither AMX-BF16 nor AVX-512 BF16."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_mass_passes import SHAPES, random_prefill
from trtllm_vtoken.bench.memory import PeakMemory
from trtllm_vtoken.core import native
from trtllm_vtoken.integration.trtllm.mass import mass_backend, prefill_mass, prefill_pass
from trtllm_vtoken.integration.trtllm.mass_cpp import bf16_kind, prefill_mass_bf16, prefill_workspace_bytes
from trtllm_vtoken.integration.trtllm.mass_plan import DEFAULT_CAP_BYTES
from trtllm_vtoken.integration.trtllm.mass_torch import prefill_mass_torch
from trtllm_vtoken.integration.trtllm.scores import prefill_attention_mass

pytestmark = pytest.mark.skipif(bf16_kind() is None,
                                reason="needs the C++ core on a CPU and OS with AMX-BF16 or AVX-512 BF16")


@pytest.mark.parametrize("seed", range(16))
def test_prefill_pass_equals_its_specification(seed):
    q, k, past_k, window = random_prefill(seed, torch.bfloat16)
    want = prefill_attention_mass(q, k, chunk=5, past_k=past_k, window=window)
    got = prefill_mass_bf16(q, k, past_k, window, DEFAULT_CAP_BYTES, threads=1)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    for threads in (2, 3):  # threads take whole KV heads; the heads' sums are added in order
        assert torch.equal(prefill_mass_bf16(q, k, past_k, window, DEFAULT_CAP_BYTES, threads=threads), got)


@pytest.mark.parametrize("tokens,past", [(300, 0), (129, 70)])
def test_prefill_pass_reads_strided_rows_of_real_sizes(tokens, past):
    """q and k as TensorRT-LLM's hook sees them: views into one fused qkv tensor [T, (H + 2 Hkv) D],
    SmolLM2's head dim 64 and Llama's 128, tiles of 16 queries and 64 keys cut at both ends."""
    gen = torch.Generator().manual_seed(tokens)
    for heads, kv_heads, dim in ((9, 3, 64), (8, 2, 128)):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).bfloat16()
        q = qkv[:, : heads * dim].view(tokens, heads, dim)
        k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        past_k = torch.randn(past, kv_heads, dim, generator=gen).bfloat16() if past else None
        assert not q.is_contiguous()
        want = prefill_attention_mass(q, k, past_k=past_k)
        torch.testing.assert_close(prefill_mass(q, k, past_k), want, rtol=2e-5, atol=2e-4)
        assert abs(want.sum().item() - heads * tokens) < 1e-2 * tokens  # each query's weights sum to 1


def test_context_rows_in_bf16_take_it_and_others_do_not():
    q, k, past_k, window = random_prefill(3, torch.bfloat16)
    assert prefill_pass(q, k, past_k) == bf16_kind()
    assert prefill_pass(q.float(), k.float()) == mass_backend("cpu") == "torch"
    assert prefill_mass_bf16(q.float(), k.float(), None, None, DEFAULT_CAP_BYTES) is None
    mixed = None if past_k is None else past_k.float()  # e.g. a dequantized FP8 prefix
    if mixed is not None:
        assert prefill_mass_bf16(q, k, mixed, window, DEFAULT_CAP_BYTES) is None
    # a cap below one thread's workspace: the torch pass runs, with its own tiles
    small = native.load().prefill_mass_workspace_bytes(q.shape[0] + (0 if past_k is None else past_k.shape[0]),
                                                       k.shape[1], q.shape[2], 1) - 1
    assert prefill_mass_bf16(q, k, past_k, window, small) is None
    torch.testing.assert_close(prefill_mass(q, k, past_k, window, cap_bytes=max(small, 4096)),
                               prefill_mass_torch(q, k, past_k, window, max(small, 4096)))
    num_keys = q.shape[0] + (0 if past_k is None else past_k.shape[0])
    assert torch.equal(prefill_mass_bf16(q, k, past_k, 0, DEFAULT_CAP_BYTES), torch.zeros(num_keys))  # empty window


def test_bad_input_is_refused_before_anything_is_written():
    core = native.load()
    q = torch.randn(20, 4, 16).bfloat16()
    k = torch.randn(20, 2, 16).bfloat16()
    size = core.prefill_mass_workspace_bytes(20, 2, 16, 1)
    mass = torch.full((20,), 7.0)
    cases = [
        ((q.float(), k, None, 0, torch.empty(size, dtype=torch.uint8), 1, mass), "bfloat16"),
        ((q, k, None, 0, torch.empty(size - 1, dtype=torch.uint8), 1, mass), "workspace"),
        ((q, k[:19], None, 0, torch.empty(size, dtype=torch.uint8), 1, mass), "same number of tokens"),
        ((q, k, None, 20, torch.empty(size, dtype=torch.uint8), 1, mass), "first observing query"),
        ((q[:, :3], k, None, 0, torch.empty(size, dtype=torch.uint8), 1, mass[:20]), "evenly"),
        ((q, k, None, 0, torch.empty(size, dtype=torch.uint8), 1, mass[:19]), "one value per key"),
        ((q, k.transpose(1, 2), None, 0, torch.empty(size, dtype=torch.uint8), 1, mass), "contiguous last"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            core.prefill_mass_bf16(*args)
    assert torch.equal(mass, torch.full((20,), 7.0))


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_prefill_pass_stays_under_the_cap_at_32k_tokens(model):
    heads, kv_heads, dim = SHAPES[model]
    tokens, window = 32 * 1024, 16
    gen = torch.Generator().manual_seed(0)
    # every token's rows alike (stride 0): real data to read, no 512 MiB of it
    q = torch.randn(1, heads, dim, generator=gen).bfloat16().expand(tokens, heads, dim)
    k = torch.randn(1, kv_heads, dim, generator=gen).bfloat16().expand(tokens, kv_heads, dim)
    threads, size = prefill_workspace_bytes(tokens, kv_heads, dim, DEFAULT_CAP_BYTES, threads=2)
    assert threads == 2 and size <= DEFAULT_CAP_BYTES
    with PeakMemory() as memory:
        mass = prefill_mass_bf16(q, k, None, window, DEFAULT_CAP_BYTES, threads=2)
    result = tokens * 4  # the mass itself: what the hook keeps, not workspace
    assert memory.peak - result == size and memory.largest <= DEFAULT_CAP_BYTES
    # equal scores: each of the last `window` queries spreads its weight evenly over what it sees
    seen = torch.arange(tokens - window + 1, tokens + 1, dtype=torch.float64)
    want = heads * (1.0 / seen[None, :] * (torch.arange(tokens)[:, None] < seen[None, :])).sum(dim=1)
    torch.testing.assert_close(mass.double(), want, rtol=1e-4, atol=1e-6)
