# SPDX-License-Identifier: Apache-2.0
"""Eviction policies see logical ids and statistics, never blocks (design §4).

A policy is asked, per request and step, which live tokens to evict so the request fits its
budget. ``ScorePolicy`` owns what every score-based policy shares (sink tokens, a recent window,
protected tokens, bottom-k selection); a concrete policy only scores.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from trtllm_vtoken.policies.budget import Budget
from trtllm_vtoken.registry import Registry

POLICIES: Registry[type["EvictionPolicy"]] = Registry("eviction policy")


@dataclass(frozen=True)
class PolicyView:
    """What a policy may see of one request at one step. Read-only."""

    req_id: int
    num_tokens: int
    """Logical length so far (prompt + generated). Logical ids are [0, num_tokens)."""
    live_ids: np.ndarray
    """Live logical ids, ascending. Shape: (num_live,), int64. An id is also its position."""
    protected: np.ndarray
    """True where a live id may not be evicted (its block is shared). Shape: (num_live,), bool."""


@dataclass
class EvictionPolicy(ABC):
    """Decides which live tokens of a request die. Stateful only through its statistics."""

    budget: Budget = field(default_factory=lambda: Budget(ratio=0.5))

    def observe(self, req_id: int, token_ids: np.ndarray, attention: np.ndarray) -> None:
        """Records attention received by ``token_ids`` at one step (summed over heads, layers and
        queries). Shapes: (n,) int64 and (n,) float. Default: ignored."""

    def forget(self, req_id: int) -> None:
        """Drops the statistics of a finished request. Default: nothing kept."""

    @abstractmethod
    def select(self, view: PolicyView) -> np.ndarray:
        """Logical ids to evict now, ascending, never protected ones. Pure for the table.

        Returns: Shape (num_evict,), int64; empty when the request is within its budget.
        """


@dataclass
class ScorePolicy(EvictionPolicy):
    """Keeps the highest-scoring tokens; sinks and the most recent tokens always survive.

    Evicts ``num_live - budget.target(num_tokens)`` tokens among the unprotected ones, lowest
    score first (ties: lower id first). If protection leaves too few candidates, evicts all of
    them: a policy never asks the table to evict a protected token.
    """

    n_sink: int = 0
    """The first ``n_sink`` logical tokens (attention sinks) are never evicted."""
    recent_window: int = 0
    """The newest ``recent_window`` logical tokens are never evicted."""

    def __post_init__(self) -> None:
        if self.n_sink < 0 or self.recent_window < 0:
            raise ValueError(f"n_sink ({self.n_sink}) and recent_window ({self.recent_window}) must be >= 0")

    @abstractmethod
    def score(self, view: PolicyView) -> np.ndarray:
        """Importance of each live token, higher = keep. Shape: (num_live,), float."""

    def recent_tokens(self, target: int) -> int:
        """How many of the newest tokens to protect at this budget target."""
        return self.recent_window

    def select(self, view: PolicyView) -> np.ndarray:
        target = self.budget.target(view.num_tokens)
        excess = len(view.live_ids) - target
        if excess <= 0:
            return np.zeros(0, dtype=np.int64)
        ids = view.live_ids
        # Protected tokens are kept whatever the budget; sinks and the recent window are
        # preferences that shrink so the budget can still be met.
        room = max(0, target - int(view.protected.sum()))
        n_sink = min(self.n_sink, room)
        recent = min(self.recent_tokens(target), room - n_sink)
        candidate = ~view.protected & (ids >= n_sink) & (ids < view.num_tokens - recent)
        cand_ids = ids[candidate]
        if len(cand_ids) <= excess:
            return cand_ids.astype(np.int64)
        scores = np.asarray(self.score(view), dtype=np.float64)[candidate]
        order = np.lexsort((cand_ids, scores))[:excess]
        return np.sort(cand_ids[order]).astype(np.int64)


def make_policy(name: str, budget: Budget | int | float | str, **kwargs) -> EvictionPolicy:
    """Builds a registered policy. Unknown names raise KeyError, unknown options ValueError."""
    cls = POLICIES.get(name)
    if not isinstance(budget, Budget):
        budget = Budget.parse(budget)
    known = set(cls.__dataclass_fields__) - {"budget"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for policy {name!r}; known: {sorted(known)}")
    return cls(budget=budget, **kwargs)
