# SPDX-License-Identifier: Apache-2.0
"""Position-shift mode on the real model (SmolLM2-135M-Instruct, fp32): for every policy and
both compaction modes (every policy's request in one batch), 24 greedy tokens equal keep mode's
and every step's logits agree within 1e-4. All policies keep 4 attention sinks: without them, random and sliding-window eviction leave
this model so ill-conditioned that reordering the same keys in keep mode alone moves its logits by
up to 9.6e-4 (benchmarks/shift/shift_exactness.json; benchmarks/RESULTS.md, position shift)."""

from __future__ import annotations

import pytest

from trtllm_vtoken.policies import POLICIES
from trtllm_vtoken.policies.request_settings import EvictionSettings
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "Explain what a hash table is."
TOKENS = 24


@pytest.fixture(scope="module")
def model(smollm2_model):
    return smollm2_model


@pytest.fixture(scope="module")
def prompt_ids(smollm2_tokenizer):
    return smollm2_tokenizer.encode(PROMPT, chat=True)


def decode(model, prompt_ids, mode: str, positions: str = "keep"):
    """Every policy at once, one request each (its own eviction settings), in one batch."""
    cfg = EngineConfig(budget=24, tokens_per_block=4, num_blocks=256, max_batch_size=len(POLICIES.names()),
                       max_seq_len=160, mode=mode, positions=positions, prefix_caching=False)
    engine = Engine(model, cfg, record_trace=True)
    reqs = {policy: engine.add_request(prompt_ids, SamplingParams(
        max_tokens=TOKENS, ignore_eos=True, eviction=EvictionSettings(policy=policy, budget=24, n_sink=4)))
        for policy in sorted(POLICIES.names())}
    while engine.has_unfinished():
        engine.step()
    return engine, {policy: engine.pop_finished(req) for policy, req in reqs.items()}


@pytest.mark.parametrize("mode", ["dense", "lazy"])
def test_shift_equals_keep_on_the_real_model(model, prompt_ids, mode):
    """Each policy's request under shift positions against the same request under keep (the
    same batch of every policy in both runs)."""
    _, keep = decode(model, prompt_ids, mode)
    engine, shift = decode(model, prompt_ids, mode, positions="shift")
    assert len(prompt_ids) > 24 and engine.kv.rerotation.stats.passes >= (10 if mode == "lazy" else TOKENS - 1)
    for policy in sorted(POLICIES.names()):
        assert shift[policy].output_ids == keep[policy].output_ids, policy
        assert shift[policy].evictions == keep[policy].evictions and keep[policy].evictions, policy
        worst = max(float((a - b).abs().max()) for a, b in zip(keep[policy].logits, shift[policy].logits))
        print(f"\n{policy}/{mode}: max |logit difference| over {TOKENS} tokens {worst:.2e}")
        assert worst <= 1e-4, policy
