# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding in the engine (``EngineConfig.speculative_config``, n-gram drafts): each
greedy decode row proposes up to k draft tokens (``drafting.py``), writes them into its KV with
its pending token in one forward (k + 1 query rows), and keeps the longest prefix the model
itself would have generated; the rest is dropped before the step takes the iteration in:

    row       pending d1 d2 d3              the forward writes 4 tokens' KV, returns 4 rows of logits
    greedy    t0      t1 t2 t3              t0 == d1, t1 == d2, t2 != d3: 2 drafts accepted
    kept      pending d1 d2                 the step takes 3 tokens in; d3's slot is released
    output    d1 d2 t2                      t2, the model's own token after d2, is the next pending

The policy sees the accepted tokens only: the step takes in 1 + a tokens, and their mass is that of
the row's first 1 + a queries (``Forwards.run(..., verify=True)``). With greedy sampling the
output is what decoding one token at a time gives (up to float order: k + 1 rows of a forward are
summed in another order than one). Sampled requests draft nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trtllm_vtoken.runtime.drafting import NGramDecodingConfig, ngram_drafts
from trtllm_vtoken.runtime.sampling import sample


@dataclass
class SpeculationStats:
    drafted: int = 0
    """Draft tokens written into the KV and verified."""
    accepted: int = 0
    """Of them, those the model's own greedy tokens matched."""
    verify_rows: int = 0
    """Decode rows that carried drafts."""


class Speculation:
    """Drafts for an iteration's decode rows, and what the verifying forward accepted.

    Args:
        config: the n-gram drafting settings.
        requests: the engine's requests by id (their tokens and sampling settings).
        kv: the engine's KV-cache manager (reservations grow for drafts, shrink for rejections).
    """

    def __init__(self, config: NGramDecodingConfig, requests: dict[int, Any], kv: Any) -> None:
        self.config, self.requests, self.kv = config, requests, kv
        self.stats = SpeculationStats()

    def draft(self, decode: list[int]) -> dict[int, list[int]]:
        """Draft tokens of the decode rows whose slot is reserved (one token each): at most each
        request's ``draft_tokens`` (0 for a sampled one) within its length, where the pool holds
        them (admission counted them: ``step_tokens``); their reservations grow by them."""
        drafts: dict[int, list[int]] = {}
        for req_id in decode:
            request = self.requests[req_id]
            if not request.draft_tokens:
                continue
            proposed = ngram_drafts(request.prompt_ids + request.output_ids, self.config,
                                    min(request.remaining - 1, request.draft_tokens))
            if proposed and self.kv.extend_reservation(req_id, len(proposed)):
                drafts[req_id] = proposed
        return drafts

    def accept(self, decode: list[int], drafts: dict[int, list[int]], logits: torch.Tensor,
               mass: torch.Tensor | None) -> tuple[list[torch.Tensor], list[int], torch.Tensor | None]:
        """After the verifying forward (logits [B, T, vocab], mass [B, T, L] of the first 1 .. T
        queries): per row the logits of the tokens it keeps ([1 + a, vocab]: the accepted drafts'
        and the next token's), how many tokens the step takes in (1 + a), and the mass of those
        queries [B, L]. The rejected drafts' reservations are released."""
        rows, taken, chosen = [], [], []
        for i, req_id in enumerate(decode):
            proposed = drafts.get(req_id, [])
            request, generated = self.requests[req_id], list(self.requests[req_id].output_ids)
            accepted = 0
            for token in proposed:  # the request's own greedy choice at each position, in turn
                if sample(logits[i, accepted], request.params, None, generated) != token:
                    break
                generated.append(token)
                accepted += 1
            if len(proposed) > accepted:
                self.kv.drop_reserved(req_id, len(proposed) - accepted)
            self.stats.drafted += len(proposed)
            self.stats.accepted += accepted
            self.stats.verify_rows += bool(proposed)
            rows.append(logits[i, : accepted + 1])
            taken.append(accepted + 1)
            chosen.append(accepted)
        picked = None if mass is None else mass[torch.arange(len(decode)), torch.tensor(chosen)]
        return rows, taken, picked
