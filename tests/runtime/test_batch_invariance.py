# SPDX-License-Identifier: Apache-2.0
"""A request's output does not depend on what runs beside it (prefix caching on, the default
``prefix_reuse="copy"``): for every policy, vtoken dense and lazy and naive-evict, the plain and
the overlap order, a request decides and decodes the same alone (after others, reusing their
cached prefix) and in a batch whose requests share a system prompt. Tiny random model, fp32."""

from __future__ import annotations

import pytest
import torch

from trtllm_vtoken.policies import POLICIES
from trtllm_vtoken.policies.request_settings import EvictionSettings
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM
from trtllm_vtoken.runtime.sampling import SamplingParams

TPB = 4
SYSTEM = [5, 9, 17, 3, 44, 2, 8, 91, 13, 7, 66, 21, 30, 4, 12, 99, 1, 71, 45, 6, 19, 23]
PARAMS = SamplingParams(max_tokens=14, ignore_eos=True)
VARIANTS = [("naive-evict", "dense"), ("vtoken", "dense"), ("vtoken", "lazy")]


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny()).eval()


def prompts(n: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [SYSTEM + torch.randint(0, 128, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def engine_for(model, **overrides) -> Engine:
    values = dict(policy="h2o", budget=14, tokens_per_block=TPB, num_blocks=96, max_batch_size=8,
                  max_seq_len=64, check_invariants=True)
    values.update(overrides)
    return Engine(model, EngineConfig(**values), record_trace=True)


def drain(engine: Engine, ids: list[int]) -> list:
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_integrity()
    return [engine.pop_finished(i) for i in ids]


def alone_then_together(model, batch, params, **config) -> tuple[list, list, Engine]:
    """Each request alone (one after another in one engine whose cache holds the system prompt,
    left by a request that evicts nothing: each reuses it), then all of them at once in a fresh
    engine (computed afresh), with the same request ids."""
    per = params if isinstance(params, list) else [params] * len(batch)
    engine = engine_for(model, **config)
    keep = SamplingParams(max_tokens=1, ignore_eos=True, eviction=EvictionSettings(policy="native"))
    drain(engine, [engine.add_request(SYSTEM + [0], keep, req_id=100)])
    alone = [drain(engine, [engine.add_request(p, q, req_id=i)])[0] for i, (p, q) in enumerate(zip(batch, per))]
    assert engine.stats.cached_prompt_tokens > 0, "the later requests reused the cached prefix"
    together_engine = engine_for(model, **config)
    together = drain(together_engine, [together_engine.add_request(p, q, req_id=i)
                                       for i, (p, q) in enumerate(zip(batch, per))])
    return alone, together, together_engine


@pytest.mark.parametrize("impl", ["cpp", "python"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
@pytest.mark.parametrize("policy", sorted(POLICIES.names()))
def test_a_request_decides_alike_alone_and_in_a_batch(model, policy, overlap, impl):
    """The C++ core's step and its Python specification alike."""
    opts = {"streaming_llm": {"n_sink": 2}}.get(policy, {})
    batch = prompts()
    reference = None
    for variant, mode in VARIANTS:
        alone, together, engine = alone_then_together(model, batch, PARAMS, variant=variant, mode=mode,
                                                      policy=policy, policy_options=opts, overlap_scheduler=overlap,
                                                      step_impl=impl)
        for a, b in zip(alone, together):
            assert a.evictions == b.evictions, f"{variant} {mode}: request {a.req_id} decided differently in a batch"
            assert a.output_ids == b.output_ids
        assert any(any(r.evictions) for r in together), "the budget evicts"
        assert not engine.kv.prefix.cache.shared, "no evicting request holds a block in common"
        if reference is None:
            reference = together
        for a, b in zip(reference, together):  # vtoken == naive-evict, decision for decision
            assert a.evictions == b.evictions and a.output_ids == b.output_ids
    off = engine_for(model, variant="vtoken", policy=policy, policy_options=opts, overlap_scheduler=overlap,
                     prefix_caching=False, step_impl=impl)
    for a, b in zip(reference, drain(off, [off.add_request(p, PARAMS, req_id=i) for i, p in enumerate(batch)])):
        assert a.evictions == b.evictions and a.output_ids == b.output_ids, "prefix caching on == off"


def test_a_mixed_batch_with_native_requests_stays_invariant(model):
    """Native requests (no eviction) still share cached blocks among themselves, never a block a
    running evicting request keyed: the evicting requests beside them decide as alone."""
    batch = prompts(6)
    settings = [None, EvictionSettings(policy="native"), EvictionSettings(policy="streaming_llm", n_sink=2),
                EvictionSettings(policy="native"), EvictionSettings(policy="random", budget=10), None]
    params = [SamplingParams(max_tokens=14, ignore_eos=True, eviction=s) for s in settings]
    for mode in ("dense", "lazy"):
        alone, together, _ = alone_then_together(model, batch, params, variant="vtoken", mode=mode)
        for a, b in zip(alone, together):
            assert a.evictions == b.evictions and a.output_ids == b.output_ids


def test_share_reuse_is_what_makes_outputs_depend_on_the_batch(model):
    """The rule the default replaces: with ``prefix_reuse="share"`` the system prompt's blocks are
    held in common and protected while shared, so the batch decides what a request may evict."""
    batch = prompts()
    alone, together, engine = alone_then_together(model, batch, PARAMS, variant="vtoken", prefix_reuse="share")
    assert engine.stats.cached_prompt_tokens > 0
    assert any(a.evictions != b.evictions for a, b in zip(alone, together))


def test_copy_reuse_copies_the_cached_prefix_and_prefills_the_rest(model):
    engine = engine_for(model, variant="vtoken")
    first = drain(engine, [engine.add_request(SYSTEM + [1, 2], PARAMS)])[0]
    hit = len(SYSTEM) // TPB * TPB
    # The first request evicted inside the system prompt: its chain was cut there, so a native
    # request leaves the prompt's blocks cached for the next one.
    keep = SamplingParams(max_tokens=2, ignore_eos=True, eviction=EvictionSettings(policy="native"))
    drain(engine, [engine.add_request(SYSTEM + [3], keep)])
    before = engine.stats.prefill_tokens
    req_id = engine.add_request(SYSTEM + [1, 2], PARAMS, req_id=first.req_id)
    engine.step()
    assert engine.stats.prefill_tokens - before == len(SYSTEM) + 2 - hit  # the copy was not prefilled
    blocks = engine.kv.step.block_ids(req_id)[: hit // TPB]
    assert not any(engine.kv.prefix.cache.is_cached(b) for b in blocks), "its prefix blocks are its own"
    again = drain(engine, [req_id])[0]
    assert again.output_ids == first.output_ids and again.evictions == first.evictions


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_h2o_with_a_prefill_window_decides_alike_alone_in_a_batch_and_without_caching(model, overlap):
    """H2O observing the prompt's last 6 queries only: a request reuses no cached block that
    reaches them (so they all run), and observes none of the cached prefix's own mass. vtoken
    dense and lazy equal naive-evict, alone (reusing the cached prefix) == together == caching
    off; and the window decides otherwise than the whole prompt does."""
    batch = prompts()
    opts = {"prefill_window": 6}
    reference = None
    for variant, mode in VARIANTS:
        alone, together, _ = alone_then_together(model, batch, PARAMS, variant=variant, mode=mode,
                                                 policy_options=opts, overlap_scheduler=overlap)
        for a, b in zip(alone, together):
            assert a.evictions == b.evictions and a.output_ids == b.output_ids, f"{variant} {mode}"
        reference = reference or together
        for a, b in zip(reference, together):
            assert a.evictions == b.evictions and a.output_ids == b.output_ids, f"{variant} {mode} == naive-evict"
    off = engine_for(model, variant="vtoken", policy_options=opts, overlap_scheduler=overlap, prefix_caching=False)
    for a, b in zip(reference, drain(off, [off.add_request(p, PARAMS, req_id=i) for i, p in enumerate(batch)])):
        assert a.evictions == b.evictions and a.output_ids == b.output_ids, "prefix caching on == off"
    whole = engine_for(model, variant="vtoken", overlap_scheduler=overlap, prefix_caching=False)
    unwindowed = drain(whole, [whole.add_request(p, PARAMS, req_id=i) for i, p in enumerate(batch)])
    assert any(a.evictions != b.evictions for a, b in zip(reference, unwindowed))


def test_a_prefill_window_leaves_its_queries_to_the_prefill(model):
    """The cached prefix a windowed request takes stops before its prompt's last 6 tokens."""
    engine = engine_for(model, variant="vtoken", policy_options={"prefill_window": 6})
    keep = SamplingParams(max_tokens=1, ignore_eos=True, eviction=EvictionSettings(policy="native"))
    drain(engine, [engine.add_request(SYSTEM + [0], keep)])
    prompt = SYSTEM + [1, 2]  # 24 tokens: 5 blocks cached, 4 of them end 6 tokens or more before its end
    before = engine.stats.prefill_tokens
    drain(engine, [engine.add_request(prompt, PARAMS)])
    assert engine.stats.prefill_tokens - before == len(prompt) - 4 * TPB
