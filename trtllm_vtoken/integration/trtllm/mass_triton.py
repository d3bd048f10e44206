# SPDX-License-Identifier: Apache-2.0
"""The attention-mass passes as Triton kernels, for CUDA pools (``mass.py`` picks them there).

Both read the keys in their own dtype where they lie (the pool, through the block table; the
prompt's rotated keys) and accumulate in float32. Neither uses atomics: every output element is
summed by one program in a fixed order, so a step's mass, and with it H2O's decisions, is the same
on every run and every tensor-parallel rank.

Decode, per chunk of rows and layers (the chunk's workspace bounded by the cap):

    scores:  grid (rows, layers, kv_heads)   one pass over the row's blocks: each key read once,
             its scores [group, tokens_per_block] stored, the softmax's log-sum-exp kept online
    mass:    grid (rows, blocks)             sum over layers and heads of exp(score - lse), added
                                             to the row's mass

Prefill, per context row (flash-style, two passes over the keys, workspace O(heads x tokens)):

    lse:     grid (query tiles, heads)       each query's log-sum-exp over the keys it may attend
    mass:    grid (key tiles, kv_heads)      sum over the query tiles that see the key tile and the
                                             group's heads of exp(score - lse)

Scores are tile products (``dot_kind``), on the tensor cores wherever that is exact. The suite
runs both passes under ``TRITON_INTERPRET=1`` on CPU tensors against ``scores.py``
(``test_mass_triton.py``) and builds them for sm_80 to sm_120 (``test_mass_triton_build.py``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from trtllm_vtoken.integration.trtllm.mass_plan import DEFAULT_CAP_BYTES, padded_block_table
from trtllm_vtoken.reclaim.upload import to_device


# Every launch's compile options: fused multiply-adds, what every Triton so far compiled by default
# and what the suite checks against the specification. Named, not left to the default: Triton 3.9
# warns that its default turns to unfused in 3.10, and a kernel should not change with the version.
COMPILE_OPTIONS = {"enable_fp_fusion": True}


def interpreting() -> bool:
    """Do the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, on CPU tensors)?
    Triton before 3.4 has no ``knobs`` and reads the variable itself."""
    if hasattr(triton, "knobs"):
        return bool(triton.knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tile_size(n: int) -> int:
    """A tile dimension holding n: a power of two, at least the 16 ``tl.dot`` takes."""
    return max(16, triton.next_power_of_2(n))


def dot_kind(q: torch.Tensor, k: torch.Tensor) -> str:
    """How the kernels form a tile of scores q . k (their DOT), each as exact as the float32
    specification: "half" where queries and keys share a half dtype (products of half values are
    exact in float32; the tensor cores sum them in float32); "split" for FP8 keys (their codes
    are exact in bf16, and so is each of three bf16 parts of a float32 query: three tensor-core
    products); "ieee" otherwise (float32, which TF32 would round, and mixed dtypes)."""
    if k.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "split"
    return "half" if q.dtype == k.dtype and q.dtype in (torch.float16, torch.bfloat16) else "ieee"


def prefill_tiles(head_dim: int, dot: str) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_stages, num_warps) of the prefill kernels. Half tiles: 64 queries
    by up to 64 keys, the key tile within 16 KiB, pipelined three deep by four warps, so that both
    kernels fit the 99 KiB of shared memory per block of the smallest sm_80+ parts (sm_86, sm_89,
    sm_120). Float32 tiles, whose products run on the FMA units out of registers: 32 by 32 (16
    keys past head_dim 256), unpipelined, by eight warps: the sizes at which Triton 3.6 and 3.9
    both keep them in registers on every architecture ``test_mass_triton_build.py`` builds for."""
    if dot == "ieee":
        return 32, 32 if head_dim <= 256 else 16, 1, 8
    block_n = 64
    while block_n > 16 and block_n * tile_size(head_dim) * 2 > 16 << 10:
        block_n //= 2
    return 64, block_n, 3, 4


@triton.jit
def _load_keys(past_ptr, k_ptr, position, d, kv_head, num_past, num_keys, past_token, k_token, kv_head_stride,
               DIM: tl.constexpr):
    """Keys [positions, DIM_P2] of one KV head from the past keys then the row's own, 0 past the end.
    One load through pointers chosen per position: two masked loads each took a pipelined tile of
    shared memory (192 KiB at head_dim 256 in bf16 with 64-key tiles, past the 163 KiB of an A100)."""
    in_past = position < num_past
    rows = tl.where(in_past, past_ptr + position * past_token, k_ptr + (position - num_past) * k_token)
    return tl.load(rows[:, None] + kv_head * kv_head_stride + d[None, :],
                   mask=(position < num_keys)[:, None] & (d < DIM)[None, :], other=0.0)


@triton.jit
def _half_product(a, b, acc, EMULATE: tl.constexpr):
    """acc + a @ b of half tiles in float32, on the tensor cores; EMULATE (the interpreter, whose
    half products are not exact) as IEEE float32 products of the same values, which are exact."""
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, out_dtype=tl.float32)


@triton.jit
def _tile_scores(q, k, scale, DOT: tl.constexpr, EMULATE: tl.constexpr):
    """Scores [queries, keys] of a query tile and a key tile, float32, formed as ``dot_kind`` says."""
    keys = tl.trans(k)
    s = tl.zeros([q.shape[0], k.shape[0]], tl.float32)
    if DOT == "half":
        s = _half_product(q, keys, s, EMULATE)
    elif DOT == "split":  # q = hi + mid + lo, each bf16: float32's 24 significant bits
        keys = keys.to(tl.bfloat16)
        rest = q.to(tl.float32)
        for _ in tl.static_range(3):
            part = rest.to(tl.bfloat16)
            s = _half_product(part, keys, s, EMULATE)
            rest -= part.to(tl.float32)
    else:
        s = tl.dot(q.to(tl.float32), keys.to(tl.float32), s, input_precision="ieee")
    return s * scale


@triton.jit
def _decode_scores_kernel(q_ptr, pool_ptr, table_ptr, lens_ptr, layers_ptr, scores_ptr, lse_ptr,
                          row0, layer0, num_layers_chunk, width, scale,
                          q_row, q_layer, q_head, p_block, p_layer, p_head, p_token, table_row,
                          NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                          TPB: tl.constexpr, TPB_P2: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr,
                          DOT: tl.constexpr, EMULATE: tl.constexpr):
    row, layer, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_len = tl.load(lens_ptr + row0 + row)
    pool_layer = tl.load(layers_ptr + layer0 + layer)
    g, d, t = tl.arange(0, GROUP_P2), tl.arange(0, DIM_P2), tl.arange(0, TPB_P2)
    heads = kv_head * GROUP + g
    # The group's queries as the rows of one tile product (padded to the tensor cores' 16), so
    # no [group, tokens, head_dim] product is ever held in registers.
    q = tl.load(q_ptr + (row0 + row) * q_row + (layer0 + layer) * q_layer + heads[:, None] * q_head + d[None, :],
                mask=(g < GROUP)[:, None] & (d < DIM)[None, :], other=0.0)
    unit = (row * num_layers_chunk + layer) * NUM_HEADS  # this (row, layer)'s first head in the workspace
    running_max = tl.full([GROUP_P2], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_P2], tl.float32)
    for j in range(0, tl.cdiv(kv_len, TPB)):
        block = tl.load(table_ptr + (row0 + row) * table_row + j)
        position = j * TPB + t
        live = (position < kv_len) & (t < TPB)
        k = tl.load(pool_ptr + block * p_block + pool_layer * p_layer + kv_head * p_head
                    + t[:, None] * p_token + d[None, :], mask=live[:, None] & (d < DIM)[None, :], other=0.0)
        s = _tile_scores(q, k, scale, DOT, EMULATE)  # [group, tokens]
        s = tl.where(live[None, :], s, float("-inf"))
        tl.store(scores_ptr + (unit + heads)[:, None] * width + position[None, :], s,
                 mask=(g < GROUP)[:, None] & live[None, :])
        new_max = tl.maximum(running_max, tl.max(s, axis=1))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(s - new_max[:, None]), axis=1)
        running_max = new_max
    tl.store(lse_ptr + unit + heads, running_max + tl.log(running_sum), mask=g < GROUP)


@triton.jit
def _decode_mass_kernel(scores_ptr, lse_ptr, lens_ptr, out_ptr, row0, num_layers_chunk, width, out_row,
                        NUM_HEADS: tl.constexpr, TPB: tl.constexpr, TPB_P2: tl.constexpr):
    row, j = tl.program_id(0), tl.program_id(1)
    kv_len = tl.load(lens_ptr + row0 + row)
    position = j * TPB + tl.arange(0, TPB_P2)
    live = (position < kv_len) & (tl.arange(0, TPB_P2) < TPB)
    total = tl.zeros([TPB_P2], tl.float32)
    for unit in range(0, num_layers_chunk * NUM_HEADS):  # (layer, head), in order
        head = row * num_layers_chunk * NUM_HEADS + unit
        s = tl.load(scores_ptr + head * width + position, mask=live, other=float("-inf"))
        total += tl.exp(s - tl.load(lse_ptr + head))
    before = tl.load(out_ptr + (row0 + row) * out_row + position, mask=live, other=0.0)
    tl.store(out_ptr + (row0 + row) * out_row + position, before + total, mask=live)


def decode_mass_triton(q: torch.Tensor, pool: torch.Tensor, block_lists: Sequence[Sequence[int]],
                       kv_lens: Sequence[int], layers: Sequence[int] | None = None,
                       cap_bytes: int = DEFAULT_CAP_BYTES) -> torch.Tensor:
    """``scores.batch_decode_attention_mass`` (same arguments, same result) in two kernels per
    chunk of rows and layers; the chunk's workspace (scores and log-sum-exps) stays within
    ``cap_bytes``."""
    batch, num_layers, num_heads, head_dim = q.shape
    tpb, num_kv_heads = pool.shape[4], pool.shape[3]
    table = padded_block_table(block_lists, kv_lens, tpb, batch)
    width = max(kv_lens, default=0)
    out = torch.zeros(batch, width, dtype=torch.float32, device=pool.device)
    if width == 0:
        return out
    padded = table.shape[1] * tpb
    unit_bytes = num_heads * (padded + 1) * 4  # one (row, layer): scores and log-sum-exps
    if unit_bytes > cap_bytes:
        raise ValueError(f"one decode row's scores over {padded} positions take {unit_bytes} bytes: more than "
                         f"the mass pass's cap of {cap_bytes} bytes")
    layer_chunk = min(num_layers, cap_bytes // unit_bytes)
    row_chunk = min(batch, cap_bytes // (unit_bytes * layer_chunk))
    q = q.contiguous()
    device_table = to_device(table, torch.int64, pool.device)  # no host wait (upload.py)
    lens = to_device(kv_lens, torch.int32, pool.device)
    pool_layers = to_device(layers if layers is not None else range(num_layers), torch.int32, pool.device)
    scores = torch.empty(row_chunk * layer_chunk * num_heads * padded, dtype=torch.float32, device=pool.device)
    lse = torch.empty(row_chunk * layer_chunk * num_heads, dtype=torch.float32, device=pool.device)
    group = num_heads // num_kv_heads
    sizes = dict(NUM_HEADS=num_heads, GROUP=group, GROUP_P2=tile_size(group), TPB=tpb, TPB_P2=tile_size(tpb),
                 DIM=head_dim, DIM_P2=tile_size(head_dim), DOT=dot_kind(q, pool), EMULATE=interpreting(),
                 **COMPILE_OPTIONS)
    for layer0 in range(0, num_layers, layer_chunk):
        layers_here = min(layer_chunk, num_layers - layer0)
        for row0 in range(0, batch, row_chunk):
            rows_here = min(row_chunk, batch - row0)
            _decode_scores_kernel[(rows_here, layers_here, num_kv_heads)](
                q, pool, device_table, lens, pool_layers, scores, lse, row0, layer0, layers_here, padded,
                1.0 / math.sqrt(head_dim), q.stride(0), q.stride(1), q.stride(2), pool.stride(0), pool.stride(1),
                pool.stride(3), pool.stride(4), device_table.stride(0), **sizes)
            _decode_mass_kernel[(rows_here, table.shape[1])](
                scores, lse, lens, out, row0, layers_here, padded, out.stride(0),
                NUM_HEADS=num_heads, TPB=tpb, TPB_P2=sizes["TPB_P2"], **COMPILE_OPTIONS)
    return out


@triton.jit
def _prefill_lse_kernel(q_ptr, past_ptr, k_ptr, lse_ptr, num_past, num_keys, num_queries, query_start, scale,
                        q_token, q_head, past_token, k_token, kv_head_stride,
                        GROUP: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, EMULATE: tl.constexpr):
    tile, head = tl.program_id(0), tl.program_id(1)
    m, d = tile * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, DIM_P2)
    query_position = query_start + m  # among the keys
    q = tl.load(q_ptr + m[:, None] * q_token + head * q_head + d[None, :],
                mask=(m < num_queries)[:, None] & (d < DIM)[None, :], other=0.0)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    for n0 in range(0, tl.minimum(query_start + (tile + 1) * BLOCK_M, num_keys), BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        k = _load_keys(past_ptr, k_ptr, n, d, head // GROUP, num_past, num_keys, past_token, k_token,
                       kv_head_stride, DIM)
        s = _tile_scores(q, k, scale, DOT, EMULATE)
        s = tl.where(n[None, :] <= query_position[:, None], s, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(s, axis=1))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(s - new_max[:, None]), axis=1)
        running_max = new_max
    tl.store(lse_ptr + head * num_queries + m, running_max + tl.log(running_sum), mask=m < num_queries)


@triton.jit
def _prefill_mass_kernel(q_ptr, past_ptr, k_ptr, lse_ptr, mass_ptr, num_past, num_keys, num_queries, query_start,
                         scale, q_token, q_head, past_token, k_token, kv_head_stride,
                         GROUP: tl.constexpr, DIM: tl.constexpr, DIM_P2: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, EMULATE: tl.constexpr):
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    n, d = tile * BLOCK_N + tl.arange(0, BLOCK_N), tl.arange(0, DIM_P2)
    k = _load_keys(past_ptr, k_ptr, n, d, kv_head, num_past, num_keys, past_token, k_token, kv_head_stride, DIM)
    total = tl.zeros([BLOCK_N], tl.float32)
    first_query = tl.maximum(tile * BLOCK_N - query_start, 0) // BLOCK_M * BLOCK_M  # the first that sees a key here
    for m0 in range(first_query, num_queries, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        sees = (n[None, :] <= (query_start + m)[:, None]) & (m < num_queries)[:, None]
        for g in range(0, GROUP):
            head = kv_head * GROUP + g
            q = tl.load(q_ptr + m[:, None] * q_token + head * q_head + d[None, :],
                        mask=(m < num_queries)[:, None] & (d < DIM)[None, :], other=0.0)
            lse = tl.load(lse_ptr + head * num_queries + m, mask=m < num_queries, other=0.0)
            s = _tile_scores(q, k, scale, DOT, EMULATE)
            total += tl.sum(tl.where(sees, tl.exp(s - lse[:, None]), 0.0), axis=0)
    tl.store(mass_ptr + kv_head * num_keys + n, total, mask=n < num_keys)


def prefill_mass_triton(q: torch.Tensor, k: torch.Tensor, past_k: torch.Tensor | None = None,
                        window: int | None = None, cap_bytes: int = DEFAULT_CAP_BYTES, block_m: int | None = None,
                        block_n: int | None = None) -> torch.Tensor:
    """``scores.prefill_attention_mass`` (same arguments, same result); its workspace is one
    float32 per query and head plus one per key and KV head (ValueError beyond ``cap_bytes``).
    ``block_m`` / ``block_n``: query and key tile sizes in place of ``prefill_tiles``' (tests)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_past = 0 if past_k is None else past_k.shape[0]
    num_keys = num_past + num_tokens
    first = 0 if window is None else max(0, num_tokens - window)
    queries = q[first:]
    num_queries = queries.shape[0]
    if k.stride(2) != 1 or queries.stride(2) != 1 or (past_k is not None and past_k.stride(2) != 1):
        raise ValueError("queries and keys must be contiguous in head_dim")
    past = past_k.to(k.dtype) if past_k is not None else k  # a pointer the kernels never read when num_past = 0
    if past.stride(1) != k.stride(1):
        raise ValueError(f"past keys' head stride {past.stride(1)} differs from the keys' {k.stride(1)}")
    workspace = (num_heads * num_queries + num_kv_heads * num_keys) * 4
    if workspace > cap_bytes:
        raise ValueError(f"the prefill mass of {num_queries} queries over {num_keys} keys needs {workspace} bytes: "
                         f"more than the mass pass's cap of {cap_bytes} bytes")
    lse = torch.empty(num_heads * num_queries, dtype=torch.float32, device=q.device)
    mass = torch.empty(num_kv_heads, num_keys, dtype=torch.float32, device=q.device)
    common = (num_past, num_keys, num_queries, num_past + first, 1.0 / math.sqrt(head_dim), queries.stride(0),
              queries.stride(1), past.stride(0), k.stride(0), k.stride(1))
    dot = dot_kind(q, k)
    tiles_m, tiles_n, num_stages, num_warps = prefill_tiles(head_dim, dot)
    block_m, block_n = block_m or tiles_m, block_n or tiles_n
    sizes = dict(GROUP=num_heads // num_kv_heads, DIM=head_dim, DIM_P2=tile_size(head_dim), BLOCK_M=block_m,
                 BLOCK_N=block_n, DOT=dot, EMULATE=interpreting(), num_stages=num_stages,
                 num_warps=num_warps, **COMPILE_OPTIONS)
    if num_queries:
        _prefill_lse_kernel[(triton.cdiv(num_queries, block_m), num_heads)](queries, past, k, lse, *common, **sizes)
        _prefill_mass_kernel[(triton.cdiv(num_keys, block_n), num_kv_heads)](queries, past, k, lse, mass, *common,
                                                                             **sizes)
    else:
        mass.zero_()
    return mass.sum(dim=0)
