# SPDX-License-Identifier: Apache-2.0
"""The GPT attention plugin's RoPE as a ``trtllm-build`` engine carries it, independent of
``trtllm_vtoken/reclaim/rope.py`` (imitated, not copied):

* the table: ``RopeEmbeddingUtils.create_sinusoidal_positions_for_attention_plugin``
  (``tensorrt_llm/functional.py``, 1.2-era copies, index ids 30567404260 and 30748268108). The
  inverse frequencies are ``scale / (theta ** (arange(0, dim, 2) / dim))`` rounded to float32
  (linear scaling: ``scale = 1 / factor``; Llama 3: ``apply_llama3_scaling`` on the unscaled
  frequencies, one wavelength test per pair); the angles are ``position * inv_freq``, both
  float32 and the product rounded to float32; the table holds float32 (cos, sin) per position
  and pair, built once for ``max_position_embeddings`` positions by the attention layer
  (``Attention.create_attention_const_params``, index id 29227859985) and passed to the plugin
  as ``rotary_cos_sin``;
* the rotation: the kernel reads a pair's (cos, sin) for the token's position from that table and
  turns the pair in float32, NeoX style for Llama (``rope_gpt_neox``: pair i is dimensions i and
  i + dim / 2).

So every angle the plugin uses is a float32 product, and a key written at position p + d and
turned back by vToken's float64 angle of -d differs from one written at p by that rounding.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def plugin_inv_freq(dim: int, theta: float, scaling: Mapping[str, Any] | None) -> np.ndarray:
    """float32 [dim / 2], as the plugin's table builder computes them."""
    scaling = dict(scaling or {})
    kind = scaling.get("rope_type", scaling.get("type"))
    exponents = np.arange(0, dim, 2) / dim  # float64, as numpy divides
    if kind == "llama3":
        inv = 1.0 / (theta ** exponents).astype(np.float32)
        factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        original = float(scaling["original_max_position_embeddings"])
        out = []
        for f in inv:
            wavelength = 2 * math.pi / f
            if wavelength < original / high:
                out.append(f)
            elif wavelength > original / low:
                out.append(f / factor)
            else:
                smooth = (original / wavelength - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        return np.array(out, dtype=np.float32)
    scale = 1.0 / float(scaling["factor"]) if kind == "linear" else 1.0
    return (scale / (theta ** exponents).astype(np.float32)).astype(np.float32)


class PluginRope:
    """The plugin's (cos, sin) table for ``num_pos`` positions and its NeoX rotation."""

    def __init__(self, num_pos: int, dim: int, theta: float, scaling: Mapping[str, Any] | None = None) -> None:
        self.dim = dim
        inv = plugin_inv_freq(dim, theta, scaling)
        angles = np.einsum("i,j->ij", np.arange(num_pos, dtype=np.float32), inv, dtype=np.float32)
        self.cos = torch.from_numpy(np.cos(angles).astype(np.float32))  # [num_pos, dim / 2]
        self.sin = torch.from_numpy(np.sin(angles).astype(np.float32))

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` [..., T, heads, dim] turned by each position's table entry, in float32."""
        if int(positions.max()) >= self.cos.shape[0]:
            raise IndexError(f"position {int(positions.max())} beyond the table's {self.cos.shape[0]}")
        cos, sin = self.cos[positions][..., None, :], self.sin[positions][..., None, :]  # [T, 1, dim / 2]
        x32, half = x.float(), self.dim // 2
        first, second = x32[..., :half], x32[..., half : self.dim]
        turned = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
        return torch.cat([turned, x32[..., self.dim :]], dim=-1).to(x.dtype)
