# SPDX-License-Identifier: Apache-2.0
"""FP8 KV caches in the reference runtime (``EngineConfig.kv_cache_dtype="fp8"``): the pool holds
float8_e4m3fn codes and a scale per layer, attention reads them dequantized, relocation moves the
codes as bytes, and H2O's mass comes from the dequantized keys the attention used. vtoken (dense,
lazy) equals naive-evict decision for decision with FP8 KV on the tiny model for every policy; on
SmolLM2 until float order flips an FP8 rounding (see the test)."""

from __future__ import annotations

import pytest
import torch

from trtllm_vtoken.policies import POLICIES
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.kv_cache import PagedKVCache
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM
from trtllm_vtoken.runtime.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=14, ignore_eos=True)
VARIANTS = (("naive-evict", "dense"), ("vtoken", "dense"), ("vtoken", "lazy"))


def test_the_pool_stores_codes_with_a_scale_per_layer():
    cache = PagedKVCache(4, 2, num_layers=2, num_kv_heads=1, head_dim=3, max_seqs=1, max_blocks_per_seq=2, fp8=True)
    assert cache.pool.dtype == torch.float8_e4m3fn and cache.kv_scales.tolist() == [1.0, 1.0]
    assert cache.bytes_per_block * 4 == PagedKVCache(4, 2, 2, 1, 3, 1, 2).bytes_per_block
    cache.kv_scales[1] = 2.0
    k = torch.tensor([[[0.3, -700.0, 5.1]]])  # one token, one head: -700 saturates at -448 (x scale)
    for layer in (0, 1):
        cache.write(layer, torch.tensor([1]), k, -k)
    cache.set_batch([[0]], [2])
    for layer, scale in ((0, 1.0), (1, 2.0)):
        got_k, got_v = cache.gather(layer, 1)
        want = (k / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        assert torch.equal(got_k[0, :, 1], want[0]) and torch.equal(got_v[0, :, 1], -want[0])
        assert got_k.dtype == torch.float32
    assert torch.equal(cache.pool[0, 0, 0, :, 1].view(torch.uint8), k.to(torch.float8_e4m3fn)[0].view(torch.uint8))


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny()).eval()


def run(model, prompts, **overrides):
    values = dict(tokens_per_block=4, num_blocks=200, max_batch_size=4, max_seq_len=80, check_invariants=True)
    values.update(overrides)
    engine = Engine(model, EngineConfig(**values), record_trace=True)
    ids = [engine.add_request(p, PARAMS, req_id=i) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_integrity()
    return [engine.pop_finished(i) for i in ids], engine


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
@pytest.mark.parametrize("policy", sorted(POLICIES.names()))
def test_vtoken_equals_naive_evict_with_fp8_kv(model, policy, overlap):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (30, 9, 25, 40)]
    reference = None
    for variant, mode in VARIANTS:
        out, engine = run(model, prompts, variant=variant, mode=mode, policy=policy, budget=12, kv_cache_dtype="fp8",
                          overlap_scheduler=overlap, policy_options={"n_sink": 2} if policy == "streaming_llm" else {})
        reference = reference or out
        for a, b in zip(reference, out):
            assert a.evictions == b.evictions and a.output_ids == b.output_ids, f"{variant} {mode}: {a.req_id}"
    assert engine.kv.step_stats.compactions > 0  # vtoken lazy moved FP8 codes
    assert any(any(r.evictions) for r in reference)


def test_fp8_is_refused_with_shift_positions():
    with pytest.raises(ValueError, match="positions='keep'"):
        EngineConfig(kv_cache_dtype="fp8", positions="shift")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")


@pytest.mark.slow
def test_smollm2_vtoken_equals_naive_evict_with_fp8_kv(smollm2_model, smollm2_tokenizer):
    real = smollm2_model
    prompts = [smollm2_tokenizer.encode(p, chat=True) for p in (
        "Explain what a hash table is.", "Write a haiku about the sea.",
        "Give me three tips for writing readable Python code.", "Describe the water cycle to a ten-year-old.",
        "What is the difference between a list and a tuple?", "Name three uses of a binary search tree.")]
    runs = {}
    for variant, mode in VARIANTS:
        engine = Engine(real, EngineConfig(variant=variant, mode=mode, policy="h2o", budget=0.5, num_blocks=64,
                                           max_batch_size=6, kv_cache_dtype="fp8", check_invariants=True),
                        smollm2_tokenizer, record_trace=True)
        ids = [engine.add_request(p, SamplingParams(max_tokens=16)) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        runs[(variant, mode)] = [engine.pop_finished(i) for i in ids]
    for key in VARIANTS[1:]:
        pairs = list(zip(runs[VARIANTS[0]], runs[key]))
        # Keys sit in another physical order, so attention sums differ in the last bits (1e-5 in
        # the logits, as in float32); a new key or value whose FP8 rounding falls on the other
        # side of a code boundary then differs by a whole code, and the runs drift apart. Until
        # then they agree: decisions up to the first differing token; the prompt's logits alike.
        assert sum(a.evictions == b.evictions and a.output_ids == b.output_ids for a, b in pairs) >= len(pairs) // 2
        for a, b in pairs:
            agree = next((i for i, (x, y) in enumerate(zip(a.output_ids, b.output_ids)) if x != y), len(a.output_ids))
            assert a.evictions[:agree] == b.evictions[:agree], key
            torch.testing.assert_close(a.logits[0], b.logits[0], rtol=0, atol=1e-4)
    assert any(any(r.evictions) for r in runs[VARIANTS[0]])
