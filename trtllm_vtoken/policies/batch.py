# SPDX-License-Identifier: Apache-2.0
"""What a policy sees of a whole batch at one step, for its vectorised decision.

Rows are requests, columns their physical KV positions, padded to the longest row (L). A
policy still speaks logical ids: ``tokens`` says which logical id sits at each position. Three
requests, L = 8 (-1: no live token there: a hole, an empty slot or padding):

    tokens     [[ 0  1  2  3  4  5  6  7]      a request with 8 live tokens
                [ 0  9  2  3  8  5 -1 -1]      compacted: 9 and 8 fill holes, 6 live in [0, 6)
                [ 0  1 -1  3 -1 -1 -1 -1]]     lazy mode: position 2's token is dead, still there
    stats["mass"]  the same layout: what the policy accumulated per token (``slot_stats``)

The statistics a policy declares in ``slot_stats`` are kept by the step per physical slot, beside
the KV, and moved by the same relocations, so that a decode step adds the attention mass with one
vectorised operation instead of a scatter by logical id. They are gathered into this layout before
``observe_batch`` / ``select_batch`` and written back after.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NO_TOKEN = -1


@dataclass
class BatchView:
    """A group of requests at one step. Shapes: B rows, L positions."""

    req_ids: np.ndarray
    """[B] int64."""
    num_tokens: np.ndarray
    """[B] int64: logical length (prompt + generated); logical ids are [0, num_tokens)."""
    num_live: np.ndarray
    """[B] int64: live tokens."""
    tokens: np.ndarray
    """[B, L] int64: the live logical id at each position, NO_TOKEN (-1) where there is none."""
    protected: np.ndarray | None = None
    """[B, L] bool: True where a live token may not be evicted (its block is shared); None: none is."""
    stats: dict[str, np.ndarray] = field(default_factory=dict)
    """name -> [B, L]: the statistics the policy declared in ``slot_stats``; policies update them in
    place in ``observe_batch``."""
    observed_below: np.ndarray | None = None
    """[B] int64: the mass covers the live ids below this (the newest tokens of a step beside the
    next forward were written after the forward it is of); None: every live token."""

    @property
    def size(self) -> int:
        return len(self.req_ids)

    def rows(self, index: np.ndarray) -> BatchView:
        """The sub-view of rows ``index`` (copies; statistics are read-only there)."""
        return BatchView(self.req_ids[index], self.num_tokens[index], self.num_live[index], self.tokens[index],
                         None if self.protected is None else self.protected[index],
                         {name: values[index] for name, values in self.stats.items()},
                         None if self.observed_below is None else self.observed_below[index])

    def live(self) -> np.ndarray:
        """[B, L] bool: positions holding a live token."""
        return self.tokens >= 0

    def observed(self) -> np.ndarray:
        """[B, L] bool: positions holding a live token the forward of this step's mass attended
        (``observed_below``): what an observing policy counts."""
        if self.observed_below is None:
            return self.live()
        return (self.tokens >= 0) & (self.tokens < self.observed_below[:, None])


@dataclass(frozen=True)
class BatchVictims:
    """A decision for a view: row ``rows[k]`` evicts the token at position ``positions[k]``.
    Sorted by row, then by logical id (each row's ids ascending, as ``select`` returns them)."""

    rows: np.ndarray
    """[num_victims] int64."""
    positions: np.ndarray
    """[num_victims] int64."""

    @classmethod
    def none(cls) -> BatchVictims:
        empty = np.zeros(0, dtype=np.int64)
        return cls(empty, empty)

    def ids(self, view: BatchView) -> np.ndarray:
        """[num_victims] the logical ids evicted."""
        return view.tokens[self.rows, self.positions]

    def of_row(self, view: BatchView, row: int) -> np.ndarray:
        """Row ``row``'s evicted ids, ascending."""
        return view.tokens[row, self.positions[self.rows == row]]


def lowest_score_lowest_id(keys: np.ndarray, tokens: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Per row of ``keys`` [B, L] (a score at each candidate, NaN elsewhere): the position of the
    lowest score, among equal scores the lowest id, as the exact sort (``np.lexsort``) orders them:
    -inf, the numbers, +inf, then NaN (a mass that overflowed to NaN keeps its token longest). Every
    row holds a candidate."""
    big = np.iinfo(tokens.dtype).max
    lowest = np.fmin.reduce(keys, axis=1)  # NaN left out; NaN where every candidate's score is NaN
    hit = keys == lowest[:, None]
    all_nan = np.flatnonzero(np.isnan(lowest))
    if len(all_nan):
        hit[all_nan] = candidate[all_nan]
    return np.where(hit, tokens, big).argmin(axis=1)


def popcount64(values: np.ndarray) -> np.ndarray:
    """Set bits of each uint64 (numpy < 2 has no ``bitwise_count``). Shape: values.shape, int64."""
    as_bytes = np.ascontiguousarray(values, dtype=np.uint64).view(np.uint8).reshape(*values.shape, 8)
    return _BYTE_BITS[as_bytes].sum(axis=-1, dtype=np.int64)


_BYTE_BITS = np.array([bin(b).count("1") for b in range(256)], dtype=np.int64)
