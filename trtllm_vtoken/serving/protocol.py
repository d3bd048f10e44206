# SPDX-License-Identifier: Apache-2.0
"""The request fields of TensorRT-LLM's LLM-API Triton model, parsed and validated.

Triton hands the Python backend one numpy array per input (strings as ``bytes`` objects); the
model passes a getter here and gets back a prompt and ``SamplingParams``, or a ValueError whose
message goes to the client as is. Field names follow ``triton_backend/all_models/llmapi``:

    text_input                              string [-1]   required, non-empty
    streaming                               bool [1]      send pieces as they are generated
    sampling_param_max_tokens               int32 [1]     1 .. max_tokens_limit (default 64)
    sampling_param_temperature / _top_p     fp32 [1]
    sampling_param_top_k                    int32 [1]
    sampling_param_seed                     uint64 [1]
    sampling_param_stop                     string [-1]   stop strings
    sampling_param_frequency_penalty        fp32 [1]
    sampling_param_presence_penalty         fp32 [1]
    sampling_param_best_of                  int32 [1]     only 1 (one sequence per request)
    sampling_param_exclude_input_from_output bool [1]     default true
    return_finish_reason / return_stop_reason / return_cumulative_logprob   bool [1]
    vtoken_policy                           string [1]    this request's eviction policy, or "native"
    vtoken_budget                           fp32 [1]      live tokens it keeps: a ratio in (0, 1], or
                                                          a count (a whole number above 1)
    vtoken_sink_tokens / vtoken_recent_window  int32 [1]  first / newest tokens it never evicts
    stop                                    bool [1]      cancel the running requests with this
                                                          request's id (``read_stop``)

(the ``vtoken_*`` inputs are optional: what a request leaves out comes from the served policy)
Floats must be finite. Over HTTP, Triton converts JSON numbers to the input's type before the model
sees them: an integer beyond int32 arrives wrapped around (2**40 as 0), a float beyond fp32 as inf.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import math

import numpy as np

from trtllm_vtoken.policies.request_settings import EvictionSettings
from trtllm_vtoken.runtime.sampling import SamplingParams

Getter = Callable[[str], "np.ndarray | None"]

_KINDS = {"b": "bool", "i": "integer", "u": "integer", "f": "float"}


@dataclass(frozen=True)
class ParsedRequest:
    prompt: str
    params: SamplingParams
    streaming: bool
    exclude_input: bool
    return_finish_reason: bool
    return_stop_reason: bool
    return_cumulative_logprob: bool


def parse_request(get: Getter, max_tokens_limit: int, default_max_tokens: int = 64,
                  served_policy: str = "none", per_request_eviction: bool = True) -> ParsedRequest:
    """Reads and checks every field; raises ValueError naming the first bad one.

    ``served_policy`` is the eviction policy of the engine ("none" for native). With
    ``per_request_eviction`` a request may bring its own settings (``vtoken_*``); without (a
    backend that serves one policy for all) a ``vtoken_policy`` other than the served one, or any
    other ``vtoken_*`` input, is refused.
    """
    eviction = _eviction(get, served_policy, per_request_eviction)
    prompt = read_text(get, "text_input")
    if prompt is None:
        raise ValueError("missing required input 'text_input'")
    if not prompt.strip():
        raise ValueError("'text_input' is empty")
    max_tokens = _scalar(get, "sampling_param_max_tokens", "i", default_max_tokens)
    if not 1 <= max_tokens <= max_tokens_limit:
        wrapped = (" (over HTTP, Triton converts JSON integers to int32 before the model sees them: "
                   "one beyond 2**31-1 arrives wrapped around)") if max_tokens < 1 else ""
        raise ValueError(f"'sampling_param_max_tokens' must lie in [1, {max_tokens_limit}], "
                         f"got {max_tokens}{wrapped}")
    stop = _strings(get, "sampling_param_stop")
    seed = _scalar(get, "sampling_param_seed", "i", None)
    best_of = _scalar(get, "sampling_param_best_of", "i", 1)
    if best_of != 1:
        raise ValueError(f"'sampling_param_best_of' must be 1 (one sequence per request), got {best_of}")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_scalar(get, "sampling_param_temperature", "f", 0.0),
        top_p=_scalar(get, "sampling_param_top_p", "f", 1.0),
        top_k=_scalar(get, "sampling_param_top_k", "i", 0),
        seed=seed,
        stop=tuple(s for s in stop if s),
        presence_penalty=_scalar(get, "sampling_param_presence_penalty", "f", 0.0),
        frequency_penalty=_scalar(get, "sampling_param_frequency_penalty", "f", 0.0),
        eviction=eviction,
    )
    return ParsedRequest(
        prompt=prompt, params=params,
        streaming=_scalar(get, "streaming", "b", False),
        exclude_input=_scalar(get, "sampling_param_exclude_input_from_output", "b", True),
        return_finish_reason=_scalar(get, "return_finish_reason", "b", False),
        return_stop_reason=_scalar(get, "return_stop_reason", "b", False),
        return_cumulative_logprob=_scalar(get, "return_cumulative_logprob", "b", False),
    )


def read_stop(get: Getter) -> bool:
    """True for a request that asks to cancel the running requests sharing its request id."""
    return _scalar(get, "stop", "b", False)


def _array(get: Getter, name: str) -> np.ndarray | None:
    value = get(name)
    return None if value is None else np.asarray(value)


def _eviction(get: Getter, served: str, per_request: bool) -> EvictionSettings | None:
    """The request's own eviction settings, or None if it brings none."""
    policy = read_text(get, "vtoken_policy")
    budget = _scalar(get, "vtoken_budget", "f", None)
    n_sink = _scalar(get, "vtoken_sink_tokens", "i", None)
    window = _scalar(get, "vtoken_recent_window", "i", None)
    if policy is None and budget is None and n_sink is None and window is None:
        return None
    if budget is not None and budget > 1 and not budget.is_integer():
        raise ValueError(f"'vtoken_budget' above 1 is a token count and must be whole, got {budget}")
    try:
        settings = EvictionSettings(policy=policy, budget=budget, n_sink=n_sink, recent_window=window)
    except ValueError as exc:
        raise ValueError(f"bad vToken eviction settings: {exc}") from None
    if not per_request:
        if budget is not None or n_sink is not None or window is not None:
            raise ValueError("this model serves one eviction policy for all requests: 'vtoken_budget', "
                             "'vtoken_sink_tokens' and 'vtoken_recent_window' are not accepted")
        wanted = "none" if policy == "native" else policy
        if wanted != served:
            raise ValueError(f"this model serves eviction policy {served!r}, not {policy!r}")
        return None
    return settings


def read_text(get: Getter, name: str) -> str | None:
    """The single string of input ``name``, or None if the request does not carry it."""
    values = _strings(get, name, required_one=True)
    return values[0] if values else None


def _strings(get: Getter, name: str, required_one: bool = False) -> list[str]:
    array = _array(get, name)
    if array is None:
        return []
    if array.dtype.kind not in "OSU":
        raise ValueError(f"'{name}' must be a string tensor (BYTES), got {array.dtype}")
    flat = array.reshape(-1)
    if required_one and flat.size != 1:
        raise ValueError(f"'{name}' must hold exactly one string, got shape {list(array.shape)}")
    try:
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in flat]
    except UnicodeDecodeError:
        raise ValueError(f"'{name}' is not valid UTF-8") from None


def _scalar(get: Getter, name: str, kind: str, default):
    """One element of the given kind ('b' bool, 'i' integer, 'f' float), or the default."""
    array = _array(get, name)
    if array is None:
        return default
    if array.size != 1:
        raise ValueError(f"'{name}' must hold one value, got shape {list(array.shape)}")
    ok = array.dtype.kind == kind or (kind == "i" and array.dtype.kind in "iu") or (
        kind == "f" and array.dtype.kind in "fiu")
    if not ok:
        raise ValueError(f"'{name}' must be {_KINDS[kind]}, got {array.dtype}")
    value = array.reshape(-1)[0].item()
    if kind == "f" and not math.isfinite(value):
        raise ValueError(f"'{name}' must be a finite number, got {value}")
    return float(value) if kind == "f" else bool(value) if kind == "b" else int(value)
