# SPDX-License-Identifier: Apache-2.0
"""Scissorhands: keep tokens whose importance persisted over a recent history window.

Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache
Compression at Test Time", NeurIPS 2023 (https://arxiv.org/abs/2305.17118). A token counts as
important at a step when it receives more than the average attention (the attention summed in
position order, divided by the live tokens); its score is the number of important steps among the
request's last ``history_window`` observations.

Per request, ``observe`` keeps the history as a queue of important ids; the batched form keeps, per
slot, the last 64 observations as the bits of one uint64 (newest in bit 0), so the score is the
number of set bits among the lowest ``history_window``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from trtllm_vtoken.policies.base import POLICIES, PolicyView, ScorePolicy
from trtllm_vtoken.policies.batch import BatchView, popcount64
from trtllm_vtoken.policies.stats import PerTokenAccumulator

MAX_HISTORY = 64


@POLICIES.register("scissorhands")
@dataclass
class ScissorhandsPolicy(ScorePolicy):
    history_window: int = 32
    recent_window: int = 8
    _counts: PerTokenAccumulator = field(default_factory=PerTokenAccumulator, repr=False)
    _history: dict[int, deque] = field(default_factory=dict, repr=False)
    slot_stats: ClassVar[dict[str, type]] = {"history": np.uint64}

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.history_window <= MAX_HISTORY:
            raise ValueError(f"history_window must lie in [1, {MAX_HISTORY}], got {self.history_window}")

    def observe(self, req_id: int, token_ids: np.ndarray, attention: np.ndarray) -> None:
        token_ids, attention = np.asarray(token_ids, dtype=np.int64), np.asarray(attention, dtype=np.float64)
        if not len(token_ids):
            return
        # Summed in order (cumsum), so that the batched form, whose rows hold zeros at dead
        # positions, gets the same mean to the last bit. +inf and -inf (an attention that
        # overflowed) sum to NaN: then no token is above the mean.
        with np.errstate(invalid="ignore"):
            important = token_ids[attention > np.cumsum(attention)[-1] / len(token_ids)]
        history = self._history.setdefault(req_id, deque())
        history.append(important)
        self._counts.add(req_id, important, np.ones(len(important)))
        if len(history) > self.history_window:
            expired = history.popleft()
            self._counts.add(req_id, expired, -np.ones(len(expired)))

    def observe_batch(self, view: BatchView, mass: np.ndarray) -> None:
        live = view.observed()  # a token the forward did not attend is neither counted nor scored
        attention = np.where(live, np.asarray(mass, dtype=np.float64), 0.0)
        counts = live.sum(axis=1)
        with np.errstate(invalid="ignore"):  # +inf and -inf sum to NaN, as in observe
            total = np.cumsum(attention, axis=1)[:, -1] if attention.shape[1] else np.zeros(len(counts))
        mean = total / np.maximum(counts, 1)
        important = live & (attention > mean[:, None])
        history = view.stats["history"]
        history[live] = (history[live] << np.uint64(1)) | important[live].astype(np.uint64)

    def forget(self, req_id: int) -> None:
        self._counts.forget(req_id)
        self._history.pop(req_id, None)

    def score(self, view: PolicyView) -> np.ndarray:
        return self._counts.get(view.req_id, view.live_ids)

    def score_batch(self, view: BatchView) -> np.ndarray:
        window = np.uint64((1 << self.history_window) - 1) if self.history_window < 64 else np.uint64(2**64 - 1)
        return popcount64(view.stats["history"] & window).astype(np.float64)
