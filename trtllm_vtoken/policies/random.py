# SPDX-License-Identifier: Apache-2.0
"""Random eviction, seeded per request: the baseline every informed policy must beat.

Each step, every live token of request ``r`` draws a uniform score from a counter-based hash of
(seed, r, token id, the request's logical length): the same on every process and tensor-parallel
rank, independent of how often or in which batch the policy was asked, and computed for a whole
batch in a few vectorised operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trtllm_vtoken.policies.base import POLICIES, PolicyView, ScorePolicy
from trtllm_vtoken.policies.batch import BatchView

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def uniform_scores(seed: int, req_ids: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) floats, one per (request, token, length) triple (broadcast together);
    SplitMix64's finaliser over a combined key. float64, the broadcast shape."""
    with np.errstate(over="ignore"):
        key = np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * _GOLDEN
        for part in (req_ids, token_ids, num_tokens):
            key = _mix(np.asarray(part).astype(np.uint64) ^ (key + _GOLDEN))
        return (key >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@POLICIES.register("random")
@dataclass
class RandomPolicy(ScorePolicy):
    seed: int = 0
    """Scores of request ``r`` depend on (seed, r) only: runs are reproducible."""

    def score(self, view: PolicyView) -> np.ndarray:
        return uniform_scores(self.seed, np.array([view.req_id]), view.live_ids, np.array([view.num_tokens]))

    def score_batch(self, view: BatchView) -> np.ndarray:
        return uniform_scores(self.seed, view.req_ids[:, None], view.tokens, view.num_tokens[:, None])
