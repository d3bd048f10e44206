# SPDX-License-Identifier: Apache-2.0
"""Eviction policies see logical ids and statistics, never blocks (design §4).

A policy is asked which live tokens to evict so a request fits its budget, in two forms with one
answer:

    select(view)              one request (``PolicyView``): the specification, readable
    select_batch(view)        a whole batch at once (``BatchView``, padded [batch, length] arrays):
                              what hosts call every step, vectorised; equal to ``select`` row by row

``ScorePolicy`` owns what every score-based policy shares (sink tokens, a recent window,
protected tokens, bottom-k selection, both forms); a concrete policy only scores (``score`` and
``score_batch``) and, if it learns from attention, observes (``observe`` / ``observe_batch``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import Field, dataclass, field, fields
from typing import ClassVar

import numpy as np

from trtllm_vtoken.policies.batch import BatchView, BatchVictims, lowest_score_lowest_id
from trtllm_vtoken.policies.budget import BoundsRule, Budget
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
    """Decides which live tokens of a request die. Stateful only through its statistics.

    Rank-independent by construction (tensor / pipeline parallelism): a decision depends only on
    the request's table and the attention it observed, never on the process (no global RNG).
    """

    budget: Budget = field(default_factory=lambda: Budget(ratio=0.5))
    slot_stats: ClassVar[dict[str, type]] = {}
    """Per-token statistics ``observe_batch`` keeps, by name and numpy dtype. The step stores them
    per physical slot (0 for a new token) and moves them with the KV; ``BatchView.stats`` holds
    them in the batch layout."""

    def observe(self, req_id: int, token_ids: np.ndarray, attention: np.ndarray) -> None:
        """Records attention received by ``token_ids`` at one step (summed over heads, layers and
        queries), in position order. Shapes: (n,) int64 and (n,) float. Default: ignored."""

    def observe_batch(self, view: BatchView, mass: np.ndarray) -> None:
        """The batched ``observe``: ``mass`` [B, L] is the attention each position received (its
        value where no live token sits is meaningless); updates ``view.stats`` in place. Default:
        ignored."""

    def observes_attention(self) -> bool:
        """Does the policy learn from attention mass (hosts then compute it)?"""
        cls = type(self)
        return cls.observe is not EvictionPolicy.observe or cls.observe_batch is not EvictionPolicy.observe_batch

    def forget(self, req_id: int) -> None:
        """Drops the per-request statistics of ``observe`` for a finished request. Default: none kept."""

    def observed_prefill_queries(self) -> int | None:
        """How many of a prompt's last queries a prefill's mass counts (H2O's ``prefill_window``);
        None: all of them (also the default)."""
        return None

    def wants_to_evict(self, num_tokens: np.ndarray, num_live: np.ndarray) -> np.ndarray:
        """[B] bool: may ``select`` evict anything from requests of these lengths? A cheap filter
        before the batch layout is gathered. Default: every request."""
        return np.ones(len(num_tokens), dtype=bool)

    @abstractmethod
    def select(self, view: PolicyView) -> np.ndarray:
        """Logical ids to evict now, ascending, never protected ones. Pure for the table.

        Returns: Shape (num_evict,), int64; empty when the request is within its budget.
        """

    def select_batch(self, view: BatchView) -> BatchVictims:
        """``select`` for every row of ``view`` at once. This default asks ``select`` row by row
        (a policy written for one request still runs in a batch); ``ScorePolicy`` vectorises it."""
        rows, positions = [], []
        for row in range(view.size):
            ids = self.select(row_view(view, row))
            if len(ids):
                where = {int(t): p for p, t in enumerate(view.tokens[row].tolist()) if t >= 0}
                rows += [row] * len(ids)
                positions += [where[int(t)] for t in ids]
        return BatchVictims(np.array(rows, dtype=np.int64), np.array(positions, dtype=np.int64))


@dataclass
class ScorePolicy(EvictionPolicy):
    """Keeps the highest-scoring tokens; sinks and the most recent tokens always survive.

    Protected tokens (in blocks shared with other requests, prefix caching) are kept and do not
    count against the budget: the budget applies to the rest, ``budget.target(num_tokens -
    protected)`` of them are kept, lowest score first out (ties: lower id first). A request's
    private context is thus kept at the same rate whether or not others share its prefix (the
    shared blocks cost it no memory of its own). A policy never asks the table to evict a
    protected token.
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

    scores_are_ids: ClassVar[bool] = False
    """The score of a token is its logical id (newer = kept): selection needs no score array."""
    score_stat: ClassVar[str | None] = None
    """The per-slot statistic (``slot_stats``) that is the score as it stands (H2O: "mass")."""
    observe_adds_mass: ClassVar[bool] = False
    """``observe_batch`` only adds the mass to ``score_stat``. With ``scores_are_ids`` or
    ``score_stat``, the step can decide in one native pass over its slot layout
    (``cpp/core/select.h``, the same victims as ``select_batch``)."""

    def score_batch(self, view: BatchView) -> np.ndarray:
        """``score`` for every row: [B, L] float64 (any value where ``view.tokens`` is -1).
        Default: ``score`` row by row; the built-in policies vectorise it. Must be pure."""
        out = np.zeros(view.tokens.shape)
        for row in range(view.size):
            single = row_view(view, row)
            positions = np.flatnonzero(view.tokens[row] >= 0)
            order = np.argsort(view.tokens[row, positions], kind="stable")
            out[row, positions[order]] = self.score(single)
        return out

    def recent_tokens_batch(self, targets: np.ndarray) -> np.ndarray:
        """``recent_tokens`` for an array of targets."""
        return np.full(len(targets), self.recent_window, dtype=np.int64)

    def recent_share(self) -> float | None:
        """``recent_tokens_batch`` as max(recent_window, int(target * share)): the share, or None
        where a subclass sizes its window another way. Here: 0 (the window alone)."""
        return 0.0 if type(self).recent_tokens_batch is ScorePolicy.recent_tokens_batch else None

    _bounds: ClassVar[tuple[BoundsRule | None] | None] = None
    """``bounds_rule``'s answer, worked out once until an attribute of the policy is set again."""

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name != "_bounds":
            super().__setattr__("_bounds", None)  # e.g. a new budget: the rule is worked out again

    def bounds_rule(self) -> BoundsRule | None:
        """``candidate_bounds`` and ``wants_to_evict`` as numbers, for a native step that applies
        them itself; None where a subclass computes either its own way. A step asks every
        iteration; the answer is kept until an attribute of the policy is set."""
        if self._bounds is None:
            self._bounds = (self._worked_out_bounds(),)
        return self._bounds[0]

    def _worked_out_bounds(self) -> BoundsRule | None:
        cls, share = type(self), self.recent_share()
        if share is None or cls.candidate_bounds is not ScorePolicy.candidate_bounds or \
                cls.wants_to_evict is not ScorePolicy.wants_to_evict:
            return None
        return BoundsRule.of(self.budget, self.n_sink, self.recent_window, share)

    def wants_to_evict(self, num_tokens: np.ndarray, num_live: np.ndarray) -> np.ndarray:
        # select evicts only above the budget. With p protected tokens it keeps p + target(n - p)
        # >= target(n) (a target grows by at most one per token), so these rows are a superset.
        return num_live > self.budget.targets(num_tokens)

    def candidate_bounds(self, num_tokens: np.ndarray, num_live: np.ndarray,
                         protected_live: np.ndarray | int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per row: (tokens to evict, lowest and one past the highest candidate id). Candidates
        are the unprotected live ids in [lo, hi): above the sinks, below the recent window, both
        shrunk so the budget can still be met. ``protected_live`` tokens are kept on top of the
        budget, which applies to the rest (see ``select``). int64 arrays."""
        room = self.budget.targets(num_tokens - protected_live)  # unprotected tokens kept
        n_sink = np.minimum(self.n_sink, room)
        recent = np.minimum(self.recent_tokens_batch(room), room - n_sink)
        return num_live - protected_live - room, n_sink, num_tokens - recent

    def select(self, view: PolicyView) -> np.ndarray:
        protected = int(view.protected.sum())
        room = self.budget.target(view.num_tokens - protected)  # unprotected tokens kept
        excess = len(view.live_ids) - protected - room
        if excess <= 0:
            return np.zeros(0, dtype=np.int64)
        ids = view.live_ids
        # Sinks and the recent window are preferences that shrink so the budget can be met.
        n_sink = min(self.n_sink, room)
        recent = min(self.recent_tokens(room), room - n_sink)
        candidate = ~view.protected & (ids >= n_sink) & (ids < view.num_tokens - recent)
        cand_ids = ids[candidate]
        if len(cand_ids) <= excess:
            return cand_ids.astype(np.int64)
        scores = np.asarray(self.score(view), dtype=np.float64)[candidate]
        order = np.lexsort((cand_ids, scores))[:excess]
        return np.sort(cand_ids[order]).astype(np.int64)

    def select_batch(self, view: BatchView) -> BatchVictims:
        """``select`` row by row, vectorised over the batch (the same victims, checked by
        ``tests/policies/test_batch_select.py``): candidate masks over [B, L], then the lowest
        score per row with ties to the lower id; rows evicting several tokens at once (right
        after a prefill, or a budget change) take the exact per-row sort."""
        active = np.flatnonzero(self.wants_to_evict(view.num_tokens, view.num_live))  # a superset of the rows
        if not len(active):
            return BatchVictims.none()
        if len(active) < view.size:
            view = view.rows(active)
        protected = view.protected
        kept = (protected & (view.tokens >= 0)).sum(axis=1) if protected is not None else 0  # protected live tokens
        excess, lo, hi = self.candidate_bounds(view.num_tokens, view.num_live, kept)
        if protected is not None:  # the rows over budget once their protected tokens are set aside
            over = np.flatnonzero(excess > 0)
            if not len(over):
                return BatchVictims.none()
            if len(over) < view.size:
                view, active, protected = view.rows(over), active[over], protected[over]
                excess, lo, hi = excess[over], lo[over], hi[over]
        tokens = view.tokens
        candidate = (tokens >= lo[:, None]) & (tokens < hi[:, None])
        if protected is not None:
            candidate &= ~protected
        num_candidates = candidate.sum(axis=1)
        rows, positions = [], []
        take_all = np.flatnonzero(num_candidates <= excess)
        if len(take_all):
            r, p = np.nonzero(candidate[take_all])
            rows.append(take_all[r]), positions.append(p)
        scored = np.flatnonzero(num_candidates > excess)
        if len(scored):
            whole = len(scored) == view.size
            sub = view if whole else view.rows(scored)
            mask = candidate if whole else candidate[scored]
            big = np.iinfo(tokens.dtype).max
            if self.scores_are_ids:
                keys = np.where(mask, sub.tokens, big)
            else:  # NaN off the candidates: it equals no score, so no candidate ties a non-candidate
                keys = np.where(mask, np.asarray(self.score_batch(sub), dtype=np.float64), np.nan)
            single = np.flatnonzero(excess[scored] == 1)
            if len(single):
                k = keys if len(single) == len(scored) else keys[single]
                t = sub.tokens if len(single) == len(scored) else sub.tokens[single]
                if self.scores_are_ids:
                    best = k.argmin(axis=1)
                else:
                    best = lowest_score_lowest_id(k, t, mask if len(single) == len(scored) else mask[single])
                rows.append(scored[single]), positions.append(best)
            for i in np.flatnonzero(excess[scored] > 1):  # several victims: the spec's exact sort
                cand = np.flatnonzero(mask[i])
                ids = sub.tokens[i, cand]
                order = np.lexsort((ids, keys[i, cand]))[: excess[scored[i]]]
                rows.append(np.full(len(order), scored[i])), positions.append(cand[order])
        rows_all = np.concatenate(rows).astype(np.int64)
        positions_all = np.concatenate(positions).astype(np.int64)
        order = np.lexsort((tokens[rows_all, positions_all], rows_all))
        rows_all, positions_all = rows_all[order], positions_all[order]
        return BatchVictims(active[rows_all], positions_all)  # rows of the caller's view


def row_view(view: BatchView, row: int) -> PolicyView:
    """Row ``row`` of a batch view as the single-request view ``select`` takes."""
    tokens = view.tokens[row]
    positions = np.flatnonzero(tokens >= 0)
    order = np.argsort(tokens[positions], kind="stable")
    live_ids = tokens[positions[order]].astype(np.int64)
    protected = (view.protected[row, positions[order]] if view.protected is not None
                 else np.zeros(len(live_ids), dtype=bool))
    return PolicyView(int(view.req_ids[row]), int(view.num_tokens[row]), live_ids, protected)


def option_fields(name: str) -> dict[str, Field]:
    """A registered policy's options by name: its init fields but the budget (class constants and
    private state are not options). Unknown names raise KeyError."""
    return {f.name: f for f in fields(POLICIES.get(name))
            if f.init and not f.name.startswith("_") and f.name != "budget"}


def make_policy(name: str, budget: Budget | int | float | str, **kwargs) -> EvictionPolicy:
    """Builds a registered policy. Unknown names raise KeyError, unknown options ValueError."""
    known = option_fields(name)
    cls = POLICIES.get(name)
    if not isinstance(budget, Budget):
        budget = Budget.parse(budget)
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for policy {name!r}; known: {sorted(known)}")
    return cls(budget=budget, **kwargs)
