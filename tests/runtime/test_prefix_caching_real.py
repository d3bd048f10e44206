# SPDX-License-Identifier: Apache-2.0
"""Prefix caching on SmolLM2-135M-Instruct (fp32, greedy): a few prompts sharing a system prompt."""

from __future__ import annotations

import pytest

from trtllm_vtoken.policies.request_settings import EvictionSettings
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = ("You are a patient teacher of physics. You explain things with one everyday example and "
          "never use equations. Keep every answer short.\n\nQuestion: ")
QUESTIONS = ["Why is the sky blue?", "What makes a rainbow?", "Why does ice float on water?"]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model(smollm2_model):
    return smollm2_model


def generate(engine: Engine, prompts, together: bool, params: SamplingParams = PARAMS) -> list:
    if together:
        ids = [engine.add_request(p, params, req_id=i) for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
        return [engine.pop_finished(i) for i in ids]
    out = []
    for i, p in enumerate(prompts):
        req_id = engine.add_request(p, params, req_id=i)
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


CHAT = ["Write one sentence about cats.", "Write one sentence about the sea.", "Write one sentence about rain.",
        "Write one sentence about bread.", "Write one sentence about trains.", "Write one sentence about music."]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunks"])
def test_a_greedy_answer_is_the_same_alone_and_in_a_batch(model, smollm2_tokenizer, chunked):
    """H2O at 0.5 with prefix caching on (the defaults): two chat prompts sharing the chat
    template, one at a time (each reuses the template's cached blocks, as copies)
    and both at once, decide and decode alike; vtoken == naive-evict; caching on == off. Also
    with chunked prefill (chunks of 32 tokens: the prompts take two, the cached block of the
    template lies inside the first)."""
    prompts = [smollm2_tokenizer.encode(q, chat=True) for q in CHAT[:2]]
    assert not chunked or all(32 < len(p) <= 64 for p in prompts)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    for variant in ("naive-evict", "vtoken"):
        config = dict(variant=variant, policy="h2o", budget=0.5, num_blocks=64, tokens_per_block=16)
        if chunked:
            config.update(enable_chunked_prefill=True, max_num_tokens=32 + 8, max_batch_size=8)
        for together in (False, True):
            engine = Engine(model, EngineConfig(**config), record_trace=True)
            if not together:  # a request that evicts nothing leaves the template's blocks cached
                keep = SamplingParams(max_tokens=1, eviction=EvictionSettings(policy="native"))
                generate(engine, [smollm2_tokenizer.encode("Hello.", chat=True)], False, keep)
            got = generate(engine, prompts, together, params)
            assert engine.kv.stats.tokens_evicted > 0
            assert (engine.stats.cached_prompt_tokens > 0) == (not together)  # alone: copies of the template
            runs[variant, together] = got
        runs[variant, "off"] = generate(Engine(model, EngineConfig(prefix_caching=False, **config), record_trace=True),
                                        prompts, True, params)
    want = runs["vtoken", True]
    for key, got in runs.items():
        for a, b in zip(want, got):
            assert a.output_ids == b.output_ids, f"{key}: request {a.req_id} answered differently"
            assert a.evictions == b.evictions, f"{key}: request {a.req_id} decided differently"


def _common(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
