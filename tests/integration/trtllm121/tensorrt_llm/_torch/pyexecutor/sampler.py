# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/pyexecutor/sampler.py`` ``TorchSampler`` (1.2-era copies, index ids
5328327948, 1555942117): ``sample_async`` picks each scheduled request's next token (here: a
function of the request, standing for greedy sampling of the model's logits) and returns a
``SampleState``; ``update_requests(state)`` adds the tokens to the requests and applies the stop
criteria (``_handle_stop_criteria``): the request's ``py_end_id`` sampled -> END_ID; ``num_tokens -
py_orig_prompt_len >= py_max_new_tokens`` or ``num_tokens >= max_seq_len`` -> LENGTH; either sets
GENERATION_COMPLETE. A context request whose prompt is not finished yet, or a request already
complete, gets no token; every token added advances ``py_decoding_iter``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .llm_request import FinishReason, LlmRequestState


@dataclass
class SampleState:
    scheduled_requests: object
    new_tokens: dict  # request id -> the token sampled for it


class TorchSampler:
    def __init__(self, next_token: Callable[[object], int], max_seq_len: int) -> None:
        self.next_token, self.max_seq_len = next_token, max_seq_len

    def sample_async(self, scheduled_batch, model_outputs) -> SampleState:
        tokens = {req.py_request_id: self.next_token(req) for req in scheduled_batch.all_requests()
                  if not req.is_cuda_graph_dummy}
        return SampleState(scheduled_batch, tokens)

    def update_requests(self, state: SampleState, resource_manager=None) -> None:
        batch = state.scheduled_requests
        for req in batch.context_requests:
            if req.state == LlmRequestState.GENERATION_COMPLETE or req.context_remaining_length != 0:
                continue
            self._add(req, state.new_tokens[req.py_request_id])
        for req in batch.generation_requests:
            if req.state != LlmRequestState.GENERATION_IN_PROGRESS:
                continue
            self._add(req, state.new_tokens[req.py_request_id])

    def _add(self, req, token: int) -> None:
        req.add_new_token(token, 0)
        req.py_decoding_iter += 1
        num_tokens = req.get_num_tokens(0)
        if token == req.py_end_id:
            req.finish_by_reason(FinishReason.END_ID)
        elif num_tokens - req.py_orig_prompt_len >= req.py_max_new_tokens or num_tokens >= self.max_seq_len:
            req.finish_by_reason(FinishReason.LENGTH)
