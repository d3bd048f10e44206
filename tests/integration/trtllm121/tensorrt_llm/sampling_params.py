# SPDX-License-Identifier: Apache-2.0
"""Double of ``tensorrt_llm/sampling_params.py`` ``SamplingParams`` (1.2-era copy, index id
416251432: the one with ``params_imply_greedy_decoding`` and ``kimi_k2`` in ``_setup``).

What it imitates:
- ``@dataclass(slots=True, kw_only=True)``: keyword-only construction; an unknown keyword is
  Python's TypeError ("unexpected keyword argument").
- The public fields and their defaults, in the real order (``max_tokens = 32``; ``temperature``,
  ``top_p``, ``top_k`` and the penalties None, "not specified"; ``logprobs`` None;
  ``exclude_input_from_output``, ``detokenize``, ``add_special_tokens``, ``skip_special_tokens``,
  ``spaces_between_special_tokens`` True; ``n = 1``). The private init fields
  (``_context_logits_auto_enabled``, ``_generation_logits_auto_enabled``, ``_return_log_probs``)
  are left out: user code does not pass them.
- ``__post_init__``: ``pad_id`` defaults to ``end_id``, ``best_of`` to ``n``, then ``_validate``:
  ``0 <= top_p <= 1``, ``top_k >= 0``, ``temperature >= 0``, ``best_of >= n``, greedy with
  ``best_of > 1`` refused, ``truncate_prompt_tokens >= 1``; ``logprobs = logprobs and
  int(logprobs)`` (True asks for the top 1).
- ``params_imply_greedy_decoding``: greedy when temperature, top_p and top_k are all None, or
  top_k == 1, top_p == 0 or temperature == 0.
Left out: the embedding-bias tensor copy, ``_setup`` (tokenizer-dependent stop and bad words),
the bindings' configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    max_tokens: int = 32
    bad: Optional[Union[str, list[str]]] = None
    bad_token_ids: Optional[list[int]] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    embedding_bias: Any = None
    logits_processor: Any = None
    apply_batched_logits_processor: bool = False
    n: int = 1
    best_of: Optional[int] = None
    use_beam_search: bool = False
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    top_p_min: Optional[float] = None
    top_p_reset_ids: Optional[int] = None
    top_p_decay: Optional[float] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    min_tokens: Optional[int] = None
    beam_search_diversity_rate: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    length_penalty: Optional[float] = None
    early_stopping: Optional[int] = None
    no_repeat_ngram_size: Optional[int] = None
    min_p: Optional[float] = None
    beam_width_array: Optional[list[int]] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    additional_model_outputs: Optional[list[str]] = None
    lookahead_config: Any = None
    guided_decoding: Any = None
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.top_p is None or 0 <= self.top_p <= 1, f"top_p must lie in [0, 1]: {self.top_p}"),
            (self.top_k is None or self.top_k >= 0, f"top_k must be >= 0: {self.top_k}"),
            (self.temperature is None or self.temperature >= 0, f"temperature must be >= 0: {self.temperature}"),
            (self.best_of >= self.n, f"best_of {self.best_of} < n {self.n}"),
            (self.best_of == 1 or not self._greedy_decoding,
             f"greedy decoding returns one sequence: best_of {self.best_of}"),
            (self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
             f"truncate_prompt_tokens must be >= 1: {self.truncate_prompt_tokens}"),
        ]
        for ok, problem in checks:
            if not ok:
                raise ValueError(problem)
        self.logprobs = int(self.logprobs) if self.logprobs else self.logprobs
        self.prompt_logprobs = int(self.prompt_logprobs) if self.prompt_logprobs else self.prompt_logprobs

    @staticmethod
    def params_imply_greedy_decoding(*, temperature: Optional[float], top_p: Optional[float],
                                     top_k: Optional[int]) -> bool:
        if temperature is None and top_p is None and top_k is None:
            return True
        return top_k == 1 or top_p == 0.0 or temperature == 0

    @property
    def _greedy_decoding(self) -> bool:
        return not self.use_beam_search and self.params_imply_greedy_decoding(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
