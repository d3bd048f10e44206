# SPDX-License-Identifier: Apache-2.0
"""Sliding window: keep only the most recent ``budget`` tokens (no sinks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from trtllm_vtoken.policies.base import POLICIES, PolicyView, ScorePolicy
from trtllm_vtoken.policies.batch import BatchView


@POLICIES.register("sliding_window")
@dataclass
class SlidingWindowPolicy(ScorePolicy):
    scores_are_ids: ClassVar[bool] = True

    def score(self, view: PolicyView) -> np.ndarray:
        return view.live_ids.astype(np.float64)

    def score_batch(self, view: BatchView) -> np.ndarray:
        return view.tokens.astype(np.float64)
