# SPDX-License-Identifier: Apache-2.0
"""How many live tokens a request may keep: a fixed count or a ratio of its logical length."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class Budget:
    """Exactly one of ``tokens`` (a count) or ``ratio`` (kept fraction, in (0, 1]) is set."""

    tokens: int | None = None
    ratio: float | None = None

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.ratio is None):
            raise ValueError("a budget is either a token count or a retention ratio, not both/neither")
        if self.tokens is not None and self.tokens < 0:
            raise ValueError(f"budget must not be negative, got {self.tokens} tokens")
        if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"retention ratio must lie in (0, 1], got {self.ratio}")

    @classmethod
    def parse(cls, value: int | float | str) -> Budget:
        """``512`` or ``"512"`` -> 512 tokens; ``0.5`` or ``"0.5"`` -> keep half. Raises ValueError."""
        if isinstance(value, str):
            try:
                value = int(value) if value.strip().lstrip("-").isdigit() else float(value)
            except ValueError:
                raise ValueError(f"budget {value!r} is neither a token count nor a ratio") from None
        if isinstance(value, bool):
            raise ValueError(f"budget must be a number, got {value!r}")
        if isinstance(value, int):
            return cls(tokens=value)
        if isinstance(value, float) and value > 1.0 and value.is_integer():
            return cls(tokens=int(value))
        return cls(ratio=float(value))

    def target(self, num_tokens: int) -> int:
        """Live tokens allowed for a request of ``num_tokens`` logical tokens."""
        if self.tokens is not None:
            return min(self.tokens, num_tokens)
        return min(num_tokens, math.ceil(self.ratio * num_tokens))

    def targets(self, num_tokens: np.ndarray) -> np.ndarray:
        """``target`` for an array of lengths (the same float arithmetic). int64, same shape."""
        num_tokens = np.asarray(num_tokens, dtype=np.int64)
        if self.tokens is not None:
            return np.minimum(self.tokens, num_tokens)
        if self.ratio >= 1.0:  # the whole length (ceil(n) = n): no float pass
            return num_tokens.copy()
        return np.minimum(num_tokens, np.ceil(self.ratio * num_tokens).astype(np.int64))

    def __str__(self) -> str:
        return f"{self.tokens} tokens" if self.tokens is not None else f"{self.ratio:g} of length"


class BoundsRule(NamedTuple):
    """A score policy's budget and candidate bounds as numbers (``ScorePolicy.bounds_rule``), for a
    native step that applies them to its own counters (``cpp/core/budget.h``, the same arithmetic):

        room = target(num_tokens - protected); n_sink = min(n_sink, room)
        recent = min(max(recent_window, int(room * recent_ratio)), room - n_sink)
        excess = num_live - protected - room; candidates: live ids in [n_sink, num_tokens - recent)
    """

    tokens: int
    """The count budget, or -1 where the budget is ``ratio``."""
    ratio: float
    n_sink: int
    recent_window: int
    recent_ratio: float

    @classmethod
    def of(cls, budget: Budget, n_sink: int, recent_window: int, recent_ratio: float = 0.0) -> BoundsRule:
        tokens = -1 if budget.tokens is None else budget.tokens
        return cls(tokens, 1.0 if budget.ratio is None else budget.ratio, n_sink, recent_window, recent_ratio)
