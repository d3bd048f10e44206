# SPDX-License-Identifier: Apache-2.0
"""A workload is a list of requests (prompt text + output length) drawn reproducibly from real text.

Lengths are counted in the model's tokens, so a workload is built for one tokenizer; generators
see only ``count_tokens`` and ``truncate`` and never load a model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from trtllm_vtoken.registry import Registry


class TokenCounter(Protocol):
    def encode(self, text: str, chat: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class WorkloadItem:
    prompt: str
    """User text (the engine wraps it in the chat template)."""
    max_tokens: int
    """Output length, sampled from the source's reply lengths (ShareGPT) or the task's range."""
    source: str
    """Where the text came from (conversation id, file name), for reports."""


WorkloadFn = Callable[..., list[WorkloadItem]]
WORKLOADS: Registry[WorkloadFn] = Registry("workload")


def make_workload(name: str, n: int, tokenizer: TokenCounter, *, seed: int = 0,
                  max_prompt_tokens: int = 1024, max_output_tokens: int = 256) -> list[WorkloadItem]:
    """``n`` requests of the named workload. Unknown names raise KeyError; bad sizes ValueError."""
    if n <= 0 or max_prompt_tokens <= 0 or max_output_tokens <= 0:
        raise ValueError(f"n ({n}), max_prompt_tokens and max_output_tokens must be positive")
    return WORKLOADS.get(name)(n, tokenizer, seed=seed, max_prompt_tokens=max_prompt_tokens,
                               max_output_tokens=max_output_tokens)
