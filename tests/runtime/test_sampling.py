# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest
import torch

from trtllm_vtoken.runtime.sampling import SamplingParams, sample


def test_greedy_takes_the_argmax_and_top_k_1_is_greedy():
    logits = torch.tensor([0.1, 2.0, 2.0, -1.0])
    assert sample(logits, SamplingParams(), None) == 1  # ties: lowest id
    assert sample(logits, SamplingParams(temperature=5.0, top_k=1), torch.Generator()) == 1


def test_top_k_and_top_p_restrict_the_candidates():
    logits = torch.tensor([5.0, 4.0, 0.0, -2.0, -3.0])
    g = torch.Generator().manual_seed(0)
    drawn = {sample(logits, SamplingParams(temperature=1.0, top_k=2), g) for _ in range(200)}
    assert drawn == {0, 1}
    # p(0) = 0.72 < 0.8, so the nucleus is {0, 1}.
    drawn = {sample(logits, SamplingParams(temperature=1.0, top_p=0.8), g) for _ in range(200)}
    assert drawn == {0, 1}
    drawn = {sample(logits, SamplingParams(temperature=1.0, top_p=0.5), g) for _ in range(50)}
    assert drawn == {0}


@pytest.mark.parametrize("bad,match", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_p": -0.1}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"stop_token_ids": 7}, "sequence"), ({"stop": ("",)}, "must not be empty"),
    ({"logprobs": -1}, "logprobs"), ({"logprobs": 1.5}, "logprobs"),
])
def test_bad_parameters_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)
    with pytest.raises(ValueError, match="unknown SamplingParams key.*did you mean 'max_tokens'"):
        SamplingParams.from_dict({"max_new_tokens": 3})


def test_unspecified_temperature_top_p_top_k_is_greedy_as_in_tensorrt_llm():
    """TensorRT-LLM 1.2's rule (``SamplingParams.params_imply_greedy_decoding``): greedy when none of
    the three is given, or temperature 0, top_k 1 or top_p 0; a sampled request samples at 1."""
    assert SamplingParams().greedy and SamplingParams(temperature=0.0, top_k=5).greedy
    assert SamplingParams(top_p=0.0).greedy and SamplingParams(top_k=1, temperature=2.0).greedy
    assert not SamplingParams(top_k=2).greedy and not SamplingParams(temperature=0.5).greedy
    logits = torch.tensor([5.0, 4.0, 0.0, -2.0, -3.0])
    at_one = [sample(logits, SamplingParams(top_k=2), torch.Generator().manual_seed(s)) for s in range(40)]
    explicit = [sample(logits, SamplingParams(top_k=2, temperature=1.0), torch.Generator().manual_seed(s))
                for s in range(40)]
    assert at_one == explicit and set(at_one) == {0, 1}


def test_one_stop_string_is_accepted_as_tensorrt_llm_accepts_it():
    assert SamplingParams(stop="END").stop == ("END",) and SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_unknown_field_names_are_type_errors_with_the_nearest_name():
    with pytest.raises(TypeError, match=r"unknown field\(s\) \['max_token'\] \(did you mean 'max_tokens'\?\)"):
        SamplingParams(max_token=8)
    with pytest.raises(TypeError, match="did you mean 'temperature'"):
        SamplingParams(temprature=0.5)


def test_tensorrt_llm_fields_the_runtime_lacks_pass_at_their_defaults_only():
    assert SamplingParams(max_tokens=8, n=1, best_of=1, use_beam_search=False, detokenize=True, end_id=None) == \
        SamplingParams(max_tokens=8)
    with pytest.raises(ValueError, match=r"SamplingParams\(use_beam_search=True\): TensorRT-LLM's field is not "
                                         "implemented by the reference runtime; leave it at False"):
        SamplingParams(use_beam_search=True)
    with pytest.raises(ValueError, match=r"SamplingParams\(n=2\)"):
        SamplingParams(n=2)


def test_presence_and_frequency_penalties_push_repeated_tokens_down():
    logits = torch.tensor([3.0, 2.5, 0.0])
    assert sample(logits, SamplingParams(presence_penalty=1.0), None, generated=[0]) == 1
    assert sample(logits, SamplingParams(frequency_penalty=0.2), None, generated=[0, 0]) == 0  # 2.6 > 2.5
    assert sample(logits, SamplingParams(frequency_penalty=0.3), None, generated=[0, 0]) == 1  # 2.4 < 2.5
    assert logits.tolist() == [3.0, 2.5, 0.0]  # the caller's logits are not modified
    with pytest.raises(ValueError, match="presence_penalty must lie in"):
        SamplingParams(presence_penalty=3.0)
