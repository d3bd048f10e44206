# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm/executor/result.py``'s output types (1.2-era copy, index id 1063746606:
the one with ``ResponseWrapper.request_perf_metrics``).

What it imitates:
- ``Logprob``: ``@dataclass(slots=True)`` of ``logprob: float`` and ``rank: Optional[int] = None``;
  ``TokenLogprobs = list[dict[int, Logprob]]``, one dict per generated token.
- ``CompletionOutput``: ``@dataclass(slots=True)``; ``index`` required; ``text = ""``,
  ``token_ids`` and ``logprobs`` empty lists by default, ``cumulative_logprob``, ``finish_reason``
  ('stop', 'length', 'timeout', 'cancelled') and ``stop_reason`` None; the streaming diffs
  ``text_diff``, ``token_ids_diff``, ``logprobs_diff`` against the hidden ``_last_text_len``,
  ``_last_token_ids_len``, ``_last_logprobs_len`` (not init arguments); ``length``.
Left out: generation logits, additional outputs, disaggregated parameters, perf metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: Optional[int] = None


TokenLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: Optional[list[int]] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[Union[TokenLogprobs, list[float]]] = field(default_factory=list)
    prompt_logprobs: Optional[TokenLogprobs] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    _last_text_len: int = field(default=0, init=False, repr=False)
    _last_token_ids_len: int = field(default=0, init=False, repr=False)
    _last_logprobs_len: int = field(default=0, init=False, repr=False)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len:]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len:]

    @property
    def logprobs_diff(self) -> Union[TokenLogprobs, list[float]]:
        return self.logprobs[self._last_logprobs_len:]
