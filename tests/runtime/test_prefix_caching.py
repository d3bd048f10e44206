# SPDX-License-Identifier: Apache-2.0
"""Prefix caching in the engine (tiny random model, fp32): what is reused and counted, and that it
changes no output and no decision it should not change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trtllm_vtoken.core import BlockPool
from trtllm_vtoken.policies import POLICIES
from trtllm_vtoken.policies.request_settings import EvictionSettings
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM
from trtllm_vtoken.runtime.prefix_caching import PrefixCaching
from trtllm_vtoken.runtime.sampling import SamplingParams

TPB = 4
SYSTEM = [[5, 9, 17, 3, 44, 2, 8, 91, 13, 7, 66, 21, 30, 4, 12, 99, 1, 71, 45, 6, 19, 23],
          [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]]
LONG = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny()).eval()


def config(**overrides) -> EngineConfig:
    values = dict(policy="h2o", budget=20, tokens_per_block=TPB, num_blocks=96, max_batch_size=8,
                  max_seq_len=64, check_invariants=True)
    values.update(overrides)
    return EngineConfig(**values)


def shared_prompts(n: int = 6, seed: int = 3) -> list[list[int]]:
    """System prompts shared by several requests, each with a private suffix."""
    g = torch.Generator().manual_seed(seed)
    return [SYSTEM[i % 2] + torch.randint(0, 128, (int(torch.randint(1, 9, (1,), generator=g)),),
                                          generator=g).tolist() for i in range(n)]


def run(engine: Engine, batch, params, each_step=None, req_ids=None) -> list:
    per_prompt = params if isinstance(params, list) else [params] * len(batch)
    ids = [engine.add_request(p, q, req_id=r) for p, q, r in zip(batch, per_prompt, req_ids or [None] * len(batch))]
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_integrity()
        if each_step:
            each_step(engine)
    assert engine.kv.num_available == engine.kv.pool.num_blocks, "blocks left after all finished"
    return [engine.pop_finished(i) for i in ids]


def test_second_request_prefills_only_its_private_part(model):
    engine = Engine(model, config(variant="native"))
    first, second = SYSTEM[0] + [7, 8, 9], SYSTEM[0] + [100, 101, 102, 103, 104]
    run(engine, [first], LONG)
    assert engine.stats.cached_prompt_tokens == 0 and engine.stats.prefill_tokens == len(first)
    run(engine, [second], LONG)
    cached = len(SYSTEM[0]) // TPB * TPB  # the system prompt's full blocks: 20 of its 22 tokens
    assert engine.stats.cached_prompt_tokens == cached
    assert engine.stats.prefill_tokens == len(first) + len(second) - cached
    stats = engine.kv.prefix.cache.stats
    assert stats.hit_tokens == cached and stats.query_tokens == len(first) + len(second)


@pytest.mark.parametrize("variant", ["native", "vtoken"])
def test_a_next_turn_reuses_the_previous_answer(model, variant):
    """Decode-filled blocks are keyed too (the native variant's block lists as the step's tables):
    a next turn whose prompt is the previous prompt and answer reuses every full block of what
    was written (the last sampled token never is), the block the finishing step filled too (40
    tokens), and answers as without caching."""
    params = SamplingParams(max_tokens=16, ignore_eos=True,
                            eviction=None if variant == "native" else EvictionSettings(policy="native"))
    engine = Engine(model, config(variant=variant))
    first = run(engine, [SYSTEM[0] + [7, 8, 9]], params)[0]
    written = SYSTEM[0] + [7, 8, 9] + first.output_ids[:-1]
    turn = SYSTEM[0] + [7, 8, 9] + first.output_ids + [60, 61]
    second = run(engine, [turn], params)[0]
    assert engine.stats.cached_prompt_tokens == len(written) // TPB * TPB > len(SYSTEM[0]) + 3
    off = Engine(model, config(variant=variant, prefix_caching=False))
    assert run(off, [turn], params)[0].output_ids == second.output_ids


def test_share_reuse_with_a_prefill_window_evicts_before_a_block_another_request_shares(model):
    """Found by fuzzing (``prefix_reuse="share"``, H2O observing the prompt's last 6 queries):
    request 2 computes its 5th block again (a copy of request 1's) and keys its 6th, which
    request 3 then shares; request 2 evicting in its own 5th block dropped keys up to a shared
    block and the step raised. Now that block loses its key and both keep it."""
    prompt = [3, 1, 2, 3, 2, 2, 1, 1, 1, 0, 0, 1, 1, 2, 0, 2, 3, 2, 3, 3, 0, 3, 0, 1, 1, 1, 1, 1, 1, 1]
    engine = Engine(model, config(variant="vtoken", policy_options={"prefill_window": 6}, budget=0.3,
                                  prefix_reuse="share", overlap_scheduler=False))
    finished = run(engine, [prompt[:20], prompt[:24], prompt[:30]], SamplingParams(max_tokens=1, ignore_eos=True))
    assert engine.kv.stats.tokens_evicted > 0 and all(len(r.output_ids) == 1 for r in finished)


def test_requests_admitted_together_share_the_prompt_blocks(model):
    engine = Engine(model, config(variant="native"))
    seen = []
    run(engine, [SYSTEM[1] + [1], SYSTEM[1] + [2], SYSTEM[1] + [3]], LONG,
        lambda e: seen.append(len(e.kv.prefix.cache.shared)))
    assert engine.stats.cached_prompt_tokens == 2 * 12 and seen[0] == 3  # 3 blocks held by all three


@pytest.mark.parametrize("variant", ["native", "naive-evict", "vtoken"])
def test_caching_changes_no_output_of_native_and_no_decision_alone(model, variant):
    """Native: caching on equals off, token for token. With eviction, a request running alone
    sees no shared block, so caching must not change its decisions either."""
    batch = shared_prompts()
    off = run(Engine(model, config(variant=variant, prefix_caching=False), record_trace=True), batch, LONG)
    on_engine = Engine(model, config(variant=variant), record_trace=True)
    on = [run(on_engine, [p], LONG)[0] for p in batch]  # one after another: reuse, never sharing
    assert on_engine.stats.cached_prompt_tokens > 0
    for a, b in zip(off, on):
        assert a.output_ids == b.output_ids and a.evictions == b.evictions
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["python", "cpp"])
@pytest.mark.parametrize("policy", sorted(POLICIES.names()))
def test_vtoken_matches_naive_evict_with_caching(model, policy, impl):
    """``prefix_reuse="share"``: sharing protects the same tokens for both, and a request's cut
    drops the same keys: the same decisions, the same outputs; shared blocks hold only live
    tokens all along. (The default, "copy": tests/runtime/test_batch_invariance.py.)"""
    def shared_all_live(engine):
        cache, step = engine.kv.prefix.cache, engine.kv.step
        for req_id in engine.running:
            counts = (step.batch_tokens([req_id])[0].reshape(-1, TPB) >= 0).sum(axis=1)
            for i, block_id in enumerate(step.block_ids(req_id)):
                if block_id in cache.shared:
                    assert counts[i] == TPB, f"a token of shared block {block_id} died"

    opts = {"streaming_llm": {"n_sink": 2}}.get(policy, {})
    share = dict(policy=policy, policy_options=opts, step_impl=impl, prefix_reuse="share")
    naive = run(Engine(model, config(variant="naive-evict", **share), record_trace=True), shared_prompts(), LONG,
                shared_all_live)
    for mode in ("dense", "lazy"):
        engine = Engine(model, config(variant="vtoken", mode=mode, **share), record_trace=True)
        got = run(engine, shared_prompts(), LONG, shared_all_live)
        for a, b in zip(naive, got):
            assert a.evictions == b.evictions, f"{mode}: request {a.req_id} evicted differently"
            assert a.output_ids == b.output_ids
        assert engine.kv.prefix.cache.stats.hit_tokens > 0
        # dense relocates after every eviction; lazy only once a block can be freed (may not come here)
        assert mode == "lazy" or engine.kv.step_stats.moves > 0


def test_h2o_sees_the_cached_prefix_attention_of_a_fresh_prefill(model):
    """The rule: a reused prefix brings the attention its own queries paid (kept with its
    blocks), so H2O's scores over it are those of a fresh prefill and its decisions match."""
    prompt = SYSTEM[0] + [60, 61, 62, 63, 64, 65]
    alone = Engine(model, config(variant="vtoken", prefix_caching=False), record_trace=True)
    want = run(alone, [prompt], LONG)[0]
    engine = Engine(model, config(variant="vtoken"), record_trace=True)
    keep = SamplingParams(max_tokens=4, ignore_eos=True, eviction=EvictionSettings(policy="native"))
    run(engine, [SYSTEM[0] + [1, 2]], keep)  # leaves the system prompt's blocks cached, untouched
    req_id = engine.add_request(prompt, LONG)
    engine.step()  # its prefill: 20 tokens reused
    assert engine.stats.cached_prompt_tokens == 20
    ids, mass = engine.kv.step.token_stats(req_id, "mass")  # H2O's accumulated mass, per live token
    alone2 = Engine(model, config(variant="vtoken", prefix_caching=False))
    other = alone2.add_request(prompt, LONG)
    alone2.step()
    fresh_ids, fresh_mass = alone2.kv.step.token_stats(other, "mass")
    assert ids.tolist() == fresh_ids.tolist()
    torch.testing.assert_close(torch.from_numpy(mass), torch.from_numpy(fresh_mass), rtol=1e-4, atol=1e-5)
    while engine.has_unfinished():
        engine.step()
    got = engine.pop_finished(req_id)
    assert got.evictions == want.evictions and got.output_ids == want.output_ids


def test_mixed_policy_batch_evicts_for_each_request_as_alone(model):
    settings = [EvictionSettings(policy="h2o", budget=10), EvictionSettings(policy="streaming_llm", n_sink=2),
                EvictionSettings(policy="sliding_window", budget=0.5), EvictionSettings(policy="random", budget=9),
                EvictionSettings(policy="native"), None]
    batch = shared_prompts(len(settings), seed=5)
    params = [SamplingParams(max_tokens=16, ignore_eos=True, eviction=s) for s in settings]
    for mode in ("dense", "lazy"):
        together = run(Engine(model, config(variant="vtoken", mode=mode, prefix_caching=False), record_trace=True),
                       batch, params)
        for prompt, param, got in zip(batch, params, together):
            # The same request id: Random seeds its draws per request (rank- and batch-independent).
            alone = run(Engine(model, config(variant="vtoken", mode=mode, prefix_caching=False), record_trace=True),
                        [prompt], param, req_ids=[got.req_id])[0]
            assert got.evictions == alone.evictions, f"{mode}: {param.eviction} evicted differently in the batch"
            assert got.output_ids == alone.output_ids
    # 16 tokens: the steps of the first 14 are traced; the 15th's runs beside the forward of the
    # 16th (the overlap scheduler), in the iteration the request finishes, and is not.
    assert together[4].evictions == [()] * 14 and any(together[0].evictions)


def test_request_settings_errors_are_value_errors(model):
    engine = Engine(model, config())
    with pytest.raises(ValueError, match="unknown eviction policy 'h2oo'"):
        engine.add_request([1, 2, 3], SamplingParams(eviction={"policy": "h2oo"}))
    with pytest.raises(ValueError, match="unknown eviction setting"):
        engine.add_request([1, 2, 3], SamplingParams(eviction={"budgte": 3}))
    native = Engine(model, config(variant="native"))
    with pytest.raises(ValueError, match="variant 'native'"):
        native.add_request([1, 2, 3], SamplingParams(eviction=EvictionSettings(budget=8)))
    assert not engine.requests and not native.requests


def drain(engine: Engine, prompt: list[int], params: SamplingParams, req_id: int):
    engine.add_request(prompt, params, req_id=req_id)
    while engine.has_unfinished():
        engine.step()
    return engine.pop_finished(req_id)


@pytest.fixture(scope="module")
def sharp_model(sharp_tiny_model) -> LlamaForCausalLM:
    return sharp_tiny_model


@pytest.mark.parametrize("case", ["count_based_engine", "multi_turn"])
def test_h2o_takes_no_cached_block_stored_without_its_prefix_mass(sharp_model, case):
    """Blocks stored while no policy observed attention, and blocks a decode filled, carry no
    prefix mass: an H2O request reusing them would score that prefix from its own queries alone
    and evict unlike a prefill of its prompt. It takes none of them (it prefills those tokens):
    the same decisions and tokens as with caching off. ``count_based_engine``: the engine's
    policy observes nothing, the H2O request brings its own settings; ``multi_turn``: the engine's
    H2O, the first turn native, the second turn's prompt the first's prompt, answer and more."""
    native = SamplingParams(max_tokens=12, ignore_eos=True, eviction=EvictionSettings(policy="native"))
    prefix = [(7 * i + 3) % 128 for i in range(16 if case == "multi_turn" else 24)]
    if case == "multi_turn":
        settings, params = dict(policy="h2o", budget=0.5), SamplingParams(max_tokens=12, ignore_eos=True)
    else:
        settings = dict(policy="sliding_window", budget=0.5)
        params = SamplingParams(max_tokens=12, ignore_eos=True, eviction=EvictionSettings(policy="h2o", budget=0.5))
    engine = Engine(sharp_model, config(variant="vtoken", **settings), record_trace=True)
    first = drain(engine, prefix if case == "multi_turn" else prefix + [1, 2, 3], native, 0)
    prompt = prefix + first.output_ids + [5, 6, 7] if case == "multi_turn" else prefix + [40, 50, 60, 70]
    got = drain(engine, prompt, params, 1)
    want = drain(Engine(sharp_model, config(variant="vtoken", prefix_caching=False, **settings), record_trace=True),
                 prompt, params, 1)
    assert got.evictions == want.evictions and got.output_ids == want.output_ids
    # the first turn's prompt blocks carry the mass (the engine's H2O observed it), its answer's not
    assert engine.stats.cached_prompt_tokens == (16 if case == "multi_turn" else 0)


def test_a_shared_prefix_the_pool_cannot_hold_on_top_of_the_budget_is_prefilled_instead(model):
    """``prefix_reuse="share"``: a shared prefix is held on top of the request's budget; where the
    pool cannot hold that, the request prefills its whole prompt (admitted, not waiting for ever)."""
    engine = Engine(model, config(variant="vtoken", budget=0.6, tokens_per_block=1, num_blocks=24,
                                  overlap_scheduler=False, prefix_reuse="share"))
    system = [(7 * i + 3) % 128 for i in range(19)]
    drain(engine, system, SamplingParams(max_tokens=1, ignore_eos=True, eviction=EvictionSettings(policy="native")), 0)
    engine.add_request(system + [81, 68, 113], SamplingParams(
        max_tokens=6, ignore_eos=True, eviction=EvictionSettings(policy="scissorhands", budget=0.6)), req_id=1)
    engine.step()
    assert engine.requests[1].status.name == "RUNNING" and engine.stats.cached_prompt_tokens == 0
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop_finished(1).output_ids) == 6


def test_a_prefix_whose_copy_the_pool_cannot_hold_is_prefilled_instead(model):
    """A request that may evict copies its cached prefix into blocks of its own, keeping the
    cached sources meanwhile; where the pool cannot hold both, it prefills its whole prompt
    (admitted at once, not waiting for ever), with the tokens of a run without caching."""
    engine = Engine(model, config(variant="vtoken", policy="streaming_llm", budget=8, num_blocks=10,
                                  overlap_scheduler=False), record_trace=True)
    prompt = list(range(1, 33))
    drain(engine, prompt[:24] + [99], SamplingParams(max_tokens=1, ignore_eos=True,
                                                     eviction=EvictionSettings(policy="native")), 0)
    assert engine.kv.prefix.cache.num_reclaimable == 6  # the shared 24 tokens stay cached
    engine.add_request(prompt + [7], SamplingParams(max_tokens=4, ignore_eos=True), req_id=1)
    engine.step()
    assert engine.requests[1].status.name == "RUNNING" and engine.stats.cached_prompt_tokens == 0
    while engine.has_unfinished():
        engine.step()
    want = drain(Engine(model, config(variant="vtoken", policy="streaming_llm", budget=8, num_blocks=10,
                                      overlap_scheduler=False, prefix_caching=False), record_trace=True),
                 prompt + [7], SamplingParams(max_tokens=4, ignore_eos=True), 1)
    got = engine.pop_finished(1)
    assert got.output_ids == want.output_ids and got.evictions == want.evictions


UNPAID_ENGINE = dict(policy="sliding_window", budget=0.5)
H2O_HALF = SamplingParams(max_tokens=8, ignore_eos=True, eviction=EvictionSettings(policy="h2o", budget=0.5))


def unpaid_system_prompt(model) -> tuple[Engine, list[int]]:
    """An engine whose policy observes nothing, after a native request cached a 32-token system
    prompt there without its attention mass."""
    system = [(5 * i + 2) % 128 for i in range(32)]
    engine = Engine(model, config(variant="vtoken", **UNPAID_ENGINE), record_trace=True)
    drain(engine, system + [1], SamplingParams(max_tokens=2, ignore_eos=True,
                                               eviction=EvictionSettings(policy="native")), 0)
    return engine, system


def test_an_h2o_prefill_gives_blocks_cached_without_the_mass_their_mass(sharp_model):
    """Blocks cached without the prefix's mass (a native request computed the system prompt while
    no policy observed attention) are not taken by H2O, but the first H2O request's prefill of
    those tokens attaches the mass to them: the next H2O request takes them, deciding as with
    caching off."""
    engine, system = unpaid_system_prompt(sharp_model)
    cached = []
    for req_id, suffix in ((1, [40, 41, 42]), (2, [50, 51, 52, 53])):
        got = drain(engine, system + suffix, H2O_HALF, req_id)
        cached.append(engine.stats.cached_prompt_tokens)
        want = drain(Engine(sharp_model, config(variant="vtoken", prefix_caching=False, **UNPAID_ENGINE),
                            record_trace=True), system + suffix, H2O_HALF, req_id)
        assert got.evictions == want.evictions and got.output_ids == want.output_ids
    assert cached == [0, 32]


def test_a_copy_admitted_beside_the_prefill_giving_its_blocks_the_mass_waits_for_it(sharp_model):
    """Two H2O requests admitted in one iteration over a system prompt cached without its mass:
    the first's prefill gives those blocks the mass, but only when it runs; the second, a copy
    taken at admission, must not take them before (it would keep no mass for its prefix). Both
    decide as with caching off."""
    engine, system = unpaid_system_prompt(sharp_model)
    prompts = {1: system + [40, 41, 42], 2: system + [50, 51, 52, 53]}
    together = run(engine, list(prompts.values()), [H2O_HALF, H2O_HALF], req_ids=list(prompts))
    for (req_id, prompt), got in zip(prompts.items(), together):
        want = drain(Engine(sharp_model, config(variant="vtoken", prefix_caching=False, **UNPAID_ENGINE),
                            record_trace=True), prompt, H2O_HALF, req_id)
        assert got.evictions == want.evictions and got.output_ids == want.output_ids, req_id


def test_a_sharing_request_keeps_its_prefix_mass_when_a_cut_drops_the_key_it_took():
    """Found in review: R computed block a's tokens again (a private copy x, H2O's prefill window)
    and keyed y after it; H took a and y as its cached prefix. R cutting its chain at x drops y's
    key and payload (y stays shared) before H's prefill reads the payload: under the overlap
    scheduler the previous iteration's step runs between admissions and prefill forwards. H keeps
    the payload it took, and observes what a fresh prefill gives."""
    caching = PrefixCaching(BlockPool(16, TPB))
    cache, tokens = caching.cache, list(range(1, 13))
    caching.begin(0, tokens[:5])
    a = cache.allocate(2)
    caching.store_prompt(0, a, tokens[:5])
    cache.attach(a[0], np.ones(4, np.float32))
    caching.begin(1, tokens[:9], prefill_window=8)  # takes nothing: block 0 is computed again
    mine = cache.allocate(3)
    caching.store_prompt(1, mine, tokens[:9])
    cache.attach(mine[1], np.full(8, 2.0, np.float32))
    taken = caching.begin(2, tokens[:12])
    assert taken == [a[0], mine[1]]
    caching.store_prompt(2, taken + cache.allocate(1), tokens[:12])
    caching.cut(1, mine, [0])
    assert not cache.is_cached(mine[1]) and cache.is_shared(mine[1])
    observed = caching.prefill_mass(2, taken, torch.zeros(12), None)
    assert observed[:8].tolist() == [2.0] * 8
    cache.check_integrity()
