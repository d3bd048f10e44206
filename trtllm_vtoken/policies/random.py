# SPDX-License-Identifier: Apache-2.0
"""Random eviction, seeded per request: the baseline every informed policy must beat."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trtllm_vtoken.policies.base import POLICIES, PolicyView, ScorePolicy


@POLICIES.register("random")
@dataclass
class RandomPolicy(ScorePolicy):
    seed: int = 0
    """Request ``r`` draws from ``np.random.default_rng([seed, r])``: runs are reproducible."""
    _rngs: dict[int, np.random.Generator] = field(default_factory=dict, repr=False)

    def forget(self, req_id: int) -> None:
        self._rngs.pop(req_id, None)

    def score(self, view: PolicyView) -> np.ndarray:
        rng = self._rngs.get(view.req_id)
        if rng is None:
            rng = self._rngs[view.req_id] = np.random.default_rng([self.seed, view.req_id])
        return rng.random(len(view.live_ids))
