# SPDX-License-Identifier: Apache-2.0
"""What ``LLM.generate`` and ``LLM.stream`` return, in the shape of TensorRT-LLM's LLM API
(``tensorrt_llm/llmapi/llm.py`` ``RequestOutput``, ``tensorrt_llm/executor/result.py``
``CompletionOutput``), which vLLM's shares:

    RequestOutput
        request_id, prompt (the text, None for token ids), prompt_token_ids, finished,
        num_preemptions (vToken's)
        outputs: [CompletionOutput]       one per request (no beam search, n = 1)
            index, text, token_ids, cumulative_logprob, logprobs, finish_reason, stop_reason
            text_diff, token_ids_diff, logprobs_diff: what the latest streamed snapshot added

    out.outputs[0].text, out.outputs[0].token_ids, out.prompt, out.finished

The flat attributes of the previous release (``out.req_id``, ``out.text``, ``out.token_ids``,
``out.finish_reason``, and unpacking ``[out] = llm.generate("one prompt")``) still work and warn.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trtllm_vtoken.deprecation import warn_deprecated
from trtllm_vtoken.runtime.logprobs import TokenLogprobs
from trtllm_vtoken.runtime.request import Request, RequestDelta


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    """Sum of the log-probabilities of ``token_ids`` under the model's raw logits."""
    logprobs: TokenLogprobs = field(default_factory=list)
    """With ``SamplingParams(logprobs=k)``: per token, the top k and the sampled token
    (``runtime/logprobs.py``); empty otherwise."""
    finish_reason: str | None = None
    """"stop" (EOS, a stop token or string), "length" (max_tokens), "cancelled"; None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it, None for any other reason."""
    _last_text_len: int = field(default=0, repr=False)
    _last_token_ids_len: int = field(default=0, repr=False)

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
    def logprobs_diff(self) -> TokenLogprobs:
        return self.logprobs[self._last_token_ids_len:]


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_preemptions: int = 0
    """Times the request was preempted and recomputed (vToken's)."""

    # ---- the previous release's flat output; going away ----------------------------------------
    @property
    def req_id(self) -> int:
        warn_deprecated("RequestOutput.req_id", "RequestOutput.request_id")
        return self.request_id

    @property
    def text(self) -> str:
        warn_deprecated("RequestOutput.text", "RequestOutput.outputs[0].text")
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        warn_deprecated("RequestOutput.token_ids", "RequestOutput.outputs[0].token_ids")
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        warn_deprecated("RequestOutput.finish_reason", "RequestOutput.outputs[0].finish_reason")
        return self.outputs[0].finish_reason

    def __iter__(self):
        warn_deprecated("unpacking one prompt's result ([out] = llm.generate(prompt))",
                        "out = llm.generate(prompt): one prompt gives one RequestOutput, as in TensorRT-LLM")
        yield self


def finished_output(request: Request, prompt: str | None) -> RequestOutput:
    """The result of a request as the engine holds it (finished, unless a failure stopped it)."""
    completion = CompletionOutput(0, request.text, list(request.output_ids), request.cumulative_logprob,
                                  list(request.logprobs), request.finish_reason, request.stop_reason)
    return RequestOutput(request.req_id, prompt, list(request.prompt_ids), [completion],
                         request.finish_reason is not None, request.num_preemptions)


class OutputStream:
    """One request's snapshots while it streams: each ``update`` with the request's step output
    returns the whole output so far, its ``*_diff`` properties holding what that step added."""

    def __init__(self, request_id: int, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.latest = RequestOutput(request_id, prompt, list(prompt_token_ids), [CompletionOutput(0)], False)

    def update(self, delta: RequestDelta) -> RequestOutput:
        last = self.latest.outputs[0]
        completion = CompletionOutput(
            0, last.text + delta.text_delta, last.token_ids + list(delta.new_token_ids),
            delta.cumulative_logprob, last.logprobs + list(delta.new_logprobs), delta.finish_reason,
            delta.stop_reason, len(last.text), len(last.token_ids))
        self.latest = replace(self.latest, outputs=[completion], finished=delta.finished,
                              num_preemptions=delta.num_preemptions)
        return self.latest
