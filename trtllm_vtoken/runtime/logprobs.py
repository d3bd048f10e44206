# SPDX-License-Identifier: Apache-2.0
"""Log-probabilities of a generated token and its most likely alternatives, in TensorRT-LLM's
shape: per generated token one ``{token id: Logprob(logprob, rank)}`` dict (TensorRT-LLM's
``TokenLogprobs``, ``tensorrt_llm/executor/result.py``).

    SamplingParams(logprobs=2), the model's distribution over the vocabulary at one step:
        token:    17     4     9   ...   sampled 9 (rank 3)
        logprob: -0.4  -1.3  -2.0
    -> {17: Logprob(-0.4, rank=1), 4: Logprob(-1.3, rank=2), 9: Logprob(-2.0, rank=3)}

The values are the log-softmax of the model's raw logits (before penalties and temperature), the
same distribution ``Request.cumulative_logprob`` sums over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None
    """1 for the most likely token of the step."""


TokenLogprobs = list[dict[int, Logprob]]
"""One dict per generated token."""


def token_logprobs(logprobs: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
    """The ``k`` most likely tokens of one step (rank 1 first) and the sampled ``token`` (added
    last with its own rank when it is not among them). ``logprobs``: the step's log-softmax over
    the vocabulary, float32 [vocab]."""
    values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
    entries = {int(i): Logprob(float(v), rank) for rank, (v, i) in enumerate(zip(values, ids), start=1)}
    if token not in entries:
        chosen = logprobs[token]
        entries[token] = Logprob(float(chosen), int((logprobs > chosen).sum()) + 1)
    return entries
