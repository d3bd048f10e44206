# SPDX-License-Identifier: Apache-2.0
"""Scissorhands: keep tokens whose importance persisted over a recent history window.

Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache
Compression at Test Time", NeurIPS 2023 (https://arxiv.org/abs/2305.17118). A token counts as
important at a step when it receives more than the average attention (1 / live tokens); its
score is the number of important steps among the last ``history_window`` observations.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from trtllm_vtoken.policies.base import POLICIES, PolicyView, ScorePolicy
from trtllm_vtoken.policies.stats import PerTokenAccumulator


@POLICIES.register("scissorhands")
@dataclass
class ScissorhandsPolicy(ScorePolicy):
    history_window: int = 32
    recent_window: int = 8
    _counts: PerTokenAccumulator = field(default_factory=PerTokenAccumulator, repr=False)
    _history: dict[int, deque] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.history_window <= 0:
            raise ValueError(f"history_window must be positive, got {self.history_window}")

    def observe(self, req_id: int, token_ids: np.ndarray, attention: np.ndarray) -> None:
        token_ids, attention = np.asarray(token_ids, dtype=np.int64), np.asarray(attention, dtype=np.float64)
        if not len(token_ids):
            return
        important = token_ids[attention > attention.sum() / len(token_ids)]
        history = self._history.setdefault(req_id, deque())
        history.append(important)
        self._counts.add(req_id, important, np.ones(len(important)))
        if len(history) > self.history_window:
            expired = history.popleft()
            self._counts.add(req_id, expired, -np.ones(len(expired)))

    def forget(self, req_id: int) -> None:
        self._counts.forget(req_id)
        self._history.pop(req_id, None)

    def score(self, view: PolicyView) -> np.ndarray:
        return self._counts.get(view.req_id, view.live_ids)
