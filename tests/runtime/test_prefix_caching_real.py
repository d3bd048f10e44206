# SPDX-License-Identifier: Apache-2.0
"""Prefix caching on SmolLM2-135M-Instruct (fp32, greedy): a few prompts sharing a system prompt."""

from __future__ import annotations

import pytest

from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.model import load_llama
from trtllm_vtoken.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = ("You are a patient teacher of physics. You explain things with one everyday example and "
          "never use equations. Keep every answer short.\n\nQuestion: ")
QUESTIONS = ["Why is the sky blue?", "What makes a rainbow?", "Why does ice float on water?"]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(smollm2_folder):
    return load_llama(smollm2_folder)


def generate(engine: Engine, prompts, together: bool) -> list:
    if together:
        ids = [engine.add_request(p, PARAMS) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return [engine.pop_finished(i) for i in ids]
    out = []
    for p in prompts:
        [req_id] = [engine.add_request(p, PARAMS)]
        while engine.has_unfinished():
            engine.step()
        out.append(engine.pop_finished(req_id))
    return out


def test_native_outputs_equal_with_caching_and_the_shared_prompt_is_prefilled_once(model, smollm2_tokenizer):
    prompts = [smollm2_tokenizer.encode(SYSTEM + q, chat=True) for q in QUESTIONS]
    config = dict(variant="native", num_blocks=64, tokens_per_block=16)
    off = generate(Engine(model, EngineConfig(prefix_caching=False, **config)), prompts, together=True)
    on = Engine(model, EngineConfig(**config))
    assert [r.output_ids for r in generate(on, prompts[:1], together=False)] == [off[0].output_ids]
    # The next two arrive after the first finished: each prefills only what follows the cached
    # full blocks of the chat template's system turn plus the shared instructions.
    shared = min(len(_common(prompts[0], p)) for p in prompts[1:]) // 16 * 16
    got = generate(on, prompts[1:], together=True)
    assert [r.output_ids for r in got] == [r.output_ids for r in off[1:]]
    assert on.stats.cached_prompt_tokens == 2 * shared > 0
    assert on.stats.prefill_tokens == sum(len(p) for p in prompts) - 2 * shared


def test_vtoken_decides_and_generates_as_naive_evict_with_caching(model, smollm2_tokenizer):
    prompts = [smollm2_tokenizer.encode(SYSTEM + q, chat=True) for q in QUESTIONS]
    runs = {}
    for variant in ("naive-evict", "vtoken"):
        engine = Engine(model, EngineConfig(variant=variant, policy="h2o", budget=0.6, num_blocks=64,
                                            tokens_per_block=16), record_trace=True)
        runs[variant] = generate(engine, prompts, together=True)
        assert engine.stats.cached_prompt_tokens > 0 and engine.kv.stats.tokens_evicted > 0
    for a, b in zip(runs["naive-evict"], runs["vtoken"]):
        assert a.evictions == b.evictions and a.output_ids == b.output_ids


def _common(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
