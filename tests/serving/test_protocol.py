# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import numpy as np
import pytest

from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.serving.fields import (
    ENSEMBLE_INPUTS,
    TENSORRT_LLM_INPUTS,
    as_ensemble_message,
    check_parameters,
)
from trtllm_vtoken.serving.protocol import parse_request, read_stop
from trtllm_vtoken.serving.settings import ServingSettings


def getter(**fields):
    arrays = {}
    for name, value in fields.items():
        if isinstance(value, np.ndarray):
            arrays[name] = value
        elif isinstance(value, str):
            arrays[name] = np.array([value.encode()], dtype=np.object_)
        elif isinstance(value, list):
            arrays[name] = np.array([v.encode() for v in value], dtype=np.object_)
        elif isinstance(value, bool):
            arrays[name] = np.array([value])
        elif isinstance(value, int):
            arrays[name] = np.array([value], dtype=np.int32)
        else:
            arrays[name] = np.array([value], dtype=np.float32)
    return arrays.get


def test_fields_map_to_sampling_params():
    parsed = parse_request(getter(
        text_input="hello", streaming=True, sampling_param_max_tokens=12,
        sampling_param_temperature=0.7, sampling_param_top_p=0.9, sampling_param_top_k=5,
        sampling_param_seed=np.array([42], dtype=np.uint64), sampling_param_stop=["\n\n", ""],
        sampling_param_exclude_input_from_output=False, return_finish_reason=True,
        sampling_param_presence_penalty=0.5, sampling_param_frequency_penalty=0.25, sampling_param_best_of=1,
        return_stop_reason=True, return_cumulative_logprob=True,
        vtoken_policy="h2o"), max_tokens_limit=100, served_policy="h2o")
    p = parsed.params
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, 0.25)
    assert parsed.return_finish_reason and parsed.return_stop_reason and parsed.return_cumulative_logprob
    assert parsed.prompt == "hello" and parsed.streaming and not parsed.exclude_input
    assert (p.max_tokens, p.top_k, p.seed, p.stop) == (12, 5, 42, ("\n\n",))
    assert p.temperature == pytest.approx(0.7) and p.top_p == pytest.approx(0.9)
    defaults = parse_request(getter(text_input="hi"), max_tokens_limit=100, default_max_tokens=7)
    assert defaults.params.max_tokens == 7 and defaults.params.greedy and not defaults.streaming


@pytest.mark.parametrize("fields,message", [
    ({}, "missing required input 'text_input'"),
    ({"text_input": "  "}, "'text_input' is empty"),
    ({"text_input": ["a", "b"]}, "must hold exactly one string"),
    ({"text_input": np.array([1, 2], dtype=np.int32)}, "must be a string tensor"),
    ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, "not valid UTF-8"),
    ({"text_input": "hi", "sampling_param_max_tokens": 0}, r"must lie in \[1, 100\], got 0"),
    ({"text_input": "hi", "sampling_param_max_tokens": 101}, r"must lie in \[1, 100\], got 101"),
    ({"text_input": "hi", "sampling_param_max_tokens": np.array([1, 2], dtype=np.int32)}, "must hold one value"),
    ({"text_input": "hi", "sampling_param_max_tokens": 2.5}, "must be integer"),
    ({"text_input": "hi", "sampling_param_top_p": 1.5}, "top_p must lie in"),
    ({"text_input": "hi", "streaming": 3}, "'streaming' must be bool"),
    ({"text_input": "hi", "vtoken_policy": "lru"}, "unknown eviction policy 'lru'; known: native, h2o"),
    ({"text_input": "hi", "sampling_param_best_of": 2}, "'sampling_param_best_of' must be 1"),
    ({"text_input": "hi", "sampling_param_presence_penalty": 5.0}, "presence_penalty must lie in"),
    ({"text_input": "hi", "sampling_param_temperature": float("inf")}, "'sampling_param_temperature' must be a finite"),
    ({"text_input": "hi", "sampling_param_temperature": float("nan")}, "'sampling_param_temperature' must be a finite"),
    ({"text_input": "hi", "sampling_param_top_p": float("-inf")}, "'sampling_param_top_p' must be a finite"),
    ({"text_input": "hi", "sampling_param_max_tokens": -2**31}, r"got -2147483648 \(over HTTP.*wrapped around"),
    ({"text_input": "hi", "vtoken_budget": 1.5}, "above 1 is a token count and must be whole"),
    ({"text_input": "hi", "vtoken_budget": -2.0}, r"bad vToken eviction settings: .*ratio must lie in \(0, 1\]"),
    ({"text_input": "hi", "vtoken_sink_tokens": -1}, "n_sink must be a non-negative integer"),
    ({"text_input": "hi", "vtoken_recent_window": 2.0}, "'vtoken_recent_window' must be integer"),
    ({"text_input": "hi", "vtoken_policy": "native", "vtoken_budget": 0.5}, "'native' evicts nothing"),
])
def test_bad_fields_raise_a_clear_value_error(fields, message):
    with pytest.raises(ValueError, match=message):
        parse_request(getter(**fields), max_tokens_limit=100, served_policy="h2o")


def test_eviction_settings_per_request():
    parsed = parse_request(getter(text_input="hi", vtoken_policy="streaming_llm", vtoken_budget=0.25,
                                  vtoken_sink_tokens=4, vtoken_recent_window=32), max_tokens_limit=100)
    e = parsed.params.eviction
    assert (e.policy, e.budget.ratio, e.n_sink, e.recent_window) == ("streaming_llm", 0.25, 4, 32)
    assert parse_request(getter(text_input="hi", vtoken_budget=512.0), max_tokens_limit=100
                         ).params.eviction.budget.tokens == 512
    assert parse_request(getter(text_input="hi"), max_tokens_limit=100).params.eviction is None


def test_a_backend_with_one_policy_refuses_other_settings():
    one = dict(max_tokens_limit=100, served_policy="h2o", per_request_eviction=False)
    assert parse_request(getter(text_input="hi", vtoken_policy="h2o"), **one).params.eviction is None
    with pytest.raises(ValueError, match="serves eviction policy 'h2o', not 'random'"):
        parse_request(getter(text_input="hi", vtoken_policy="random"), **one)
    with pytest.raises(ValueError, match="one eviction policy for all requests"):
        parse_request(getter(text_input="hi", vtoken_budget=0.5), **one)


def test_settings_from_parameters():
    settings = ServingSettings.from_parameters({
        "variant": "vtoken", "policy": "streaming_llm", "budget": "128", "num_blocks": "64",
        "chat_template": "false", "max_tokens_limit": "256", "check_invariants": "true"})
    assert settings.engine.num_blocks == 64 and settings.engine.budget == "128"
    assert settings.engine.check_invariants and not settings.chat_template
    assert settings.max_tokens_limit == 256
    with pytest.raises(ValueError, match="unknown model parameter 'num_block'"):
        ServingSettings.from_parameters({"num_block": "64"})
    with pytest.raises(ValueError, match="must be an integer"):
        ServingSettings.from_parameters({"num_blocks": "many"})
    with pytest.raises(ValueError, match="must be true or false"):
        ServingSettings.from_parameters({"chat_template": "maybe"})
    with pytest.raises(KeyError, match="Unknown eviction policy"):
        ServingSettings.from_parameters({"policy": "lru"})
    # optional integers and JSON objects: chunked prefill, FP8 KV, n-gram drafting from config.pbtxt
    long = ServingSettings.from_parameters({"enable_chunked_prefill": "true", "max_num_tokens": "96",
                                            "prefix_caching": "false", "kv_cache_dtype": "fp8"}).engine
    assert long.prefill_chunk_tokens == 64 and long.kv_cache_dtype == "fp8"
    drafting = ServingSettings.from_parameters({"overlap_scheduler": "false",
                                                "speculative_config": '{"decoding_type": "NGram", "max_draft_len": 3}'})
    assert drafting.engine.speculative_config.max_draft_len == 3
    assert ServingSettings.from_parameters({"max_num_tokens": "none"}).engine.max_num_tokens is None
    with pytest.raises(ValueError, match="must be a JSON object"):
        ServingSettings.from_parameters({"overlap_scheduler": "false", "speculative_config": "3"})
    # the engine's policy options (H2O's prefill window), checked as EngineConfig checks them
    windowed = ServingSettings.from_parameters({"policy": "h2o", "policy_options": '{"prefill_window": 64}'})
    assert windowed.engine.policy_options == {"prefill_window": 64}
    assert windowed.engine.make_policy().prefill_window == 64
    with pytest.raises(ValueError, match="must be a JSON object"):
        ServingSettings.from_parameters({"policy": "h2o", "policy_options": "64"})
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['window'\] for policy 'h2o'"):
        ServingSettings.from_parameters({"policy": "h2o", "policy_options": '{"window": 64}'})


def test_non_finite_temperature_is_refused_by_sampling_params_too():
    for value in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            SamplingParams(temperature=value)


def test_request_parameters_the_model_does_not_know_are_refused():
    check_parameters(None, TENSORRT_LLM_INPUTS)
    check_parameters('{"id": "abc"}', TENSORRT_LLM_INPUTS)
    with pytest.raises(ValueError, match="unknown input 'sampling_param_max_token'; did you mean "
                                         "'sampling_param_max_tokens'"):
        check_parameters('{"sampling_param_max_token": 8}', TENSORRT_LLM_INPUTS)
    with pytest.raises(ValueError, match="unknown input 'colour'; the inputs are: text_input, max_tokens"):
        check_parameters('{"colour": "blue", "id": "1"}', ENSEMBLE_INPUTS)


def test_errors_reach_ensemble_clients_in_their_own_field_names():
    message = "'sampling_param_max_tokens' must lie in [1, 8], got 9; 'sampling_param_temperature' ..."
    assert as_ensemble_message(message) == "'max_tokens' must lie in [1, 8], got 9; 'temperature' ..."


def test_stop_field():
    assert read_stop(getter(text_input="", stop=True)) and not read_stop(getter(text_input="hi"))


@pytest.mark.parametrize("model,inputs", [("tensorrt_llm", TENSORRT_LLM_INPUTS), ("ensemble", ENSEMBLE_INPUTS)])
def test_field_tables_match_the_model_configs(model, inputs):
    import re

    from trtllm_vtoken.serving.triton import default_repository

    config = (default_repository() / model / "config.pbtxt").read_text()
    block = config[config.index("input ["):config.index("output [")]
    assert sorted(re.findall(r'name: "(\w+)"', block)) == sorted(inputs)
