# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/pyexecutor/llm_request.py`` ``LlmRequest``, the Python wrapper of the C++
``LlmRequest`` (``cpp/include/tensorrt_llm/batch_manager/llmRequest.h``, 1.2-era copy, index id
50462803), with what the executor loop, the scheduler, the sampler, the KV-cache manager and
vToken read. Keyword-only, as the binding; unknown keywords: TypeError.

Imitated, per behaviour:
- ``py_request_id`` (= the C++ ``mRequestId``), ``prompt_len`` (``mPromptLen``), ``orig_prompt_len``
  / ``py_orig_prompt_len``, ``max_new_tokens`` (``mMaxNewTokens``), ``py_max_new_tokens`` (the
  Python copy the sampler's length criterion reads, never changed), ``py_end_id``,
  ``sampling_config.beam_width``, ``max_beam_num_tokens`` (the logical length the model engine
  takes position ids from), ``get_tokens`` / ``get_num_tokens`` / ``get_last_tokens``.
- States ``CONTEXT_INIT`` -> ``GENERATION_IN_PROGRESS`` -> ``GENERATION_COMPLETE``;
  ``is_finished`` is the last; ``finish_by_reason`` enters it.
- Context chunks (``llmRequest.h``; 1.2-era copies, index ids 50462803, 786144818, 5710012975):
  ``context_chunk_size`` starts at the prompt's length (``mContextChunkSize{mPromptLen}``) and is
  set by the micro-batch scheduler when chunked prefill is on; its setter (``setContextChunkSize``)
  refuses a negative size or a request past its context ("only possible during the context
  phase") and clamps to ``context_remaining_length``. ``is_first_context_chunk``:
  ``context_current_position == prepopulated prompt length``; ``is_last_context_chunk``: position
  + chunk reaches ``prompt_len``; ``move_to_next_context_chunk`` advances the position past the
  chunk and sets the chunk to 0. ``set_prepopulated_prompt_len(n, tokens_per_block)`` (a reuse hit,
  called by the C++ ``addSequence``) starts the context at ``n``; if the chunk the scheduler chose
  then ends before the prompt's end, it is cut back so that it ends on a block boundary.
- Speculative decoding: ``py_draft_tokens`` (placeholders set by the executor, then the
  drafter's tokens padded to the maximum), ``py_draft_pages_allocated`` (the KV slots
  ``prepare_resources`` took for them), ``py_num_accepted_draft_tokens`` and ``py_rewind_len``
  (set by the sampler); ``get_draft_token_length(request)`` is ``len(py_draft_tokens)``.
  ``request_id`` is the C++ id as the drafter reads it.
- ``pause(max_input_len)`` (beam width 1): the generated tokens join the prompt,
  ``newPromptLen = min(maxInputLen, mPromptLen + generated)``, tokens beyond it are dropped,
  ``mMaxNewTokens -= newPromptLen - mPromptLen``, state CONTEXT_INIT, context position 0, chunk
  size the new prompt length: the request is prefilled again when it is scheduled next.
"""

from __future__ import annotations

import enum


class LlmRequestState(enum.IntEnum):
    CONTEXT_INIT = 2
    GENERATION_IN_PROGRESS = 4
    GENERATION_COMPLETE = 7


class FinishReason(enum.Enum):
    NOT_FINISHED = 0
    END_ID = 1
    STOP_WORDS = 2
    LENGTH = 3
    CANCELLED = 5


class SamplingConfig:
    def __init__(self, beam_width: int = 1) -> None:
        self.beam_width = beam_width


class LlmRequest:
    def __init__(self, *, request_id: int, max_new_tokens: int, input_tokens: list[int],
                 sampling_config: SamplingConfig, is_streaming: bool = False, client_id: int | None = None,
                 end_id: int | None = None) -> None:
        self.py_request_id = request_id
        self.py_client_id = client_id
        self.max_new_tokens = self.py_max_new_tokens = max_new_tokens
        self.prompt_len = self.orig_prompt_len = self.py_prompt_len = self.py_orig_prompt_len = len(input_tokens)
        self.py_end_id = end_id
        self.sampling_config = sampling_config
        self.is_streaming = is_streaming
        self.state = LlmRequestState.CONTEXT_INIT
        self.finish_reason = FinishReason.NOT_FINISHED
        self.is_dummy_request = False
        self.is_cuda_graph_dummy = False
        self.py_rewind_len = 0
        self.py_draft_tokens: list[int] = []
        self.py_last_draft_tokens: list[int] = []
        self.py_draft_pages_allocated = 0
        self.py_num_accepted_draft_tokens = 0
        self.py_decoding_iter = 0
        self.py_batch_idx: int | None = None
        self.max_beam_num_tokens = len(input_tokens)
        self._tokens = list(input_tokens)
        self.context_current_position = 0  # prompt tokens already in the KV cache
        self._prepopulated_prompt_len = 0
        self._context_chunk_size = len(input_tokens)

    @property
    def request_id(self) -> int:
        return self.py_request_id

    # ---- tokens --------------------------------------------------------------------------------
    def add_new_token(self, token: int, beam: int) -> None:
        self.max_beam_num_tokens += 1
        self._tokens.append(token)

    def get_tokens(self, beam: int) -> list[int]:
        """The prompt and the tokens generated so far (C++ ``getTokens`` / ``getUniqueTokens``)."""
        return list(self._tokens)

    def get_num_tokens(self, beam: int) -> int:
        return len(self._tokens)

    def get_last_tokens(self, beam: int) -> int:
        return self._tokens[-1]

    @property
    def max_num_generated_tokens(self) -> int:
        """``getMaxNumGeneratedTokens``: tokens beyond the current prompt."""
        return self.max_beam_num_tokens - self.prompt_len

    # ---- states --------------------------------------------------------------------------------
    def is_context_init_state(self) -> bool:
        return self.state == LlmRequestState.CONTEXT_INIT

    def is_generation_in_progress_state(self) -> bool:
        return self.state == LlmRequestState.GENERATION_IN_PROGRESS

    @property
    def is_finished(self) -> bool:
        return self.state == LlmRequestState.GENERATION_COMPLETE

    def finish_by_reason(self, reason: FinishReason) -> None:
        self.state = LlmRequestState.GENERATION_COMPLETE
        self.finish_reason = reason

    # ---- context chunks ------------------------------------------------------------------------
    @property
    def is_first_context_chunk(self) -> bool:
        return self.context_current_position == self._prepopulated_prompt_len

    @property
    def is_last_context_chunk(self) -> bool:
        return self.context_current_position + self.context_chunk_size == self.prompt_len

    @property
    def context_chunk_size(self) -> int:
        if not self.is_context_init_state():
            raise RuntimeError("[TensorRT-LLM][ERROR] Assertion failed: getContextChunkSize is only possible "
                               "during the context phase")
        return self._context_chunk_size

    @context_chunk_size.setter
    def context_chunk_size(self, size: int) -> None:
        if not self.is_context_init_state():
            raise RuntimeError("[TensorRT-LLM][ERROR] Assertion failed: setContextChunkSize is only possible "
                               "during the context phase")
        if size < 0:
            raise RuntimeError(f"[TensorRT-LLM][ERROR] Assertion failed: The chunk size of context ({size}) "
                               "can't be negative")
        self._context_chunk_size = min(size, self.context_remaining_length)

    @property
    def context_remaining_length(self) -> int:
        return self.prompt_len - self.context_current_position

    def move_to_next_context_chunk(self) -> None:
        self.context_current_position += self.context_chunk_size
        self.context_chunk_size = 0

    def set_prepopulated_prompt_len(self, length: int, tokens_per_block: int) -> None:
        if length >= self.prompt_len:
            raise RuntimeError(f"[TensorRT-LLM][ERROR] Assertion failed: prepopulatedPromptLen {length} < "
                               f"promptLen {self.prompt_len}")
        self._prepopulated_prompt_len = length
        if length > 0:
            chunk = self.context_chunk_size
            if length + chunk < self.prompt_len:  # end the chunk on a block boundary
                chunk = (length + chunk) // tokens_per_block * tokens_per_block - length
            self.context_current_position = length
            self.context_chunk_size = chunk

    # ---- pause (MAX_UTILIZATION) -----------------------------------------------------------------
    def pause(self, max_input_len: int) -> None:
        new_prompt_len = min(max_input_len, self.prompt_len + self.max_num_generated_tokens)
        del self._tokens[new_prompt_len:]
        self.max_beam_num_tokens = len(self._tokens)
        self.max_new_tokens -= new_prompt_len - self.prompt_len
        self.prompt_len = self.py_prompt_len = new_prompt_len
        self.state = LlmRequestState.CONTEXT_INIT
        self.context_current_position = self._prepopulated_prompt_len = 0
        self._context_chunk_size = self.prompt_len
        self.py_batch_idx = None


def get_draft_token_length(request) -> int:
    """Draft tokens the request carries this iteration (0 without any)."""
    return len(request.py_draft_tokens) if request.py_draft_tokens is not None else 0
