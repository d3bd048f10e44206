# SPDX-License-Identifier: Apache-2.0
"""StreamingLLM: keep the attention sinks (first tokens) and the most recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024
(https://arxiv.org/abs/2309.17453). Implemented purely as a policy: positions are never
re-rotated, so no sink-token support is needed from the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from trtllm_vtoken.policies.base import POLICIES, PolicyView, ScorePolicy
from trtllm_vtoken.policies.batch import BatchView


@POLICIES.register("streaming_llm")
@dataclass
class StreamingLLMPolicy(ScorePolicy):
    n_sink: int = 4

    scores_are_ids: ClassVar[bool] = True

    def score(self, view: PolicyView) -> np.ndarray:
        return view.live_ids.astype(np.float64)  # newer = higher

    def score_batch(self, view: BatchView) -> np.ndarray:
        return view.tokens.astype(np.float64)
