# SPDX-License-Identifier: Apache-2.0
"""Sliding window: keep only the most recent ``budget`` tokens (no sinks)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trtllm_vtoken.policies.base import POLICIES, PolicyView, ScorePolicy


@POLICIES.register("sliding_window")
@dataclass
class SlidingWindowPolicy(ScorePolicy):
    def score(self, view: PolicyView) -> np.ndarray:
        return view.live_ids.astype(np.float64)
