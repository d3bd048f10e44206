# SPDX-License-Identifier: Apache-2.0
"""How many live tokens a request may keep: a fixed count or a ratio of its logical length, and
in what unit it gives tokens up.

A budget with ``unit`` u > 1 evicts in whole units: the tokens a request has lost (its logical
length minus its live tokens) are always a multiple of u. Its target for n tokens is the largest
count that keeps at most the plain target t(n) and loses a multiple of u::

    target(n) = n - u * min(ceil((n - t(n)) / u), n // u)          <= max(t(n), n mod u)

(a plain target less than one unit below n keeps the request's tokens until a whole unit can go;
the tokens short of a whole unit stay).
With u = tokens_per_block a dense host's physical length stays congruent to the logical length
modulo the block size, so a request needs a new block exactly when its logical length crosses a
block boundary, which is what TensorRT-LLM's capacity scheduler counts
(``getNeededBlocksOneStep`` reads the logical length). In position-shift mode the surviving keys
are then re-rotated once per u tokens instead of once per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class Budget:
    """Exactly one of ``tokens`` (a count) or ``ratio`` (kept fraction, in (0, 1]) is set."""

    tokens: int | None = None
    ratio: float | None = None
    unit: int = 1
    """Tokens are given up in multiples of this many (1: one at a time)."""

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.ratio is None):
            raise ValueError("a budget is either a token count or a retention ratio, not both/neither")
        if self.tokens is not None and self.tokens < 0:
            raise ValueError(f"budget must not be negative, got {self.tokens} tokens")
        if self.ratio is not None and not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"retention ratio must lie in (0, 1], got {self.ratio}")
        if isinstance(self.unit, bool) or not isinstance(self.unit, int) or self.unit < 1:
            raise ValueError(f"a budget's unit must be a positive integer, got {self.unit!r}")

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

    def in_units(self, unit: int) -> Budget:
        """The same budget, giving tokens up ``unit`` at a time."""
        return replace(self, unit=unit)

    def target(self, num_tokens: int) -> int:
        """Live tokens allowed for a request of ``num_tokens`` logical tokens."""
        if self.tokens is not None:
            plain = min(self.tokens, num_tokens)
        else:
            plain = min(num_tokens, math.ceil(self.ratio * num_tokens))
        if self.unit == 1:
            return plain
        lost_units = min(-(-(num_tokens - plain) // self.unit), num_tokens // self.unit)
        return num_tokens - self.unit * lost_units

    def most_kept(self, num_tokens: int) -> int:
        """The most live tokens a request keeps after any eviction while it grows to
        ``num_tokens``. A unit budget's target is not monotone in the length (count 10, unit 4:
        10 tokens kept at length 10, 8 at 12, 7 at 31), but it stays at most the plain target t,
        which is, or below one unit where fewer tokens than a unit could go (n mod u):
        max(t(num_tokens), min(num_tokens, u - 1))."""
        plain = replace(self, unit=1).target(num_tokens)
        return plain if self.unit == 1 else max(plain, min(num_tokens, self.unit - 1))

    def targets(self, num_tokens: np.ndarray) -> np.ndarray:
        """``target`` for an array of lengths (the same float arithmetic). int64, same shape."""
        num_tokens = np.asarray(num_tokens, dtype=np.int64)
        if self.tokens is not None:
            plain = np.minimum(self.tokens, num_tokens)
        elif self.ratio >= 1.0:  # the whole length (ceil(n) = n): no float pass
            plain = num_tokens.copy()
        else:
            plain = np.minimum(num_tokens, np.ceil(self.ratio * num_tokens).astype(np.int64))
        if self.unit == 1:
            return plain
        lost_units = np.minimum(-((plain - num_tokens) // self.unit), num_tokens // self.unit)
        return num_tokens - self.unit * lost_units

    def __str__(self) -> str:
        plain = f"{self.tokens} tokens" if self.tokens is not None else f"{self.ratio:g} of length"
        return plain if self.unit == 1 else f"{plain}, given up {self.unit} at a time"


class BoundsRule(NamedTuple):
    """A score policy's budget and candidate bounds as numbers (``ScorePolicy.bounds_rule``), for a
    native step that applies them to its own counters (``cpp/core/budget.h``, the same arithmetic):

        room = target(num_tokens - protected); n_sink = min(n_sink, room)
        recent = min(max(recent_window, int(room * recent_ratio)), room - n_sink)
        excess = num_live - protected - room; candidates: live ids in [n_sink, num_tokens - recent)

    where ``target`` gives tokens up ``unit`` at a time (``Budget.target``).
    """

    tokens: int
    """The count budget, or -1 where the budget is ``ratio``."""
    ratio: float
    n_sink: int
    recent_window: int
    recent_ratio: float
    unit: int = 1

    @classmethod
    def of(cls, budget: Budget, n_sink: int, recent_window: int, recent_ratio: float = 0.0) -> BoundsRule:
        tokens = -1 if budget.tokens is None else budget.tokens
        return cls(tokens, 1.0 if budget.ratio is None else budget.ratio, n_sink, recent_window, recent_ratio,
                   budget.unit)
