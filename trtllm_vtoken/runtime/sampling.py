# SPDX-License-Identifier: Apache-2.0
"""Sampling parameters (the LLM-API / Triton fields) and next-token selection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trtllm_vtoken.config_base import from_dict
from trtllm_vtoken.policies.request_settings import EvictionSettings


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    """New tokens to generate at most (the request finishes with reason "length")."""
    temperature: float = 0.0
    """0 means greedy (argmax; ties go to the lowest token id)."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    seed: int | None = None
    """Seeds this request's sampler; None draws from the engine's generator."""
    stop: tuple[str, ...] = ()
    """Strings that end generation; the returned text stops before the first one."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was already generated."""
    eviction: EvictionSettings | None = None
    """This request's own eviction settings (policy, budget, sinks, window, or ``"native"`` for
    none); a mapping is accepted. None: the engine's policy as configured."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str) or isinstance(self.stop_token_ids, int):
            raise ValueError("stop and stop_token_ids are sequences, not a single string or int")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if isinstance(self.eviction, dict):
            object.__setattr__(self, "eviction", EvictionSettings.from_dict(self.eviction))
        elif self.eviction is not None and not isinstance(self.eviction, EvictionSettings):
            raise ValueError(f"eviction must be EvictionSettings, a mapping or None, got {self.eviction!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must lie in [-2, 2], got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        return from_dict(cls, values)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           generated: list[int] | None = None) -> int:
    """Picks the next token from one row of logits [vocab]; ``generated`` are the request's output
    tokens so far (for the presence and frequency penalties)."""
    if generated and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(generated).unique(return_counts=True)
        logits = logits.float().clone()
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts.float()
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the first token).
        drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
