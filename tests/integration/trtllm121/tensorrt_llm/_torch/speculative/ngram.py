# SPDX-License-Identifier: Apache-2.0
"""Double of ``_torch/speculative/ngram.py`` and the ``Drafter`` base it extends
(``drafter.py``), 1.2-era copies (index ids 894613214, 236325296, 13005988277).

- ``NGramPoolManager(spec_config, max_num_requests)``: a resource manager (the executor creator
  registers it as the spec resource manager) whose pool maps a pattern (a tuple of up to
  ``max_matching_ngram_size`` tokens) to the continuations seen after it, up to ``max_draft_len``
  tokens each. ``get_draft_tokens(prefix, request_id, max_sequence_length)`` first adds the
  patterns of the request's tokens since its last call (public pool by default: one pool shared by
  every request), then looks the longest suffix of ``prefix`` up and returns the oldest
  continuation (``is_use_oldest``), cut so that the request does not pass ``max_sequence_length``.
  With ``is_keep_all`` a pattern keeps every continuation of the longest length seen, and a longer
  one replaces the shorter ones; without it only the longest is kept. A private pool
  (``is_public_pool=False``) is dropped when its request completes (``update_resources``).
- ``NGramDrafter.prepare_draft_tokens(scheduled_requests, resource_manager)``: for each
  generation request, by batch index then id, ``py_draft_tokens`` = the pool's draft for its
  tokens, the prompt's length plus ``py_max_new_tokens`` as the length limit.
- ``Drafter.pad_draft_tokens_for_cuda_graph``: every generation request's drafts padded with 0 up
  to ``max_draft_len``, so each decode row carries the same number of tokens.
"""

from __future__ import annotations

from ..pyexecutor.llm_request import LlmRequestState, get_draft_token_length
from ..pyexecutor.resource_manager import BaseResourceManager


class NGramPoolManager(BaseResourceManager):
    def __init__(self, spec_config, max_num_requests: int) -> None:
        self.max_draft_tokens = spec_config.max_draft_len
        self.max_matching_ngram_size = spec_config.max_matching_ngram_size
        self.is_keep_all, self.is_use_oldest = spec_config.is_keep_all, spec_config.is_use_oldest
        self.is_public_pool = spec_config.is_public_pool
        self.max_num_requests = max_num_requests
        self.pool: dict = {}
        self.start_index: dict[int, int] = {}

    def get_max_resource_count(self) -> int:
        return self.max_num_requests

    def get_needed_resource_to_completion(self, request) -> int:
        return 0

    def update_resources(self, scheduled_batch) -> None:
        if self.is_public_pool:
            return
        for request in scheduled_batch.context_requests + scheduled_batch.generation_requests:
            if request.state == LlmRequestState.GENERATION_COMPLETE and request.request_id in self.pool:
                del self.pool[request.request_id]
                del self.start_index[request.request_id]

    def _learn(self, pool: dict, sequence: list[int], sizes: range) -> None:
        for size in sizes:
            for left in range(len(sequence) - size):
                pattern = tuple(sequence[left : left + size])
                match = tuple(sequence[left + size : left + size + self.max_draft_tokens])
                known = pool.get(pattern)
                if known is None or (not self.is_keep_all and len(match) > len(known[0])):
                    pool[pattern] = [match]
                elif match not in known:
                    pool[pattern] = [m for m in known if len(m) >= len(match)] + [match]

    def get_draft_tokens(self, prefix: list[int], request_id: int, max_sequence_length: int) -> list[int]:
        room = max_sequence_length - 1 - len(prefix)
        if room <= 0:
            return []
        if request_id not in self.start_index:
            self.start_index[request_id] = 0
            if not self.is_public_pool:
                self.pool[request_id] = {}
        pool = self.pool if self.is_public_pool else self.pool[request_id]
        sizes = range(min(self.max_matching_ngram_size, len(prefix) - 1), 0, -1)
        self._learn(pool, prefix[self.start_index[request_id]:], sizes)
        draft: list[int] = []
        for size in sizes:
            matches = pool.get(tuple(prefix[-size:]))
            if matches:
                draft = list(matches[0 if self.is_use_oldest else -1])[:room]
                break
        self.start_index[request_id] = max(0, len(prefix) - (self.max_draft_tokens + self.max_matching_ngram_size - 1))
        return draft


class NGramDrafter:
    def __init__(self, spec_config, ngram_pool_manager: NGramPoolManager) -> None:
        self.max_draft_len = spec_config.max_draft_len
        self.spec_resource_manager = ngram_pool_manager

    def prepare_draft_tokens(self, scheduled_requests, resource_manager=None) -> None:
        ordered = sorted(scheduled_requests.generation_requests,
                         key=lambda r: (r.py_batch_idx is None, r.py_batch_idx or r.request_id))
        for request in ordered:
            request.py_draft_tokens = self.spec_resource_manager.get_draft_tokens(
                list(request.get_tokens(0)), request.request_id,
                max_sequence_length=request.py_orig_prompt_len + request.py_max_new_tokens)

    def pad_draft_tokens_for_cuda_graph(self, scheduled_requests) -> None:
        for request in scheduled_requests.generation_requests:
            request.py_draft_tokens.extend(0 for _ in range(self.max_draft_len - get_draft_token_length(request)))
