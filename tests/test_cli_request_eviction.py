# SPDX-License-Identifier: Apache-2.0
"""``vtoken generate``'s per-request eviction flags: once for all prompts or once per prompt."""

from __future__ import annotations

import argparse

import pytest

from trtllm_vtoken.cli import main
from trtllm_vtoken.cli.engine_args import add_request_eviction_args, request_evictions
from trtllm_vtoken.policies import Budget
from trtllm_vtoken.policies.request_settings import EvictionSettings


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_request_eviction_args(parser)
    return parser.parse_args(list(argv))


def test_flags_pair_with_prompts_or_apply_to_all():
    args = parse("--request-policy", "random", "--request-policy", "streaming_llm", "--request-budget", "32",
                 "--request-sinks", "4")
    assert request_evictions(args, 2) == [EvictionSettings("random", Budget(tokens=32), 4),
                                          EvictionSettings("streaming_llm", Budget(tokens=32), 4)]
    args = parse("--request-policy", "native", "--request-policy", "streaming_llm")
    assert request_evictions(args, 2) == [EvictionSettings(policy="native"), EvictionSettings(policy="streaming_llm")]
    assert request_evictions(parse("--request-budget", "0.25"), 3) == [EvictionSettings(budget=0.25)] * 3
    assert request_evictions(parse(), 2) == [None, None]
    with pytest.raises(ValueError, match="'native' evicts nothing"):  # a budget given once applies to all
        request_evictions(parse("--request-policy", "native", "--request-policy", "h2o", "--request-budget", "8"), 2)
    args = parse("--request-policy", "native", "--request-policy", "streaming_llm", "--request-budget", "-",
                 "--request-budget", "32")  # '-': unset for that prompt
    assert request_evictions(args, 2) == [EvictionSettings(policy="native"),
                                          EvictionSettings("streaming_llm", Budget(tokens=32))]
    assert request_evictions(parse("--request-sinks", "-", "--request-sinks", "2"), 2) == \
        [EvictionSettings(), EvictionSettings(n_sink=2)]
    with pytest.raises(SystemExit):
        parse("--request-sinks", "x")
    with pytest.raises(ValueError, match="given 2 times for 3 prompts"):
        request_evictions(parse("--request-window", "8", "--request-window", "9"), 3)
    with pytest.raises(ValueError, match="--request-sinks given 2 times"):
        request_evictions(parse("--request-sinks", "1", "--request-sinks", "2"), 3)


def test_generate_refuses_a_bad_request_policy_in_one_line(capsys):
    assert main(["generate", "hi", "--request-policy", "lru", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "unknown eviction policy 'lru'" in err and len(err.strip().splitlines()) == 1
