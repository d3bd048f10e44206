# SPDX-License-Identifier: Apache-2.0
"""The Triton mass kernels (``mass_triton.py``) equal their specification (``scores.py``): run by
Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``), and compiled on a CUDA device when
there is one. Random shapes, GQA groups, reused prefixes, windows, shuffled block tables, ragged
lengths, and chunks cut small by the cap.

``triton.jit`` decides at import whether a kernel is interpreted, so the interpreter's cases run
in a process of their own that starts with the variable set (``test_kernels_in_the_interpreter``
starts it); ``scripts/gpu_checks.sh`` runs the CUDA cases and times the kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.test_mass_passes import random_decode, random_prefill
from trtllm_vtoken.integration.trtllm.scores import batch_decode_attention_mass, prefill_attention_mass

pytest.importorskip("triton")
from trtllm_vtoken.integration.trtllm import mass_triton  # noqa: E402  (after the skip: Triton is optional)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["interpreter", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request) -> str:
    if request.param == "interpreter" and not INTERPRETED:
        pytest.skip("run by test_kernels_in_the_interpreter, in a process started with TRITON_INTERPRET=1")
    if request.param == "cuda" and (INTERPRETED or not torch.cuda.is_available()):
        pytest.skip("needs a CUDA device (and compiled kernels)")
    return "cpu" if request.param == "interpreter" else "cuda"


def test_kernels_in_the_interpreter():
    if INTERPRETED:
        pytest.skip("this is the interpreter's process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                          __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(3))
def test_prefill_kernels_equal_the_specification(device, seed, dtype):
    q, k, past_k, window = random_prefill(seed, dtype)
    want = prefill_attention_mass(q, k, chunk=5, past_k=past_k, window=window)  # on the CPU
    q, k, past_k = (t.to(device) if t is not None else None for t in (q, k, past_k))
    got = mass_triton.prefill_mass_triton(q, k, past_k, window, block_m=16, block_n=16)
    torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("seed", range(3))
def test_decode_kernels_equal_the_specification(device, seed, dtype):
    """Each way of forming scores (``dot_kind``): "ieee", "half", and for an FP8 pool "split"
    (float32 queries, as the manager scales them, against the codes)."""
    fp8 = dtype == torch.float8_e4m3fn
    q, pool, block_lists, kv_lens, layers = random_decode(seed, torch.float32 if fp8 else dtype)
    pool = pool.to(dtype)
    want = batch_decode_attention_mass(q, pool, block_lists, kv_lens, layers)  # on the CPU
    q, pool = q.to(device), pool.to(device)
    assert mass_triton.dot_kind(q, pool) == {torch.float32: "ieee", torch.float8_e4m3fn: "split"}.get(dtype, "half")
    padded = -(-max(kv_lens) // pool.shape[4]) * pool.shape[4]
    one_unit = q.shape[2] * (padded + 1) * 4  # a (row, layer)'s workspace: a chunk of one
    for cap in (1 << 20, one_unit) if seed % 2 else (one_unit,):
        got = mass_triton.decode_mass_triton(q, pool, block_lists, kv_lens, layers, cap)
        torch.testing.assert_close(got.cpu(), want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="cap"):
        mass_triton.decode_mass_triton(q, pool, block_lists, kv_lens, layers, one_unit - 1)


def test_the_prefill_workspace_is_refused_past_the_cap(device):
    q, k, past_k, window = random_prefill(3, torch.float32)
    with pytest.raises(ValueError, match="cap"):
        mass_triton.prefill_mass_triton(q, k, past_k, window, cap_bytes=64)
