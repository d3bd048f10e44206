# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/attention_backend/interface.py``: ``KVCacheParams`` (a dataclass the model
engine builds anew every step with the logical past lengths, ``num_cached_tokens_per_seq``, a
list) and ``PositionalEmbeddingParams`` (what an attention backend gets when it fuses RoPE)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCacheParams:
    use_cache: bool = False
    num_cached_tokens_per_seq: list | None = None
    block_ids_per_seq: list | None = None
    host_max_attention_window_sizes: torch.Tensor | None = None
    host_sink_token_length: torch.Tensor | None = None
    num_extra_kv_tokens: int = 0


@dataclass
class PositionalEmbeddingParams:
    rope_theta: float = 10000.0


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Neox-style rotary embedding of ``x`` [tokens, heads, head_dim] at ``positions`` [tokens]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    a, b = x[..., :half].float(), x[..., half:].float()
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)
