# SPDX-License-Identifier: Apache-2.0
"""Random workloads through the engine with prefix caching (tiny model, fp32): requests share
system prompts, follow mixed per-request policies, evict, relocate and finish at random steps,
their prompts prefilled whole or in chunks.

- no relocation copy reads or writes a block that is shared or holds a key (checked at submit);
- every cached block's KV equals the KV a fresh prefill of its key's tokens writes;
- at the end the pool is full again (free plus cached-unheld), the cache consistent.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_vtoken.core.block_key import block_keys
from trtllm_vtoken.policies.request_settings import EvictionSettings
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM
from trtllm_vtoken.runtime.sampling import SamplingParams

TPB = 4
SYSTEM = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]]
SETTINGS = [None, EvictionSettings(policy="native"), EvictionSettings(policy="streaming_llm", n_sink=2),
            EvictionSettings(policy="random", budget=0.5), EvictionSettings(budget=7)]


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny()).eval()


def fresh_block_kv(model, tokens: list[int]) -> torch.Tensor:
    """KV [layers, 2, heads, tpb, dim] a fresh prefill of ``tokens`` writes into its last block."""
    engine = Engine(model, EngineConfig(variant="native", prefix_caching=False, tokens_per_block=TPB,
                                        num_blocks=16, max_seq_len=64, overlap_scheduler=False))  # joined at step()
    req_id = engine.add_request(tokens, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    block = engine.kv.layout.block_ids(req_id)[len(tokens) // TPB - 1]
    return engine.kv.cache.pool[block].clone()


OPS = st.lists(st.tuples(st.sampled_from(["arrive", "arrive", "step", "step", "step"]), st.integers(0, 10_000)),
               min_size=3, max_size=16)


@settings(max_examples=24, deadline=None)
@given(mode=st.sampled_from(["dense", "lazy"]), policy=st.sampled_from(["h2o", "sliding_window"]),
       reuse=st.sampled_from(["copy", "share"]), chunked=st.booleans(), ops=OPS)
def test_random_workloads_keep_cached_blocks_exact(model, mode, policy, reuse, chunked, ops):
    # Chunked prefill: chunks of 8 tokens (12 an iteration less 4 decode rows), so the prompts
    # (11 to 19 tokens) take 2 or 3.
    chunks = dict(enable_chunked_prefill=True, max_num_tokens=12) if chunked else {}
    engine = Engine(model, EngineConfig(policy=policy, budget=10, mode=mode, tokens_per_block=TPB, num_blocks=40,
                                        max_batch_size=4, max_seq_len=64, check_invariants=True, prefix_reuse=reuse,
                                        **chunks))
    cache, step, finish_step = engine.kv.prefix.cache, engine.kv.step, engine.kv.finish_step

    def checked_step():
        """Every move the step commits and every plan it leaves in flight (lazy ones whose copies
        run in the background) leaves shared and cached blocks alone, and so does every release."""
        out = finish_step()
        if out is not None:
            touched = out.touched_blocks(TPB) | step.relocating_blocks()
            assert not [b for b in touched if cache.is_shared(b) or cache.is_cached(b)], sorted(touched)
        return out

    engine.kv.finish_step = checked_step
    written: dict[int, list[int]] = {}
    for op, arg in ops:
        if op == "arrive":
            prompt = SYSTEM[arg % 2] + [20 + (arg // 3 + i) % 90 for i in range(1 + arg % 5)]
            params = SamplingParams(max_tokens=3 + arg % 9, ignore_eos=True, eviction=SETTINGS[arg % len(SETTINGS)])
            written[engine.add_request(prompt, params)] = prompt
        elif engine.has_unfinished():
            engine.step()
            engine.kv.check_integrity()
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_integrity()
    tokens_of_key = {}
    for req_id, prompt in written.items():
        request = engine.pop_finished(req_id)
        tokens = prompt + request.output_ids[:-1]  # the last sampled token is never written
        for i, key in enumerate(block_keys(tokens, TPB)):
            tokens_of_key.setdefault(key, tokens[: (i + 1) * TPB])
    assert engine.kv.num_available == engine.kv.pool.num_blocks
    for block, key in cache.key_of.items():
        torch.testing.assert_close(engine.kv.cache.pool[block], fresh_block_kv(model, tokens_of_key[key]),
                                   rtol=1e-5, atol=1e-5)
    cache.clear()
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
