# SPDX-License-Identifier: Apache-2.0
"""H2O: keep heavy hitters (most accumulated attention) plus a recent window.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023 (https://arxiv.org/abs/2306.14048).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from trtllm_vtoken.config_base import require_positive_ints
from trtllm_vtoken.policies.base import POLICIES, PolicyView, ScorePolicy
from trtllm_vtoken.policies.batch import BatchView
from trtllm_vtoken.policies.stats import PerTokenAccumulator


@POLICIES.register("h2o")
@dataclass
class H2OPolicy(ScorePolicy):
    recent_ratio: float = 0.5
    """Share of the budget given to the most recent tokens; the rest goes to heavy hitters."""
    prefill_window: int | None = None
    """The prompt's mass is what its last ``prefill_window`` queries paid (SnapKV's observation
    window): a prefill's mass pass then costs O(window x prompt) instead of O(prompt^2). None:
    every query of the prompt counts."""
    _mass: PerTokenAccumulator = field(default_factory=lambda: PerTokenAccumulator(np.float32), repr=False)
    slot_stats: ClassVar[dict[str, type]] = {"mass": np.float32}
    """The accumulated mass is float32, as attention kernels return it (and as a statistic kept
    beside the KV on the device would be): the step's pass over every slot moves 16 bytes a slot
    instead of 24 (``cpp/core/spans.h``)."""
    score_stat: ClassVar[str | None] = "mass"
    observe_adds_mass: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must lie in [0, 1], got {self.recent_ratio}")
        if self.prefill_window is not None:
            require_positive_ints(prefill_window=self.prefill_window)

    def observed_prefill_queries(self) -> int | None:
        return self.prefill_window

    def recent_tokens(self, target: int) -> int:
        return max(self.recent_window, int(target * self.recent_ratio))

    def recent_tokens_batch(self, targets: np.ndarray) -> np.ndarray:
        return np.maximum(self.recent_window, (targets * self.recent_ratio).astype(np.int64))

    def recent_share(self) -> float | None:
        return self.recent_ratio if type(self).recent_tokens_batch is H2OPolicy.recent_tokens_batch else None

    def observe(self, req_id: int, token_ids: np.ndarray, attention: np.ndarray) -> None:
        self._mass.add(req_id, token_ids, attention)

    def forget(self, req_id: int) -> None:
        self._mass.forget(req_id)

    def observe_batch(self, view: BatchView, mass: np.ndarray) -> None:
        # Accumulated per slot, float32, as the per-request accumulator. An attention that
        # overflowed gives +inf and -inf, whose sum is NaN: ranked last, as the exact sort ranks it.
        with np.errstate(invalid="ignore"):
            view.stats["mass"] += mass

    def score(self, view: PolicyView) -> np.ndarray:
        return self._mass.get(view.req_id, view.live_ids)

    def score_batch(self, view: BatchView) -> np.ndarray:
        return view.stats["mass"]
