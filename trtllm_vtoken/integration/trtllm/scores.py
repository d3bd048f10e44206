# SPDX-License-Identifier: Apache-2.0
"""Attention mass for H2O / Scissorhands on the TensorRT-LLM path, safe under CUDA graphs.

TensorRT-LLM's fused attention op returns no probabilities. Instead, the decode queries (after
RoPE) are copied into a static buffer during the forward, a copy a captured graph repeats on
replay, and after the step the mass each cached token received is recomputed from them and the
keys, gathered through the block list (HND inside a block, the layout the TRTLLM kernels write):

    q_buffer:  [max_batch_size, num_layers, num_heads, head_dim]     written inside the forward
    pool:      [num_blocks, layers_in_pool, 2, num_kv_heads, tokens_per_block, head_dim]
    mass[t] =  sum over layers and heads of softmax_t(q . k_t / sqrt(head_dim))   t < kv_len

which is exactly what the reference runtime's paged attention reports for a decode row.

Prefill (context) steps are never captured, so their mass is computed inside the forward, layer by
layer, from the prompt's own rotated queries and keys (``prefill_attention_mass``, causal) and
accumulated per context row until the manager's update reads it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from trtllm_vtoken.integration.trtllm.mass import prefill_mass
from trtllm_vtoken.integration.trtllm.mass_plan import DEFAULT_CAP_BYTES, padded_block_table


GATHER_BYTES = 256 << 20
"""The float32 keys one pass of ``batch_decode_attention_mass`` gathers, at most, unless one row
alone needs more (its pass then takes that row alone, as a row's own call did): the transient
memory it takes beside a KV pool that fills the device."""


def batch_decode_attention_mass(q: torch.Tensor, pool: torch.Tensor, block_lists: Sequence[Sequence[int]],
                                kv_lens: Sequence[int], layers: Sequence[int] | None = None) -> torch.Tensor:
    """Mass per position for a batch of decode rows, computed for all of them at once.

    Args:
        q: [batch, num_layers, num_heads, head_dim], each row's rotated queries per layer.
        pool: [num_blocks, num_layers, 2, num_kv_heads, tokens_per_block, head_dim].
        block_lists: each row's block list; positions map to ``blocks[p // tpb], p % tpb``.
        kv_lens: each row's positions.
        layers: pool layer of each layer of ``q`` (default: the same index).
    Returns: float32 [batch, max(kv_lens)] on ``pool.device``; a row's columns past its kv_len are 0.

    The rows share one padded block table (padding: block 0, its scores masked out before the
    softmax) and go in chunks of rows (``GATHER_BYTES``), each one gather of every layer's keys
    and one einsum: the launches grow with the chunks, not the rows, and the caller copies one
    tensor to the host.
    """
    batch, num_layers, num_heads, head_dim = q.shape
    tpb, num_kv_heads = pool.shape[4], pool.shape[3]
    table = padded_block_table(block_lists, kv_lens, tpb, batch)
    width = max(kv_lens, default=0)
    if width == 0:
        return torch.zeros(batch, 0, dtype=torch.float32, device=pool.device)
    columns = table.shape[1]
    device_table = torch.from_numpy(table).to(pool.device)[:, None, :]  # [B, 1, nb]
    layer_index = torch.as_tensor(list(layers) if layers is not None else range(num_layers),
                                  device=pool.device)[None, :, None]  # [1, L, 1]
    dead = torch.arange(width, device=pool.device)[None, :] >= \
        torch.as_tensor(list(kv_lens), device=pool.device)[:, None]  # [B, T]
    group = num_heads // num_kv_heads
    chunk = max(1, GATHER_BYTES // (columns * tpb * num_layers * num_kv_heads * head_dim * 4))
    parts = []
    for start in range(0, batch, chunk):
        rows = slice(start, start + chunk)
        k = pool[device_table[rows], layer_index, 0]  # [b, L, nb, Hkv, tpb, D]: keys only, these layers
        b = k.shape[0]
        # one copy: heads before blocks, in float32 (a float32 pool: in the reshape) -> [b, L, Hkv, nb * tpb, D]
        k = k.transpose(2, 3).to(torch.float32, memory_format=torch.contiguous_format)
        k = k.reshape(b, num_layers, num_kv_heads, columns * tpb, head_dim)[:, :, :, :width]
        qg = q[rows].float().view(b, num_layers, num_kv_heads, group, head_dim)
        scores = torch.einsum("blhgd,blhtd->blhgt", qg, k) / math.sqrt(head_dim)
        scores.masked_fill_(dead[rows, None, None, None, :], float("-inf"))
        parts.append(torch.softmax(scores, dim=-1).sum(dim=(1, 2, 3)))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def prefill_attention_mass(q: torch.Tensor, k: torch.Tensor, chunk: int = 256,
                           past_k: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Mass per prompt position for one context row: the causal softmax of every query over the
    prompt's keys, summed over heads and queries (what paged attention reports for a prefill row).

    The specification of ``mass.prefill_mass`` (which computes the same in bounded memory).

    Args:
        q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim], after RoPE.
        chunk: queries per block of scores; bounds the memory to chunk x num_heads x num_tokens.
        past_k: [num_past, num_kv_heads, head_dim]: keys already in the cache before these tokens
            (a prompt prefix recovered from TensorRT-LLM's reuse tree, whose queries the forward
            does not run): the queries sit at positions ``num_past + i`` and attend to them too.
        window: only the prompt's last ``window`` queries count (H2O's ``prefill_window``, as
            SnapKV observes a prompt); None: all of them.
    Returns: float32 [num_past + num_tokens] on ``q.device`` (past positions get the mass these
        queries give them; what their own queries would add is not known).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_past = 0 if past_k is None else past_k.shape[0]
    first = 0 if window is None else max(0, num_tokens - window)
    keys = k if past_k is None else torch.cat([past_k.to(k.dtype), k])
    keys = keys.float().transpose(0, 1)  # [Hkv, P + T, D]
    positions = torch.arange(num_past + num_tokens, device=q.device)
    mass = torch.zeros(num_past + num_tokens, dtype=torch.float32, device=q.device)
    for start in range(first, num_tokens, chunk):
        rows = q[start : start + chunk].float()
        qg = rows.view(rows.shape[0], num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.einsum("chgd,htd->chgt", qg, keys) / math.sqrt(head_dim)  # [c, Hkv, g, P + T]
        future = positions[None, :] > positions[num_past + start : num_past + start + rows.shape[0], None]
        scores.masked_fill_(future[:, None, None, :], float("-inf"))
        mass += torch.softmax(scores, dim=-1).sum(dim=(0, 1, 2))
    return mass


class QueryRecorder:
    """The static query buffer the forward writes (one copy per layer, graph-safe).

    The buffer is allocated by the first ``record``, which TensorRT-LLM's warm-up forwards make
    before any graph is captured; captured graphs then copy into the same memory on every replay.
    ``max_batch_size`` is the most decode queries a batch really holds (the manager bounds it by
    the pool's blocks, ``max_batch_size`` rows of 1 + draft tokens and ``max_num_tokens``): rows
    past it, the padding a captured batch size adds after the real requests, are not recorded. Its
    size is ``max_batch_size x num_layers x num_heads x head_dim`` in the queries' dtype.

    Prefill mass is computed as the forward goes (``mass.prefill_mass``: the prompt's last
    ``prefill_window`` queries, or all of them; at most ``cap_bytes`` of workspace per layer).
    """

    def __init__(self, max_batch_size: int, num_layers: int, head_dim: int, device: torch.device | str,
                 prefill_window: int | None = None, cap_bytes: int = DEFAULT_CAP_BYTES) -> None:
        self.max_batch_size, self.num_layers, self.head_dim, self.device = max_batch_size, num_layers, head_dim, device
        self.prefill_window, self.cap_bytes = prefill_window, cap_bytes
        self.q: torch.Tensor | None = None  # [max_batch_size, num_layers, num_heads, head_dim]
        self.prefill: dict[int, torch.Tensor] = {}  # context row -> mass [prompt_len], all layers so far
        self.kv_scales: dict[int, torch.Tensor] = {}
        """FP8 pools: local layer -> its attention's ``kv_scale_quant_orig`` ([1], value = code x
        scale), noted by the forward hook; the mass dequantizes the codes it reads with it."""

    def note_kv_scale(self, layer: int, attention) -> None:
        """Keeps the layer's dequantization scale where TensorRT-LLM keeps it (``TrtllmAttention``'s
        ``kv_scale_quant_orig``, filled from a calibrated checkpoint), for an FP8 KV cache."""
        if getattr(attention, "has_fp8_kv_cache", False):
            self.kv_scales[layer] = attention.kv_scale_quant_orig

    def kv_scale(self, layer: int) -> torch.Tensor:
        """The layer's FP8 dequantization scale [1]. RuntimeError if the hook never saw it (the
        mass would score codes as values)."""
        if layer not in self.kv_scales:
            raise RuntimeError(f"layer {layer}'s KV is FP8 but its attention's scale was never seen "
                               "(has_fp8_kv_cache is not set on its TrtllmAttention)")
        return self.kv_scales[layer]

    def dequantized(self, layer: int, codes: torch.Tensor) -> torch.Tensor:
        """Values of KV read from an 8-bit pool (``codes`` as stored), float32; other pools' as they are."""
        if codes.element_size() != 1:
            return codes
        return codes.float() * self.kv_scale(layer).to(codes.device)

    def start_batch(self) -> None:
        """A new iteration: forgets the previous one's prefill mass."""
        self.prefill = {}

    def add_prefill(self, row: int, q: torch.Tensor, k: torch.Tensor, past_k: torch.Tensor | None = None,
                    prompt_after: int = 0) -> None:
        """Adds one layer's mass for context row ``row`` (q: [T, H, D], k: [T, Hkv, D]; past_k:
        the keys cached before these tokens: a reused prefix or the prompt's earlier chunks, see
        ``prefill_attention_mass``; ``prompt_after``: prompt tokens after this chunk, which hold
        the last ``prompt_after`` of the ``prefill_window`` queries)."""
        window = None if self.prefill_window is None else max(0, self.prefill_window - prompt_after)
        mass = prefill_mass(q, k, past_k, window, self.cap_bytes)
        self.prefill[row] = mass if row not in self.prefill else self.prefill[row] + mass

    def record(self, layer_idx: int, q: torch.Tensor, num_generation: int) -> None:
        """q: [num_tokens, num_heads * head_dim]; the last ``num_generation`` tokens are the decode
        rows' (TensorRT-LLM orders context tokens first; a decode row with draft tokens has one
        query per token, its own first)."""
        flat = q.reshape(q.shape[0], -1)
        num_heads = flat.shape[1] // self.head_dim
        if self.q is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the query buffer must be allocated by a warm-up forward, not during capture")
            self.q = torch.zeros(self.max_batch_size, self.num_layers, num_heads, self.head_dim,
                                 dtype=q.dtype, device=self.device)
        kept = min(num_generation, self.max_batch_size)  # real rows come first, padding after them
        rows = flat[flat.shape[0] - num_generation :][:kept]
        self.q[:kept, layer_idx].copy_(rows.view(kept, num_heads, self.head_dim))
