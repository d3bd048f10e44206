# SPDX-License-Identifier: Apache-2.0
"""The engine's per-request end of an iteration (``Engine``, step 4): sample each row's token (or,
with drafts, the accepted ones and the token after them), detokenize, check stops, and release a
request that ends, before the step of the requests that go on."""

from __future__ import annotations

import time

import torch

from trtllm_vtoken.runtime.logprobs import token_logprobs
from trtllm_vtoken.runtime.request import Request, RequestDelta, Status
from trtllm_vtoken.runtime.sampling import sample


class RequestSampling:
    """Sampling calls of ``Engine`` (a mixin: it reads the engine's ``running``, ``kv``, ``stats``,
    ``eos_token_ids``, ``record_trace``, the shared ``_generator`` and the per-request ``_texts``,
    ``_generators`` and ``_specs``)."""

    def _advance(self, request: Request, logits: torch.Tensor) -> RequestDelta:
        """Samples the request's next token from ``logits`` [vocab], or its next tokens from
        [k, vocab] (speculative decoding: the accepted drafts and the token after them), one row
        at a time until one ends the request."""
        new, text, reason = [], "", None
        for row in (logits if logits.dim() == 2 else logits[None]):
            token, piece, reason = self._append(request, row)
            new.append(token)
            text += piece
            if reason is not None:
                break
        if reason is not None:
            self.running.remove(request.req_id)
            self.kv.release(request.req_id, lambda _: request.prefill_ids())  # its last blocks stay cached
            self.stats.finished += 1
            self._finish(request, reason)
        return self._output(request, new, text)

    def _append(self, request: Request, logits: torch.Tensor) -> tuple[int, str, str | None]:
        """Samples one token from ``logits`` [vocab] and appends it; returns it, the text it adds
        and why the request ends with it (None: it goes on)."""
        req_id, params = request.req_id, request.params
        if self.record_trace:
            request.logits.append(logits)
        token = sample(logits, params, self._generators.get(req_id, self._generator), request.output_ids)
        logprobs = torch.log_softmax(logits.float(), -1)
        request.cumulative_logprob += float(logprobs[token])
        if params.logprobs:
            request.logprobs.append(token_logprobs(logprobs, token, params.logprobs))
        request.output_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = time.perf_counter()
        reason = None
        if token in (params.stop_token_ids or ()):
            reason, request.stop_reason = "stop", token
        elif token in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        elif request.remaining == 0:
            reason = "length"
        text = ""
        stream = self._texts.get(req_id)
        if stream is not None:
            ids = request.output_ids[:-1] if reason == "stop" else request.output_ids
            text, hit = stream.update(ids, final=reason is not None)
            request.text = stream.text
            if hit:
                reason, request.stop_reason = "stop", hit
        return token, text, reason

    def _finish(self, request: Request, reason: str) -> None:
        self._specs.pop(request.req_id, None)
        request.status = Status.FINISHED
        request.finish_reason = reason
        self._texts.pop(request.req_id, None)
        self._generators.pop(request.req_id, None)

    @staticmethod
    def _output(request: Request, new_ids: list[int], text: str) -> RequestDelta:
        new_logprobs = tuple(request.logprobs[-len(new_ids):]) if new_ids and request.logprobs else ()
        return RequestDelta(request.req_id, tuple(new_ids), text, request.status is Status.FINISHED,
                            request.finish_reason, len(request.output_ids), request.stop_reason,
                            request.cumulative_logprob, new_logprobs, request.num_preemptions)
