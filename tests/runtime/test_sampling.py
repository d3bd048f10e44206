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
    ({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"stop": "x"}, "sequences"), ({"stop": ("",)}, "must not be empty"),
])
def test_bad_parameters_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)
    with pytest.raises(ValueError, match="unknown SamplingParams key"):
        SamplingParams.from_dict({"max_new_tokens": 3})


def test_presence_and_frequency_penalties_push_repeated_tokens_down():
    logits = torch.tensor([3.0, 2.5, 0.0])
    assert sample(logits, SamplingParams(presence_penalty=1.0), None, generated=[0]) == 1
    assert sample(logits, SamplingParams(frequency_penalty=0.2), None, generated=[0, 0]) == 0  # 2.6 > 2.5
    assert sample(logits, SamplingParams(frequency_penalty=0.3), None, generated=[0, 0]) == 1  # 2.4 < 2.5
    assert logits.tolist() == [3.0, 2.5, 0.0]  # the caller's logits are not modified
    with pytest.raises(ValueError, match="presence_penalty must lie in"):
        SamplingParams(presence_penalty=3.0)
