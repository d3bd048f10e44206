# SPDX-License-Identifier: Apache-2.0
"""Sampling parameters and next-token selection.

``SamplingParams`` takes TensorRT-LLM 1.2.1's field names and defaults
(``tensorrt_llm/sampling_params.py``), so code written for ``tensorrt_llm.SamplingParams`` runs
here: ``temperature``, ``top_p`` and ``top_k`` default to None, "not specified", and sampling is
greedy when none of them is specified (or temperature is 0, top_k 1 or top_p 0); a sampled request
without a temperature samples at 1. TensorRT-LLM's fields this runtime does not implement are
accepted at their defaults and refused otherwise (``runtime/sampling_fields.py``); any other name
is a TypeError with the nearest known name. ``eviction`` is vToken's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from trtllm_vtoken.config_base import from_dict
from trtllm_vtoken.policies.request_settings import EvictionSettings
from trtllm_vtoken.runtime.sampling_fields import check_sampling_keywords


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_tokens: int = 32
    """New tokens to generate at most (the request finishes with reason "length")."""
    temperature: float | None = None
    """Divides the logits before sampling; 0 is greedy (argmax; ties go to the lowest token id).
    None: greedy, unless top_p or top_k is set (then 1)."""
    top_p: float | None = None
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p; 0 is greedy.
    None: 1 (no cut)."""
    top_k: int | None = None
    """Sample among the top_k most likely tokens; 1 is greedy. None or 0: all tokens."""
    seed: int | None = None
    """Seeds this request's sampler; None draws from the engine's generator."""
    stop: tuple[str, ...] | None = None
    """Strings that end generation (one string or several); the returned text stops before the
    first one."""
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    """Subtracted from the logit of every token already generated (OpenAI semantics); None: 0."""
    frequency_penalty: float | None = None
    """Subtracted from a token's logit once per time it was already generated; None: 0."""
    logprobs: int | None = None
    """Per generated token, return the log-probabilities of the ``logprobs`` most likely tokens
    and of the sampled one (``RequestOutput.outputs[0].logprobs``); None or 0: none."""
    eviction: EvictionSettings | None = None
    """vToken's: this request's own eviction settings (policy, budget, sinks, window, or
    ``"native"`` for none); a mapping is accepted. None: the engine's policy as configured."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, int):
            raise ValueError("stop_token_ids is a sequence of token ids, not a single int")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.eviction, dict):
            object.__setattr__(self, "eviction", EvictionSettings.from_dict(self.eviction))
        elif self.eviction is not None and not isinstance(self.eviction, EvictionSettings):
            raise ValueError(f"eviction must be EvictionSettings, a mapping or None, got {self.eviction!r}")
        if self.logprobs is not None:  # True asks for the top 1, as in TensorRT-LLM
            object.__setattr__(self, "logprobs", _non_negative_int("logprobs", self.logprobs))
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature is not None and not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_p is not None and not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in [0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop or ()):
            raise ValueError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value is not None and not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must lie in [-2, 2], got {value}")

    @property
    def greedy(self) -> bool:
        unspecified = self.temperature is None and self.top_p is None and self.top_k is None
        return unspecified or self.temperature == 0.0 or self.top_k == 1 or self.top_p == 0.0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        return from_dict(cls, values)


check_sampling_keywords(SamplingParams)


def _non_negative_int(name: str, value: Any) -> int:
    number = int(value)
    if number != value or number < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return number


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           generated: list[int] | None = None) -> int:
    """Picks the next token from one row of logits [vocab]; ``generated`` are the request's output
    tokens so far (for the presence and frequency penalties)."""
    presence, frequency = params.presence_penalty or 0.0, params.frequency_penalty or 0.0
    if generated and (presence or frequency):
        ids, counts = torch.tensor(generated).unique(return_counts=True)
        logits = logits.float().clone()
        logits[ids] -= presence + frequency * counts.float()
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits.float() / (1.0 if params.temperature is None else params.temperature)
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p is not None and params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the first token).
        drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
