# SPDX-License-Identifier: Apache-2.0
"""Reclamation settings: a frozen dataclass validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trtllm_vtoken.config_base import from_dict

Mode = Literal["dense", "lazy"]


@dataclass(frozen=True)
class ReclaimConfig:
    mode: Mode = "dense"
    """"dense": fill every hole before the next attention and release tail blocks (TensorRT-LLM
    kernels have no per-token mask). "lazy": leave holes masked; compact only when it frees a block."""
    fragmentation_threshold: int = 1
    """Lazy mode: plan a request once it holds this many blocks beyond ceil(live / tokens_per_block)."""
    check_invariants: bool = False
    """Check I1 (hash of live ids + KV bytes before/after), I2 and I4 on every relocation."""

    def __post_init__(self) -> None:
        if self.mode not in ("dense", "lazy"):
            raise ValueError(f"mode must be 'dense' or 'lazy', got {self.mode!r}")
        if self.fragmentation_threshold < 1:
            raise ValueError(f"fragmentation_threshold must be >= 1, got {self.fragmentation_threshold}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ReclaimConfig:
        """Builds a config from a mapping; an unknown key is an error, never ignored."""
        return from_dict(cls, values)

