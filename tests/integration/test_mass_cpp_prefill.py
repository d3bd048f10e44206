# SPDX-License-Identifier: Apache-2.0
"""The C++ prefill mass pass (``mass_cpp.py``, ``cpp/core/prefill_mass.cpp``), for bf16 rows with
AMX tiles, AVX-512 BF16 dot products or float32 FMAs and for fp16 and float32 rows with float32
FMAs (each kind this CPU runs, the passes limited to it: ``isa_ceiling``), equals its
specification (``scores.py``) on random shapes, GQA groups, head dims off the tiles' 32, reused
prefixes, windows and strided inputs; gives the same result for any thread count; keeps its
workspace in the one tensor it allocates, under the cap at Llama-3.1-70B shapes and 32k tokens;
and steps aside (the torch pass runs) wherever it does not apply. Skipped, per kind, where the
C++ core is not built or the CPU or OS lacks it."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_mass_passes import SHAPES, random_prefill
from trtllm_vtoken.bench.memory import PeakMemory
from trtllm_vtoken.core import native
from trtllm_vtoken.integration.trtllm.mass import mass_backend, prefill_mass, prefill_pass
from trtllm_vtoken.integration.trtllm.mass_cpp import prefill_kind, prefill_mass_cpp, prefill_workspace_bytes
from trtllm_vtoken.integration.trtllm.mass_plan import DEFAULT_CAP_BYTES
from trtllm_vtoken.integration.trtllm.mass_torch import prefill_mass_torch
from trtllm_vtoken.integration.trtllm.scores import prefill_attention_mass

KINDS = [(torch.bfloat16, "amx"), (torch.bfloat16, "avx512-bf16"), (torch.bfloat16, "avx512"),
         (torch.float16, "avx512"), (torch.float32, "avx512")]
DTYPES = pytest.mark.parametrize("dtype,isa_ceiling", [pytest.param(dtype, kind, id=f"{str(dtype)[6:]}-{kind}")
                                                       for dtype, kind in KINDS], indirect=["isa_ceiling"])
"""Each test below runs once per row dtype and kind of the pass this CPU has for it (the passes
limited to that kind: bf16 rows on a CPU with AMX take each of its three kinds in turn)."""
pytestmark = pytest.mark.skipif(prefill_kind(torch.float32) is None,
                                reason="needs the C++ core on a CPU and OS with AVX-512")


@DTYPES
@pytest.mark.parametrize("seed", range(16))
def test_prefill_pass_equals_its_specification(seed, dtype, isa_ceiling):
    q, k, past_k, window = random_prefill(seed, dtype)
    want = prefill_attention_mass(q, k, chunk=5, past_k=past_k, window=window)
    got = prefill_mass_cpp(q, k, past_k, window, DEFAULT_CAP_BYTES, threads=1)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    for threads in (2, 3):  # threads take whole KV heads; the heads' sums are added in order
        assert torch.equal(prefill_mass_cpp(q, k, past_k, window, DEFAULT_CAP_BYTES, threads=threads), got)


@pytest.mark.skipif(prefill_kind(torch.float16) != "avx512", reason="needs the C++ core on a CPU with AVX-512")
def test_fp16_rows_are_converted_exactly():
    """fp16 rows are scored as their float32 values (the FMA kind): the same bits as float32 rows
    holding them, for normal, subnormal and the largest finite halves."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(70, 4, 24, generator=gen).half()
    k = torch.randn(70, 2, 24, generator=gen).half()
    q[::7, :, ::5] = torch.tensor(3e-6).half()  # subnormal in fp16
    k[::9, :, ::4] = torch.tensor(-5e-7).half()
    k[3, 0, 0], q[5, 1, 2] = 65504.0, -65504.0
    assert (k.abs() < 6.1e-5).logical_and(k != 0).any()  # subnormals are there
    past = torch.randn(11, 2, 24, generator=gen).half()
    got = prefill_mass_cpp(q, k, past, None, DEFAULT_CAP_BYTES, threads=1)
    assert torch.equal(got, prefill_mass_cpp(q.float(), k.float(), past.float(), None, DEFAULT_CAP_BYTES, threads=1))


@DTYPES
@pytest.mark.parametrize("tokens,past", [(300, 0), (129, 70)])
def test_prefill_pass_reads_strided_rows_of_real_sizes(tokens, past, dtype, isa_ceiling):
    """q and k as TensorRT-LLM's hook sees them: views into one fused qkv tensor [T, (H + 2 Hkv) D],
    SmolLM2's head dim 64 and Llama's 128, tiles of 16 queries and 64 keys cut at both ends."""
    gen = torch.Generator().manual_seed(tokens)
    for heads, kv_heads, dim in ((9, 3, 64), (8, 2, 128)):
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
        q = qkv[:, : heads * dim].view(tokens, heads, dim)
        k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        past_k = torch.randn(past, kv_heads, dim, generator=gen).to(dtype) if past else None
        assert not q.is_contiguous()
        assert prefill_pass(q, k, past_k) == isa_ceiling
        want = prefill_attention_mass(q, k, past_k=past_k)
        torch.testing.assert_close(prefill_mass(q, k, past_k), want, rtol=2e-5, atol=2e-4)
        assert abs(want.sum().item() - heads * tokens) < 1e-2 * tokens  # each query's weights sum to 1


@DTYPES
def test_context_rows_take_it_where_it_applies(dtype, isa_ceiling):
    q, k, past_k, window = random_prefill(3, dtype)
    assert prefill_pass(q, k, past_k) == isa_ceiling != "torch"
    assert mass_backend("cpu") == "torch"
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    assert prefill_mass_cpp(q.to(other), k, past_k, window, DEFAULT_CAP_BYTES) is None  # mixed dtypes
    assert prefill_pass(q.double(), k.double()) == "torch" and prefill_mass_cpp(q.double(), k.double(), None, None,
                                                                                  DEFAULT_CAP_BYTES) is None
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, dims not contiguous
    assert prefill_pass(strided, k, past_k) == "torch" and prefill_mass_cpp(strided, k, past_k, window,
                                                                             DEFAULT_CAP_BYTES) is None
    if past_k is not None:  # e.g. a dequantized FP8 prefix in another dtype
        assert prefill_mass_cpp(q, k, past_k.to(other), window, DEFAULT_CAP_BYTES) is None
    # a cap below one thread's workspace: the torch pass runs, with its own tiles
    num_keys = q.shape[0] + (0 if past_k is None else past_k.shape[0])
    small = native.load().prefill_mass_workspace_bytes(num_keys, k.shape[1], q.shape[2], 1, str(dtype)[6:]) - 1
    assert prefill_mass_cpp(q, k, past_k, window, small) is None
    torch.testing.assert_close(prefill_mass(q, k, past_k, window, cap_bytes=max(small, 4096)),
                               prefill_mass_torch(q, k, past_k, window, max(small, 4096)))
    assert torch.equal(prefill_mass_cpp(q, k, past_k, 0, DEFAULT_CAP_BYTES), torch.zeros(num_keys))  # empty window


def test_bad_input_is_refused_before_anything_is_written():
    core = native.load()
    q = torch.randn(20, 4, 16).bfloat16()
    k = torch.randn(20, 2, 16).bfloat16()
    size = core.prefill_mass_workspace_bytes(20, 2, 16, 1, "bfloat16")
    mass = torch.full((20,), 7.0)
    cases = [
        ((q.float(), k, None, 0, torch.empty(size, dtype=torch.uint8), 1, mass), "q's dtype"),
        ((q.double(), k.double(), None, 0, torch.empty(size, dtype=torch.uint8), 1, mass), "float16 or float32"),
        ((q, k, None, 0, torch.empty(size - 1, dtype=torch.uint8), 1, mass), "workspace"),
        ((q, k[:19], None, 0, torch.empty(size, dtype=torch.uint8), 1, mass), "same number of tokens"),
        ((q, k, None, 20, torch.empty(size, dtype=torch.uint8), 1, mass), "first observing query"),
        ((q[:, :3], k, None, 0, torch.empty(size, dtype=torch.uint8), 1, mass[:20]), "evenly"),
        ((q, k, None, 0, torch.empty(size, dtype=torch.uint8), 1, mass[:19]), "one value per key"),
        ((q, k.transpose(1, 2), None, 0, torch.empty(size, dtype=torch.uint8), 1, mass), "contiguous last"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            core.prefill_mass(*args)
    assert torch.equal(mass, torch.full((20,), 7.0))
    with pytest.raises(ValueError, match="float16 or float32"):
        core.prefill_mass_workspace_bytes(20, 2, 16, 1, "float64")


@DTYPES
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_prefill_pass_stays_under_the_cap_at_32k_tokens(model, dtype, isa_ceiling):
    heads, kv_heads, dim = SHAPES[model]
    tokens, window = 32 * 1024, 16
    gen = torch.Generator().manual_seed(0)
    # every token's rows alike (stride 0): real data to read, no 512 MiB of it
    q = torch.randn(1, heads, dim, generator=gen).to(dtype).expand(tokens, heads, dim)
    k = torch.randn(1, kv_heads, dim, generator=gen).to(dtype).expand(tokens, kv_heads, dim)
    threads, size = prefill_workspace_bytes(tokens, kv_heads, dim, dtype, DEFAULT_CAP_BYTES, threads=2)
    assert threads == 2 and size <= DEFAULT_CAP_BYTES
    with PeakMemory() as memory:
        mass = prefill_mass_cpp(q, k, None, window, DEFAULT_CAP_BYTES, threads=2)
    result = tokens * 4  # the mass itself: what the hook keeps, not workspace
    assert memory.peak - result == size and memory.largest <= DEFAULT_CAP_BYTES
    # equal scores: each of the last `window` queries spreads its weight evenly over what it sees
    seen = torch.arange(tokens - window + 1, tokens + 1, dtype=torch.float64)
    want = heads * (1.0 / seen[None, :] * (torch.arange(tokens)[:, None] < seen[None, :])).sum(dim=1)
    torch.testing.assert_close(mass.double(), want, rtol=1e-4, atol=1e-6)
