# SPDX-License-Identifier: Apache-2.0
"""The prefill mass pass on x86 CPUs with AMX-BF16 (``cpp/core/prefill_mass.cpp``), for bf16 rows.

The bounded torch pass (``mass_torch.py``) converts bf16 queries and keys to float32 first: torch
has no CPU product of bf16 matrices with float32 results, and a bf16 result would round the
scores before the softmax. This pass multiplies the bf16 rows in AMX tiles with float32 sums (as
the attention's own kernels do on these CPUs), then runs the same exact float32 softmax and
column sums, reading each KV head's keys once.

Its workspace is one tensor, sized by the kernel's own count (``prefill_mass_workspace_bytes``)
and allocated here, so the cap bounds it as it bounds the torch pass; threads (torch's count, at
most one per KV head) are given up one by one until it fits. Where it does not apply (another
dtype, a CPU or OS without AMX, the package built without its C++ core, a prompt whose
workspace exceeds the cap with one thread) the caller takes the torch pass.
"""

from __future__ import annotations

import torch

from trtllm_vtoken.core import native


def amx_available() -> bool:
    """The C++ core is built and this CPU and OS run AMX-BF16 (asks the OS once for the tile state)."""
    core = native.load()
    supported = getattr(core, "prefill_mass_amx_supported", None)  # None: no core, or one built before the pass
    return supported is not None and supported()


def describe() -> str:
    """One line for ``vtoken info``: which pass a CPU context row's mass takes here."""
    if native.load() is None:
        return "torch (the C++ core is not built)"
    if not hasattr(native.load(), "prefill_mass_amx_supported"):
        return "torch (the C++ core was built without the AMX pass: reinstall the package)"
    if not amx_available():
        return "torch (this CPU or OS has no AMX-BF16)"
    return "amx for bf16 rows (C++ core, AMX-BF16 tiles), torch for other dtypes"


def amx_workspace_bytes(num_keys: int, num_kv_heads: int, head_dim: int, cap_bytes: int,
                        threads: int | None = None) -> tuple[int, int] | None:
    """(threads, bytes) of the pass over ``num_keys`` keys within ``cap_bytes``: the most threads
    up to ``threads`` (default torch's count) whose workspace fits; None if one thread's does not
    or this CPU has no AMX pass (``amx_available``)."""
    if not amx_available():
        return None
    core = native.load()
    for count in range(min(threads or torch.get_num_threads(), num_kv_heads), 0, -1):
        size = core.prefill_mass_workspace_bytes(num_keys, num_kv_heads, head_dim, count)
        if size <= cap_bytes:
            return count, size
    return None


def amx_plan(q: torch.Tensor, k: torch.Tensor, past_k: torch.Tensor | None, cap_bytes: int,
             threads: int | None = None) -> tuple[int, int] | None:
    """(threads, workspace bytes) of this pass for a context row, or None where it does not apply:
    not every tensor bf16 on CPU, no AMX, or one thread's workspace over ``cap_bytes``."""
    tensors = (q, k) if past_k is None else (q, k, past_k)
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in tensors):
        return None
    num_keys = q.shape[0] + (0 if past_k is None else past_k.shape[0])
    return amx_workspace_bytes(num_keys, k.shape[1], q.shape[2], cap_bytes, threads)


def prefill_mass_amx(q: torch.Tensor, k: torch.Tensor, past_k: torch.Tensor | None, window: int | None,
                     cap_bytes: int, threads: int | None = None) -> torch.Tensor | None:
    """``scores.prefill_attention_mass`` (same arguments, same result to float32 rounding) of a
    bf16 CPU row, or None where this pass does not apply (``amx_plan``; the caller takes the torch pass)."""
    plan = amx_plan(q, k, past_k, cap_bytes, threads)
    if plan is None:
        return None
    count, size = plan
    num_tokens = q.shape[0]
    num_keys = num_tokens + (0 if past_k is None else past_k.shape[0])
    first = 0 if window is None else max(0, num_tokens - window)
    if first >= num_tokens:  # no query observes (an empty window)
        return torch.zeros(num_keys, dtype=torch.float32)
    workspace = torch.empty(size, dtype=torch.uint8)
    mass = torch.empty(num_keys, dtype=torch.float32)
    native.load().prefill_mass_amx(q, k, past_k, first, workspace, count, mass)
    return mass
