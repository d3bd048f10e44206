# SPDX-License-Identifier: Apache-2.0
"""The attention-mass passes the TensorRT-LLM manager runs, on the best implementation at hand.

    prefill_mass   one context row, inside the attention hook (layer by layer)
    decode_mass    a batch's decode rows, all layers of one pool, in ``update_resources``

CUDA tensors with Triton 3.2 or later installed take the Triton kernels (``mass_triton.py``);
CPU context rows (bf16, fp16, float32) on a CPU with AVX-512, and bf16 pools' decode rows on one
with AMX-BF16 or AVX-512 BF16, the C++ passes (``mass_cpp.py``);
everything else the bounded torch passes (``mass_torch.py``). All compute ``scores.py``'s specification and hold at most
``cap_bytes`` of workspace (``VTokenSettings.mass_workspace_mib``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Sequence
from functools import cache

import torch

from trtllm_vtoken.integration.trtllm.mass_cpp import (
    bf16_kind,
    decode_bf16_plan,
    decode_mass_bf16,
    prefill_mass_cpp,
    prefill_plan,
)
from trtllm_vtoken.integration.trtllm.mass_plan import DEFAULT_CAP_BYTES
from trtllm_vtoken.integration.trtllm.mass_torch import decode_mass_torch, prefill_mass_torch


# The oldest Triton the kernels build and compute right with (tests/integration/test_mass_triton*.py
# run against 3.2 to 3.9; 3.0 and 3.1 lack what they use): torch 2.6's. Older torch builds ship
# older Triton, and their CUDA pools take the torch passes.
TRITON_MIN = (3, 2)


@cache
def triton_version() -> str | None:
    """The installed Triton's version (from its metadata, not imported), or None without one."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@cache
def triton_usable() -> bool:
    """Is a Triton of ``TRITON_MIN`` or later installed? (Asked per pass: decided once.)"""
    version = triton_version()
    try:
        return version is not None and tuple(int(part) for part in version.split("+")[0].split(".")[:2]) >= TRITON_MIN
    except ValueError:
        return False


def describe_cuda() -> str:
    """What CUDA pools' mass passes are here, for ``vtoken info``."""
    version = triton_version()
    if version is None:
        return "torch passes (Triton is not installed)"
    if triton_usable():
        return f"Triton kernels (triton {version})"
    return f"torch passes (triton {version}: the kernels need {'.'.join(map(str, TRITON_MIN))} or later)"


def mass_backend(device: torch.device | str) -> str:
    """"triton" for CUDA tensors where a usable Triton is installed (``triton_usable``), else
    "torch": the family of passes a device takes (on CPU, rows and pools may take the C++ passes,
    "amx", "avx512-bf16" or "avx512": ``prefill_pass`` and ``decode_pass`` name the pass of given tensors)."""
    return "triton" if torch.device(device).type == "cuda" and triton_usable() else "torch"


def prefill_pass(q: torch.Tensor, k: torch.Tensor, past_k: torch.Tensor | None = None,
                 cap_bytes: int = DEFAULT_CAP_BYTES) -> str:
    """The pass ``prefill_mass`` runs for this context row: "triton", "amx", "avx512-bf16",
    "avx512" or "torch" (what it decides, named; ``prefill_mass`` decides once, by trying the C++ pass)."""
    if mass_backend(q.device) == "triton":
        return "triton"
    plan = prefill_plan(q, k, past_k, cap_bytes)
    return "torch" if plan is None else plan[0]


def prefill_mass(q: torch.Tensor, k: torch.Tensor, past_k: torch.Tensor | None = None, window: int | None = None,
                 cap_bytes: int = DEFAULT_CAP_BYTES) -> torch.Tensor:
    """``scores.prefill_attention_mass`` of one context row, float32 [num_past + num_tokens]."""
    if mass_backend(q.device) == "triton":
        from trtllm_vtoken.integration.trtllm.mass_triton import prefill_mass_triton

        return prefill_mass_triton(q, k, past_k, window, cap_bytes=cap_bytes)
    mass = prefill_mass_cpp(q, k, past_k, window, cap_bytes)  # None where it does not apply (prefill_plan)
    return mass if mass is not None else prefill_mass_torch(q, k, past_k, window, cap_bytes)


def decode_pass(q: torch.Tensor, pool: torch.Tensor, kv_lens: Sequence[int],
                cap_bytes: int = DEFAULT_CAP_BYTES) -> str:
    """The pass ``decode_mass`` runs for these rows: "triton", "amx", "avx512-bf16" or "torch"
    (what it decides, named; ``decode_mass`` decides once, by trying the C++ pass)."""
    if mass_backend(pool.device) == "triton":
        return "triton"
    return bf16_kind() if decode_bf16_plan(q, pool, kv_lens, cap_bytes) is not None else "torch"


def decode_mass(q: torch.Tensor, pool: torch.Tensor, block_lists: Sequence[Sequence[int]], kv_lens: Sequence[int],
                layers: Sequence[int] | None = None, cap_bytes: int = DEFAULT_CAP_BYTES) -> torch.Tensor:
    """``scores.batch_decode_attention_mass`` of a batch's decode rows, float32 [batch, max(kv_lens)]."""
    if mass_backend(pool.device) == "triton":
        from trtllm_vtoken.integration.trtllm.mass_triton import decode_mass_triton

        return decode_mass_triton(q, pool, block_lists, kv_lens, layers, cap_bytes)
    mass = decode_mass_bf16(q, pool, block_lists, kv_lens, layers, cap_bytes)  # None where it does not apply
    return mass if mass is not None else decode_mass_torch(q, pool, block_lists, kv_lens, layers, cap_bytes)
