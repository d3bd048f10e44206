# SPDX-License-Identifier: Apache-2.0
"""``LLM.stream()`` left early: the request leaves the engine with its blocks, whether the caller
closes the generator or just drops it."""

from __future__ import annotations

import gc

import pytest

from trtllm_vtoken.runtime.llm import LLM
from trtllm_vtoken.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "Describe the water cycle to a ten-year-old."
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def llm(smollm2_folder):
    return LLM(smollm2_folder, variant="vtoken", policy="streaming_llm", budget=64, num_blocks=NUM_BLOCKS)


def assert_engine_empty(llm: LLM) -> None:
    engine = llm.engine
    assert engine.requests == {} and not engine.has_unfinished()
    assert engine.kv.num_available == NUM_BLOCKS  # free, or cached and held by none


def test_closing_a_stream_cancels_its_request_and_frees_its_blocks(llm):
    stream = llm.stream(PROMPT, SamplingParams(max_tokens=200))
    next(stream)
    assert len(llm.engine.requests) == 1 and llm.engine.kv.num_available < NUM_BLOCKS
    stream.close()
    assert_engine_empty(llm)


def test_breaking_out_of_the_loop_cancels_the_request(llm):
    for _ in llm.stream(PROMPT, SamplingParams(max_tokens=200)):
        break
    gc.collect()  # CPython closes the dropped generator at once; other interpreters on collection
    assert_engine_empty(llm)
    # The engine serves the next caller as if nothing happened.
    whole = llm.generate(PROMPT, SamplingParams(max_tokens=6)).outputs[0]
    streamed = llm.stream(PROMPT, SamplingParams(max_tokens=6))
    assert "".join(s.outputs[0].text_diff for s in streamed) == whole.text
    assert_engine_empty(llm)
