# SPDX-License-Identifier: Apache-2.0
"""A request's life in the engine, and what each step reports about it.

    WAITING --admit--> RUNNING --EOS / stop / max_tokens--> FINISHED
        ^                 |
        +---- preempt ----+          (blocks freed; prompt + output recomputed on re-admission)

A running request's last sampled token is not in the KV cache yet: the next decode step writes it
(``pending``). Preemption keeps the output generated so far, so nothing is lost or repeated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from trtllm_vtoken.runtime.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    req_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    """"stop" (EOS, a stop token or string), "length" (max_tokens) or "cancelled"."""
    stop_reason: str | int | None = None
    """What stopped it: the stop string or stop token id (None for EOS, length, cancel)."""
    cumulative_logprob: float = 0.0
    """Sum of the model's log-probabilities (raw logits, before penalties and temperature) of
    the output tokens."""
    text: str = ""
    """Decoded output so far (with a tokenizer), cut before a stop string."""
    emitted_text: int = 0
    """Characters of ``text`` already reported."""
    num_preemptions: int = 0
    draft_tokens: int = 0
    """Draft tokens each decode step may carry (speculative decoding): the engine's
    ``draft_tokens_per_row`` for a greedy request the pool holds drafting them alone, else 0;
    fixed when it is added, so never a matter of what runs beside it."""
    arrival: float = 0.0
    first_token_time: float | None = None
    logprobs: list = field(default_factory=list, repr=False)
    """With ``SamplingParams.logprobs``: per output token, its and the top tokens' log-probabilities
    (``runtime/logprobs.py``)."""
    logits: list = field(default_factory=list, repr=False)
    """Logits [vocab] behind each output token, if the engine records a trace."""
    evictions: list = field(default_factory=list, repr=False)
    """Logical ids evicted after each output token (but the last), if the engine records a trace."""

    @property
    def pending(self) -> int:
        """The token the next decode step writes (the last one sampled)."""
        return self.output_ids[-1]

    def prefill_ids(self) -> list[int]:
        """What (re-)admission writes: the prompt, plus everything generated before a preemption."""
        return self.prompt_ids + self.output_ids

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)


@dataclass(frozen=True)
class RequestDelta:
    """What one step produced for one request (only requests that changed are reported). The
    caller-facing result of a whole request is ``runtime.outputs.RequestDelta``."""

    req_id: int
    new_token_ids: tuple[int, ...]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_output_tokens: int
    stop_reason: str | int | None = None
    cumulative_logprob: float = 0.0
    new_logprobs: tuple = ()
    """With ``SamplingParams.logprobs``: the log-probabilities of ``new_token_ids``, one dict each."""
    num_preemptions: int = 0
