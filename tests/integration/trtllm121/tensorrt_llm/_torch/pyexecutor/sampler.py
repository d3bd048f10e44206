# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/pyexecutor/sampler.py`` ``TorchSampler`` (1.2-era copies, index ids
5328327948, 1555942117): ``sample_async`` picks each scheduled request's next token (here: a
function of the request, standing for greedy sampling of the model's logits) and returns a
``SampleState``; ``update_requests(state)`` adds the tokens to the requests and applies the stop
criteria (``_handle_stop_criteria``): the request's ``py_end_id`` sampled -> END_ID; ``num_tokens -
py_orig_prompt_len >= py_max_new_tokens`` or ``num_tokens >= max_seq_len`` -> LENGTH; either sets
GENERATION_COMPLETE. A context request whose prompt is not finished yet, or a request already
complete, gets no token; every token added advances ``py_decoding_iter``.

Draft tokens (``_process_draft_tokens_greedy``, 1.2-era copy index id 9889077999): a decode row
carrying drafts samples a token after its input and after each draft (the model's choice given
the drafts before it); the first is added, then each draft equal to the token just added is
accepted and the token sampled after it added, until a draft differs or a stop criterion ends the
request. ``py_num_accepted_draft_tokens`` = the drafts accepted, ``py_rewind_len`` =
``py_draft_pages_allocated`` less them (the KV slots ``update_resources`` rewinds)."""

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
        tokens = {req.py_request_id: self._targets(req) for req in scheduled_batch.all_requests()
                  if not req.is_cuda_graph_dummy}
        return SampleState(scheduled_batch, tokens)

    def _targets(self, req):
        """The token sampled after the row's input, or with drafts after each of them: [1 + k]."""
        drafts = list(req.py_draft_tokens) if req.is_generation_in_progress_state() else []
        if not drafts:
            return self.next_token(req)
        return [self.next_token(_Drafted(req, drafts[:j])) for j in range(len(drafts) + 1)]

    def update_requests(self, state: SampleState, resource_manager=None) -> None:
        batch = state.scheduled_requests
        for req in batch.context_requests:
            if req.state == LlmRequestState.GENERATION_COMPLETE or req.context_remaining_length != 0:
                continue
            self._add(req, state.new_tokens[req.py_request_id])
        for req in batch.generation_requests:
            if req.state != LlmRequestState.GENERATION_IN_PROGRESS:
                continue
            targets = state.new_tokens[req.py_request_id]
            if not isinstance(targets, list):
                self._add(req, targets)
                continue
            accepted = self._accept_drafts(req, targets)
            req.py_num_accepted_draft_tokens = accepted
            req.py_rewind_len = req.py_draft_pages_allocated - accepted

    def _accept_drafts(self, req, targets: list[int]) -> int:
        token = targets[0]
        self._add(req, token)
        accepted = 0
        for draft in req.py_draft_tokens:
            if req.is_finished or draft != token:
                break
            accepted += 1
            token = targets[accepted]
            self._add(req, token)
        return accepted

    def _add(self, req, token: int) -> None:
        req.add_new_token(token, 0)
        req.py_decoding_iter += 1
        num_tokens = req.get_num_tokens(0)
        if token == req.py_end_id:
            req.finish_by_reason(FinishReason.END_ID)
        elif num_tokens - req.py_orig_prompt_len >= req.py_max_new_tokens or num_tokens >= self.max_seq_len:
            req.finish_by_reason(FinishReason.LENGTH)


class _Drafted:
    """A request as the model sees it at a draft position: its tokens and the drafts before it."""

    def __init__(self, req, drafts: list[int]) -> None:
        self._req, self._tokens = req, list(req.get_tokens(0)) + list(drafts)
        self.py_request_id = req.py_request_id

    def get_tokens(self, beam: int) -> list[int]:
        return list(self._tokens)

    def get_num_tokens(self, beam: int) -> int:
        return len(self._tokens)
