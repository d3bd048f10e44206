# SPDX-License-Identifier: Apache-2.0
"""The C++ mass passes on x86 CPUs with AVX-512 (``cpp/core``).

Prefill (``prefill_mass.cpp``), any of bf16, fp16 and float32 rows: the bounded torch pass
(``mass_torch.py``) runs the scores as one matrix product per tile, written to memory and read back
by each of the softmax's steps; this pass packs each KV head's keys once and keeps 4 queries x 64
keys of scores in registers, then runs the same exact float32 softmax and column sums on them while
they are in cache. bf16 rows are multiplied as they are, with float32 sums (AMX-BF16 tiles or
AVX-512 BF16 pair dot products, as the attention's own kernels do on these CPUs: torch has no CPU
product of bf16 matrices with float32 results); fp16 and float32 rows (and bf16 ones on a CPU
without BF16) are converted exactly to float32 and multiplied with float32 FMAs. ``prefill_kind``
names the kind.

Its workspace is one tensor, sized by the kernel's own count (``prefill_mass_workspace_bytes``)
and allocated here, so the cap bounds it as it bounds the torch pass; threads (torch's count, at
most one per KV head) are given up one by one until it fits. Where it does not apply (another
dtype or device, mixed dtypes, a CPU or OS without AVX-512, the package built without its C++
core, a prompt whose workspace exceeds the cap with one thread) the caller takes the torch pass.

Decode (``decode_mass.cpp``), bf16 pools on a CPU with AMX-BF16 or AVX-512 BF16 (``bf16_kind``):
the torch pass gathers each layer's keys through the block table and converts them to float32
before scoring them (the keys cross memory about four times). This pass reads each block's keys
where the pool holds them (as AMX tiles, or key by key for the dot products), scores a KV head's
queries with float32 sums, and adds each query head's float32 softmax into the row's mass: the
keys are read once, in bf16. Threads take whole rows; its workspace (one row's scores per thread)
is allocated here under the cap, as above.

A ceiling bounds what the passes use whatever the CPU has (``limit_isa``, or ``VTOKEN_MAX_CPU_ISA``
in the environment): one machine with AMX can run, test and time the AVX-512 BF16 kind, the FMA
kind on bf16 rows, or the torch passes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from trtllm_vtoken.core import native
from trtllm_vtoken.integration.trtllm.mass_plan import DEFAULT_CAP_BYTES, padded_block_table


PREFILL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
"""The row dtypes the C++ prefill pass takes, by the name its binding knows them by."""


ISA_LEVELS = ("none", "avx512", "avx512-bf16", "amx")
"""What the passes may use, least first: a ceiling at a level lets the passes use it and those before it."""


def isa_ceiling() -> str | None:
    """The most the passes may use here (``ISA_LEVELS``): ``limit_isa``'s, else
    ``VTOKEN_MAX_CPU_ISA``'s, else "amx"; None without the core (or one built before the ceiling).
    ValueError where ``VTOKEN_MAX_CPU_ISA`` names no level (every question here raises it)."""
    ceiling = getattr(native.load(), "mass_isa_ceiling", None)
    return None if ceiling is None else ceiling()


def limit_isa(most: str | None) -> str | None:
    """Sets the most the passes may use from now on, in this process (a level of ``ISA_LEVELS``;
    None: ``VTOKEN_MAX_CPU_ISA``'s again); returns the limit it replaced (None: the environment's).
    ValueError for another name, RuntimeError without the core; nothing changed either way."""
    limit = getattr(native.load(), "limit_mass_isa", None)
    if limit is None:
        raise RuntimeError("the C++ core is not built (or was built before the ISA ceiling): reinstall the package")
    return limit(most)


@contextmanager
def isa_limited(most: str | None) -> Iterator[None]:
    """``limit_isa(most)`` for the block, the limit before restored after it."""
    before = limit_isa(most)
    try:
        yield
    finally:
        limit_isa(before)


def bf16_kind() -> str | None:
    """"amx" or "avx512-bf16": what the C++ passes score bf16 rows and pools with on this CPU;
    None without (no core, a core built before them, or neither instruction set)."""
    kind = getattr(native.load(), "bf16_mass_kind", None)
    return None if kind is None else kind()


def prefill_kind(dtype: torch.dtype) -> str | None:
    """"amx", "avx512-bf16" or "avx512": what the C++ prefill pass scores CPU rows of ``dtype``
    with here; None where it does not take them (another dtype, no core or one built before the
    pass, no AVX-512)."""
    kind = getattr(native.load(), "prefill_mass_kind", None)
    name = PREFILL_DTYPES.get(dtype)
    return None if kind is None or name is None else kind(name)


def describe() -> str:
    """One line for ``vtoken info``: which passes a CPU row's mass takes here."""
    if native.load() is None:
        return "torch (the C++ core is not built)"
    if not hasattr(native.load(), "prefill_mass_kind"):
        return "torch (the C++ core was built without these passes: reinstall the package)"
    prefill = ", ".join(f"{name} {prefill_kind(dtype) or 'torch'}" for dtype, name in PREFILL_DTYPES.items())
    decode = bf16_kind() or "torch"
    ceiling = isa_ceiling()
    limited = "" if ceiling in (None, "amx") else f" (limited to {ceiling}: VTOKEN_MAX_CPU_ISA or limit_isa)"
    return (f"context rows: {prefill}; decode rows: bf16 pools {decode}, other dtypes torch (C++ core where not "
            f"torch){limited}")


def prefill_workspace_bytes(num_keys: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, cap_bytes: int,
                            threads: int | None = None) -> tuple[int, int] | None:
    """(threads, bytes) of the prefill pass over ``num_keys`` keys of ``dtype`` within ``cap_bytes``,
    where the pass takes ``dtype`` (``prefill_kind``): the most threads up to ``threads`` (default
    torch's count) whose workspace fits; None if one thread's does not."""
    return _most_threads_within(cap_bytes, min(threads or torch.get_num_threads(), num_kv_heads),
                                lambda count: native.load().prefill_mass_workspace_bytes(
                                    num_keys, num_kv_heads, head_dim, count, PREFILL_DTYPES[dtype]))


def _most_threads_within(cap_bytes: int, most: int, workspace_bytes) -> tuple[int, int] | None:
    """(threads, bytes): the most threads up to ``most`` whose ``workspace_bytes(threads)`` fits
    ``cap_bytes`` (each thread holds its own region, so fewer threads need less); None if one's does not."""
    for count in range(most, 0, -1):
        size = workspace_bytes(count)
        if size <= cap_bytes:
            return count, size
    return None


def prefill_plan(q: torch.Tensor, k: torch.Tensor, past_k: torch.Tensor | None, cap_bytes: int,
                 threads: int | None = None) -> tuple[str, int, int] | None:
    """(kind, threads, workspace bytes) of the prefill pass for a context row, or None where it
    does not apply: not every tensor on CPU in one dtype the pass takes here (``prefill_kind``) with
    a contiguous last dimension, or one thread's workspace over ``cap_bytes``."""
    tensors = (q, k) if past_k is None else (q, k, past_k)
    if any(t.dtype != q.dtype or t.device.type != "cpu" or (t.shape[-1] > 1 and t.stride(-1) != 1) for t in tensors):
        return None
    kind = prefill_kind(q.dtype)
    if kind is None:
        return None
    num_keys = q.shape[0] + (0 if past_k is None else past_k.shape[0])
    fits = prefill_workspace_bytes(num_keys, k.shape[1], q.shape[2], q.dtype, cap_bytes, threads)
    return None if fits is None else (kind, *fits)


def prefill_mass_cpp(q: torch.Tensor, k: torch.Tensor, past_k: torch.Tensor | None, window: int | None,
                     cap_bytes: int, threads: int | None = None) -> torch.Tensor | None:
    """``scores.prefill_attention_mass`` (same arguments, same result to float32 rounding) of a
    CPU row, or None where this pass does not apply (``prefill_plan``; the caller takes the torch pass)."""
    plan = prefill_plan(q, k, past_k, cap_bytes, threads)
    if plan is None:
        return None
    _, count, size = plan
    num_tokens = q.shape[0]
    num_keys = num_tokens + (0 if past_k is None else past_k.shape[0])
    first = 0 if window is None else max(0, num_tokens - window)
    if first >= num_tokens:  # no query observes (an empty window)
        return torch.zeros(num_keys, dtype=torch.float32)
    workspace = torch.empty(size, dtype=torch.uint8)
    mass = torch.empty(num_keys, dtype=torch.float32)
    native.load().prefill_mass(q, k, past_k, first, workspace, count, mass)
    return mass


def decode_bf16_plan(q: torch.Tensor, pool: torch.Tensor, kv_lens: Sequence[int], cap_bytes: int,
                     threads: int | None = None) -> tuple[int, int] | None:
    """(threads, workspace bytes) of the decode pass for these rows, or None where it does not
    apply: q or the pool not bf16 on CPU, no C++ pass here (``bf16_kind``), a
    geometry it does not take (an odd head_dim, tokens_per_block neither below 16 nor a multiple
    of it), or one thread's workspace over ``cap_bytes``."""
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in (q, pool)) or bf16_kind() is None:
        return None
    core = native.load()
    tpb, head_dim = pool.shape[4], pool.shape[5]
    if not kv_lens or min(kv_lens) < 1 or not core.decode_mass_bf16_applies(tpb, head_dim):
        return None
    longest = max(kv_lens)
    return _most_threads_within(cap_bytes, min(threads or torch.get_num_threads(), len(kv_lens)),
                                lambda count: core.decode_mass_workspace_bytes(longest, tpb, head_dim, len(kv_lens),
                                                                               count))


def decode_mass_bf16(q: torch.Tensor, pool: torch.Tensor, block_lists: Sequence[Sequence[int]],
                     kv_lens: Sequence[int], layers: Sequence[int] | None = None, cap_bytes: int = DEFAULT_CAP_BYTES,
                     threads: int | None = None) -> torch.Tensor | None:
    """``scores.batch_decode_attention_mass`` (same arguments, same result to float32 rounding)
    of bf16 rows over a bf16 CPU pool, or None where this pass does not apply (``decode_bf16_plan``;
    the caller takes the torch pass)."""
    plan = decode_bf16_plan(q, pool, kv_lens, cap_bytes, threads)
    if plan is None:
        return None
    count, size = plan
    table = torch.from_numpy(padded_block_table(block_lists, kv_lens, pool.shape[4], q.shape[0]))
    pool_layers = torch.tensor(list(layers) if layers is not None else range(q.shape[1]), dtype=torch.int64)
    workspace = torch.empty(size, dtype=torch.uint8)
    mass = torch.empty(q.shape[0], max(kv_lens), dtype=torch.float32)
    native.load().decode_mass_bf16(q, pool[:, :, 0], table, torch.tensor(list(kv_lens), dtype=torch.int64),
                                  pool_layers, workspace, count, mass)
    return mass
