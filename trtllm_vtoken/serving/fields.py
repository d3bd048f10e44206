# SPDX-License-Identifier: Apache-2.0
"""The names the two Triton models answer to, and what a request may carry besides them.

Cheap to import (no torch, no numpy): the ``ensemble`` model's stub loads only this.

    ensemble input            tensorrt_llm input
    text_input           -->  text_input
    max_tokens           -->  sampling_param_max_tokens
    temperature / top_p / top_k / seed  -->  sampling_param_<same>
    stop_words           -->  sampling_param_stop
    stream                    (the ensemble always streams from tensorrt_llm; it joins the pieces
                               itself when the client did not ask for a stream)

Request *parameters*: Triton's HTTP ``generate`` endpoints turn every JSON key that is not one of
the model's inputs into a request parameter, and gRPC clients may attach parameters too. Any but
the two below is a misspelled or unknown field (``sampling_param_max_token``) and is refused
rather than ignored:

    id                          the generate endpoint sets the request id from it and also passes
                                it on as a parameter
    stream_end_without_error    (bool) a stream that fails after its first piece ends with a final
                                response whose finish_reason is "error: <message>" instead of an
                                error response (for BLS callers: see the tensorrt_llm model)
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable

TENSORRT_LLM_INPUTS = (
    "text_input", "streaming", "sampling_param_max_tokens", "sampling_param_temperature",
    "sampling_param_top_p", "sampling_param_top_k", "sampling_param_seed", "sampling_param_stop",
    "sampling_param_frequency_penalty", "sampling_param_presence_penalty", "sampling_param_best_of",
    "sampling_param_exclude_input_from_output", "return_finish_reason", "return_stop_reason",
    "return_cumulative_logprob", "vtoken_policy", "vtoken_budget", "vtoken_sink_tokens", "vtoken_recent_window",
    "stop",
)

ENSEMBLE_TO_TENSORRT_LLM = {
    "text_input": "text_input",
    "max_tokens": "sampling_param_max_tokens",
    "temperature": "sampling_param_temperature",
    "top_p": "sampling_param_top_p",
    "top_k": "sampling_param_top_k",
    "seed": "sampling_param_seed",
    "stop_words": "sampling_param_stop",
}
ENSEMBLE_INPUTS = (*ENSEMBLE_TO_TENSORRT_LLM, "stream")

END_WITHOUT_ERROR = "stream_end_without_error"
ALLOWED_PARAMETERS = ("id", END_WITHOUT_ERROR)


def check_parameters(parameters_json: str | None, inputs: Iterable[str],
                     allowed: Iterable[str] = ALLOWED_PARAMETERS) -> dict:
    """The request's parameters; ValueError naming the first one not in ``allowed``.

    ``parameters_json`` is what ``request.parameters()`` returns in Triton's Python backend.
    """
    parameters = json.loads(parameters_json) if parameters_json else {}
    unknown = sorted(set(parameters) - set(allowed))
    if not unknown:
        return parameters
    inputs = list(inputs)
    close = difflib.get_close_matches(unknown[0], inputs, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; the inputs are: {', '.join(inputs)}"
    raise ValueError(f"unknown input {unknown[0]!r}{hint}")


def as_ensemble_message(message: str) -> str:
    """An error of the tensorrt_llm model, worded with the ensemble's field names."""
    for outer, inner in ENSEMBLE_TO_TENSORRT_LLM.items():
        message = message.replace(f"'{inner}'", f"'{outer}'")
    return message
