# SPDX-License-Identifier: Apache-2.0
"""A model's rotary position embedding (RoPE), as far as rotating cached keys depends on it.

RoPE turns each pair i of a head's dimensions by the angle ``a_i(p) = p * inv_freq[i]``. When
every angle is linear in the position p, two rotations compose into one at the summed position,
and a score ``q(p_q) . k(p_k)`` depends only on ``p_q - p_k``. That is what position-shift mode
relies on: rotating a cached key by ``-d * inv_freq`` moves it to position ``p - d`` exactly.

Which pairs rotate together inside ``head_dim`` (only the first ``rotary_dim`` dimensions rotate):

    "neox"  Hugging Face Llama's rotate_half, TensorRT-LLM's rope_gpt_neox:
            pair i = (x[i], x[i + rotary_dim / 2])         [x0 x1 x2 x3 | y0 y1 y2 y3]
    "gptj"  interleaved, TensorRT-LLM's rope_gptj:
            pair i = (x[2i], x[2i + 1])                     [x0 y0 x1 y1 x2 y2 x3 y3]

Scaling types accepted (each keeps every angle linear in the position; the frequencies are fixed
when the model is built, independent of the sequence length):

    default   inv_freq[i] = theta ** (-2i / rotary_dim)
    linear    the default frequencies divided by ``factor`` (position interpolation: p / factor)
    llama3    each default frequency rescaled by a function of its own wavelength only (low
              frequencies divided by ``factor``, high ones kept, a smooth blend between)

Refused, with the reason (``check_shiftable``): ``dynamic`` (NTK: frequencies recomputed from the
current sequence length), ``longrope``/``su`` (switch between short and long factors with the
sequence length), ``mrope`` (3-D positions), ALiBi and learned or relative position embeddings
(not a rotation of the key). ``yarn`` keeps angles linear too, but its frequency ramp is not
implemented here, so it is refused as unsupported rather than silently approximated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

Style = Literal["neox", "gptj"]

POSITION_LINEAR = ("default", "linear", "llama3")

NOT_POSITION_LINEAR = {
    "dynamic": "dynamic NTK scaling recomputes the frequencies from the current sequence length, so keys "
               "rotated earlier used other frequencies than the queries rotated later",
    "longrope": "LongRoPE switches between its short and long frequency factors when the sequence passes "
                "original_max_position_embeddings",
    "su": "LongRoPE ('su') switches between its short and long frequency factors with the sequence length",
    "mrope": "multimodal RoPE rotates by 3-D (time, height, width) positions, not by one sequence position",
    "long_rope": "LongRoPE switches between its short and long frequency factors with the sequence length",
    "alibi": "ALiBi biases scores by the kernel's physical query-key distance, which compaction changes "
             "and no rotation of the keys can restore",
    "alibi_with_scale": "ALiBi biases scores by the kernel's physical query-key distance, which compaction "
                        "changes and no rotation of the keys can restore",
    "learned_absolute": "learned absolute positions are added to the embeddings, not rotated into the keys",
    "relative": "relative position biases are computed from physical distances, not rotated into the keys",
}

# TensorRT-LLM's PositionEmbeddingType values that are RoPE, and their pair layout.
TRTLLM_ROPE_STYLES: dict[str, Style] = {"rope_gpt_neox": "neox", "rope_gptj": "gptj"}

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    """The scaling's type name ("default" when there is none); Hugging Face writes ``rope_type``
    (``type`` in older configs and in TensorRT-LLM's ``rotary_scaling``)."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def check_shiftable(scaling: Mapping[str, Any] | None, position_embedding: str = "rope_gpt_neox") -> None:
    """Raises ValueError unless re-rotating keys by a position shift is exact for this model and
    implemented here. ``position_embedding`` is TensorRT-LLM's ``position_embedding_type``."""
    if position_embedding in NOT_POSITION_LINEAR:
        raise ValueError(f"position shift needs position-linear RoPE: position_embedding_type "
                         f"{position_embedding!r} is refused: {NOT_POSITION_LINEAR[position_embedding]}")
    if position_embedding not in TRTLLM_ROPE_STYLES:
        raise ValueError(f"position_embedding_type {position_embedding!r} is not RoPE "
                         f"(known: {sorted(TRTLLM_ROPE_STYLES)})")
    kind = rope_type(scaling)
    if kind in NOT_POSITION_LINEAR:
        raise ValueError(f"position shift needs position-linear RoPE: rope_scaling type {kind!r} is refused: "
                         f"{NOT_POSITION_LINEAR[kind]}")
    if kind not in POSITION_LINEAR:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {list(POSITION_LINEAR)})")


@dataclass(frozen=True)
class RopeSpec:
    """One model's RoPE. ``scaling`` holds the ``rope_scaling`` mapping as sorted items.

    Raises ValueError on construction for a type that is not position-linear or not supported,
    or for missing scaling parameters.
    """

    head_dim: int
    theta: float = 10000.0
    rotary_dim: int = 0
    """Leading dimensions that rotate (0: all of ``head_dim``)."""
    style: Style = "neox"
    scaling: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even number, got {self.head_dim}")
        if self.rotary_dim == 0:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, {self.head_dim}], got {self.rotary_dim}")
        if self.style not in ("neox", "gptj"):
            raise ValueError(f"style must be 'neox' or 'gptj', got {self.style!r}")
        if self.theta <= 0:
            raise ValueError(f"theta must be positive, got {self.theta}")
        check_shiftable(dict(self.scaling))
        params = dict(self.scaling)
        kind = self.kind
        needed = ("factor",) if kind == "linear" else _LLAMA3_KEYS if kind == "llama3" else ()
        missing = [k for k in needed if params.get(k) is None]
        if missing:
            raise ValueError(f"rope_scaling type {kind!r} needs {missing}")

    @classmethod
    def from_scaling(cls, head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None,
                     rotary_dim: int = 0, style: Style = "neox") -> RopeSpec:
        return cls(head_dim, float(theta), rotary_dim, style, tuple(sorted((scaling or {}).items())))

    @classmethod
    def from_trtllm_config(cls, pretrained: Mapping[str, Any]) -> RopeSpec:
        """From an engine's ``config.json`` ``pretrained_config`` (``head_size``, ``rotary_base``,
        ``rotary_scaling``, ``position_embedding_type``, ``rotary_pct`` / ``rotary_dim``).
        ValueError if the model's positions cannot be shifted."""
        embedding = str(pretrained.get("position_embedding_type", "rope_gpt_neox"))
        scaling = pretrained.get("rotary_scaling")
        check_shiftable(scaling, embedding)
        head_dim = int(pretrained.get("head_size") or pretrained["hidden_size"] // pretrained["num_attention_heads"])
        rotary_dim = int(pretrained.get("rotary_dim") or round(head_dim * float(pretrained.get("rotary_pct", 1.0))))
        return cls.from_scaling(head_dim, float(pretrained.get("rotary_base", 10000.0)), scaling, rotary_dim,
                                TRTLLM_ROPE_STYLES[embedding])

    @property
    def kind(self) -> str:
        return rope_type(dict(self.scaling))

    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """float32 [rotary_dim / 2]: the angle per position of each rotating pair."""
        dim = self.rotary_dim
        base = 1.0 / (self.theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
        params = dict(self.scaling)
        if self.kind == "linear":
            return base / float(params["factor"])
        if self.kind == "llama3":
            return _llama3(base, params)
        return base


def _llama3(base: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1's rescaling: wavelengths longer than ``original / low_freq_factor`` are stretched
    by ``factor``, shorter than ``original / high_freq_factor`` kept, and blended in between."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params["original_max_position_embeddings"])
    wavelength = 2 * math.pi / base
    stretched = torch.where(wavelength > original / low, base / factor, base)
    blend = (original / wavelength - low) / (high - low)
    smoothed = (1 - blend) * stretched / factor + blend * stretched
    middle = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(middle, smoothed, stretched)


def apply_rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Turns each rotating pair of ``x`` by the angle whose cosine and sine are given; dimensions
    past ``rotary_dim`` pass through.

    Args:
        x: [..., head_dim], any float dtype; returned in ``x.dtype``.
        cos, sin: [..., rotary_dim / 2], broadcastable to x's leading dimensions. Their dtype sets
            the arithmetic: float32, or float64 (one rounding to ``x.dtype`` at the end).
    """
    dim = spec.rotary_dim
    rot, rest = x[..., :dim].to(cos.dtype), x[..., dim:]
    if spec.style == "neox":
        half = dim // 2
        turned = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot * torch.cat([cos, cos], dim=-1) + turned * torch.cat([sin, sin], dim=-1)
    else:
        even, odd = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([even * cos + -odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)
    out = out.to(x.dtype)
    return out if dim == spec.head_dim else torch.cat([out, rest], dim=-1)


def rotation_at(positions: torch.Tensor, spec: RopeSpec, dtype: torch.dtype = torch.float32):
    """(cos, sin) [..., rotary_dim / 2] of the angles ``positions * inv_freq``, computed in float64
    (exact angles, correctly rounded cosines) and returned in ``dtype``. Positions may be negative
    (a shift back)."""
    angles = positions.double()[..., None] * spec.inv_freq(positions.device).double()
    return angles.cos().to(dtype), angles.sin().to(dtype)
