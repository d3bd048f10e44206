# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/pyexecutor/llm_request.py`` ``LlmRequest`` (a Python wrapper of the C++
request) with what the KV-cache manager and vToken read: ``py_request_id``, ``prompt_len`` /
``orig_prompt_len``, ``max_new_tokens``, ``sampling_config.beam_width`` (read by
``KVCacheManager.prepare_resources`` for every context request), ``is_first_context_chunk``,
``py_rewind_len`` (speculative rewinds), ``state`` and ``max_beam_num_tokens``, the logical
length the model engine takes position ids from (``past_seen_token_num``), which
``rewind_kv_cache`` does not change; ``get_tokens(beam)``, the ids block reuse keys blocks by; ``context_current_position``, the
prompt tokens the context forward skips (``setPrepopulatedPromptLen`` after a reuse hit; the model
engine's ``begin_compute`` and ``num_cached_tokens_per_seq`` of the row). Keyword-only, as the binding; unknown keywords: TypeError."""

from __future__ import annotations

import enum


class LlmRequestState(enum.Enum):
    CONTEXT_INIT = 1
    GENERATION_IN_PROGRESS = 2
    GENERATION_COMPLETE = 3


class SamplingConfig:
    def __init__(self, beam_width: int = 1) -> None:
        self.beam_width = beam_width


class LlmRequest:
    def __init__(self, *, request_id: int, max_new_tokens: int, input_tokens: list[int],
                 sampling_config: SamplingConfig, is_streaming: bool = False, client_id: int | None = None) -> None:
        self.py_request_id = request_id
        self.max_new_tokens = max_new_tokens
        self.prompt_len = self.orig_prompt_len = self.py_prompt_len = len(input_tokens)
        self.sampling_config = sampling_config
        self.is_streaming = is_streaming
        self.state = LlmRequestState.CONTEXT_INIT
        self.is_first_context_chunk = True
        self.is_dummy_request = False
        self.py_rewind_len = 0
        self.max_beam_num_tokens = len(input_tokens)
        self._tokens = list(input_tokens)
        self.context_current_position = 0  # prompt tokens already in the KV cache (a reused prefix)

    def add_new_token(self, token: int, beam: int) -> None:
        self.max_beam_num_tokens += 1
        self._tokens.append(token)

    def get_tokens(self, beam: int) -> list[int]:
        """The prompt and the tokens generated so far (C++ ``getTokens`` / ``getUniqueTokens``)."""
        return list(self._tokens)
