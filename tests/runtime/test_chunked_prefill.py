# SPDX-License-Identifier: Apache-2.0
"""Chunked prefill in the reference engine (``EngineConfig.enable_chunked_prefill``): a prompt
longer than a chunk is prefilled one chunk an iteration beside the decode rows, each chunk taken in
by the step before the next, so the policy evicts between chunks. Native gives the tokens of a
whole prefill; every policy's vtoken (dense, lazy, lazy in the background) equals naive-evict
under the same chunks, in both orders; a prompt 8x the budget holds at most the budget plus one chunk (and a block); and a
pool too small for the prompt runs it. Tiny random model, fp32."""

from __future__ import annotations

import pytest
import torch

from trtllm_vtoken.policies import POLICIES
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM
from trtllm_vtoken.runtime.sampling import SamplingParams

TPB = 4
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
CHUNKED = dict(enable_chunked_prefill=True, max_num_tokens=20, prefix_caching=False)  # chunks of 16 tokens
OPTIONS = {"streaming_llm": {"n_sink": 2}, "h2o windowed": {"prefill_window": 6}}


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny()).eval()


def prompts(lengths=(70, 9, 45, 130, 33)) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def run(model, batch, **overrides):
    """Every prompt at once; returns the finished requests, the engine, and the most blocks the
    pool held at a forward (every reservation of the iteration made, no eviction yet)."""
    values = dict(tokens_per_block=TPB, num_blocks=200, max_batch_size=4, max_seq_len=160, check_invariants=True)
    values.update(overrides)
    engine = Engine(model, EngineConfig(**values), record_trace=True)
    peak = [0]
    forward = engine.forwards.run

    def counted(*args, **kwargs):
        peak[0] = max(peak[0], engine.kv.pool.num_blocks - engine.kv.pool.num_free)
        return forward(*args, **kwargs)

    engine.forwards.run = counted
    ids = [engine.add_request(p, PARAMS, req_id=i) for i, p in enumerate(batch)]
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_integrity()
    return [engine.pop_finished(i) for i in ids], engine, peak[0]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_native_chunks_give_the_tokens_of_a_whole_prefill(model, overlap):
    batch = prompts()
    whole, _, _ = run(model, batch, variant="native", overlap_scheduler=overlap, prefix_caching=False)
    chunked, engine, _ = run(model, batch, variant="native", overlap_scheduler=overlap, **CHUNKED)
    assert [r.output_ids for r in chunked] == [r.output_ids for r in whole]
    assert engine.config.prefill_chunk_tokens == 16 and engine.stats.prefill_tokens == sum(map(len, batch))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
@pytest.mark.parametrize("policy", sorted(POLICIES.names()) + ["h2o windowed"])
def test_vtoken_equals_naive_evict_chunk_for_chunk(model, policy, overlap):
    batch, reference = prompts(), None
    for variant, mode, background in (("naive-evict", "dense", False), ("vtoken", "dense", False),
                                      ("vtoken", "lazy", False), ("vtoken", "lazy", True)):
        out, _, _ = run(model, batch, variant=variant, mode=mode, policy=policy.split()[0], budget=16,
                        policy_options=OPTIONS.get(policy, {}), overlap_scheduler=overlap, lazy_background=background,
                        **CHUNKED)
        reference = reference or out
        for a, b in zip(reference, out):
            assert a.evictions == b.evictions and a.output_ids == b.output_ids, f"{variant} {mode}: {a.req_id}"
    assert any(any(r.evictions[:3]) for r in reference), "the policy evicted between chunks"


@pytest.mark.parametrize("policy", ["h2o", "streaming_llm"])
def test_a_prompt_eight_times_the_budget_holds_the_budget_and_a_chunk(model, policy):
    """A 128-token prompt through a 16-token budget, chunks of 16: at most ceil((16 + 16) / 4) + 1
    blocks at any forward; native holds the whole prompt. With 14 usable blocks native cannot
    take the request at all, vtoken runs it."""
    batch = prompts((128,))
    options = OPTIONS.get(policy, {})
    _, _, native_peak = run(model, batch, variant="native", **CHUNKED)
    for mode in ("dense", "lazy"):
        out, _, peak = run(model, batch, variant="vtoken", mode=mode, policy=policy, budget=16,
                           policy_options=options, lazy_background=False, **CHUNKED)
        assert peak <= -(-(16 + 16) // TPB) + 1 < 128 // TPB <= native_peak
    small = dict(num_blocks=14, evacuation_headroom=1, **CHUNKED)
    with pytest.raises(ValueError, match="more KV blocks"):
        run(model, batch, variant="native", **small)
    with pytest.raises(ValueError, match="more KV blocks"):  # the whole prompt, before its first eviction
        run(model, batch, variant="vtoken", policy=policy, budget=16, policy_options=options,
            **{**small, "enable_chunked_prefill": False, "max_num_tokens": None})
    small_run, _, _ = run(model, batch, variant="vtoken", policy=policy, budget=16, policy_options=options, **small)
    assert small_run[0].output_ids == out[0].output_ids and small_run[0].evictions == out[0].evictions


def test_the_iterations_tokens_bound_its_prefills(model):
    """Without chunking a prompt over max_num_tokens is refused; prompts that fit run one per
    iteration when two do not fit together."""
    engine = Engine(model, EngineConfig(tokens_per_block=TPB, num_blocks=64, max_num_tokens=20, prefix_caching=False))
    with pytest.raises(ValueError, match="exceeds max_num_tokens 20"):
        engine.add_request(prompts((21,))[0], PARAMS)
    for p in prompts((12, 12)):
        engine.add_request(p, PARAMS)
    engine.step()
    assert engine.stats.prefill_tokens == 12
    engine.step()
    assert engine.stats.prefill_tokens == 24


@pytest.mark.parametrize("overlap", [False, True])
def test_two_prompts_in_chunks_do_not_take_turns_preempting_each_other(model, overlap):
    """Greedy admission: where a chunk finds no room, the newest prompt gives way, not the chunk's
    own older one (which went back to the queue, was admitted again at once and took the room the
    other's chunk needed: the two swapped every iteration and neither finished)."""
    engine = Engine(model, EngineConfig(policy="streaming_llm", budget=7, tokens_per_block=1, num_blocks=11,
                                        admission="greedy", prefix_caching=False, enable_chunked_prefill=True,
                                        max_num_tokens=11, max_batch_size=8, overlap_scheduler=overlap,
                                        check_invariants=True, max_seq_len=128))
    ids = [engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
           for p in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 4, 3, 2, 1])]
    for _ in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    assert [len(engine.pop_finished(i).output_ids) for i in ids] == [4, 4]


def test_chunked_prefill_settings_are_checked():
    with pytest.raises(ValueError, match="needs max_num_tokens"):
        EngineConfig(enable_chunked_prefill=True, prefix_caching=False)
    with pytest.raises(ValueError, match="leave a block"):
        EngineConfig(enable_chunked_prefill=True, max_num_tokens=40, max_batch_size=32, prefix_caching=False)
    with pytest.raises(ValueError, match="at_once"):
        EngineConfig(enable_chunked_prefill=True, max_num_tokens=256, prefix_caching=False, prefill_decision="lagged")
    with pytest.raises(ValueError, match="only the overlap scheduler runs"):  # it would do nothing
        EngineConfig(prefill_decision="lagged", overlap_scheduler=False)
    assert EngineConfig(enable_chunked_prefill=True, max_num_tokens=256, mode="lazy").lazy_background
    assert EngineConfig(enable_chunked_prefill=True, max_num_tokens=300, max_batch_size=32, tokens_per_block=32,
                        prefix_caching=False).prefill_chunk_tokens == 256


@pytest.mark.slow
def test_smollm2_a_long_document_through_a_small_budget(smollm2_model, smollm2_tokenizer):
    """SmolLM2, a 512-token document through a 64-token H2O budget in chunks of 64 (8x the budget):
    native's chunked prefill gives the greedy tokens of a whole one; vtoken equals naive-evict
    decision for decision and holds at most ceil((64 + 64) / 16) + 1 blocks, native the prompt."""
    from trtllm_vtoken.bench.long import documents
    real = smollm2_model
    prompt = documents(smollm2_tokenizer, 1, 512)[0]
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def serve(**overrides):
        values = dict(tokens_per_block=16, num_blocks=40, max_batch_size=1, max_seq_len=600, prefix_caching=False)
        engine = Engine(real, EngineConfig(**{**values, **overrides}), record_trace=True)
        req_id = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        return engine.pop_finished(req_id), engine.kv.stats.peak_blocks_used

    chunks = dict(enable_chunked_prefill=True, max_num_tokens=65)
    whole, _ = serve(variant="native")
    chunked, native_peak = serve(variant="native", **chunks)
    assert chunked.output_ids == whole.output_ids and native_peak >= 512 // 16
    naive, _ = serve(variant="naive-evict", policy="h2o", budget=64, **chunks)
    vtoken, peak = serve(variant="vtoken", policy="h2o", budget=64, check_invariants=True, **chunks)
    assert vtoken.evictions == naive.evictions and vtoken.output_ids == naive.output_ids
    assert any(vtoken.evictions[:7]) and peak <= -(-(64 + 64) // 16) + 1
