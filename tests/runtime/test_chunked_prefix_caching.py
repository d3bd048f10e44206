# SPDX-License-Identifier: Apache-2.0
"""Chunked prefill with prefix caching (``enable_chunked_prefill`` beside the default
``prefix_caching=True``): a request that may evict takes a cached prefix up to its first chunk's
end only and decides after every chunk where it does without the cache, so for every policy,
vtoken dense and lazy (also in the background) and naive-evict, the plain and the overlap order,
a request decides and decodes the same alone (after others, reusing their cached prefix), in a batch, and with caching
off; native requests take the whole cached prefix. Tiny random model, fp32; chunks of 16 tokens,
a 37-token system prompt (three chunks' worth with the private part)."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from tests.runtime.test_batch_invariance import drain
from trtllm_vtoken.policies import POLICIES
from trtllm_vtoken.policies.request_settings import EvictionSettings
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.sampling import SamplingParams

TPB = 4
CHUNK = 16
CHUNKED = dict(enable_chunked_prefill=True, max_num_tokens=CHUNK + 4, max_batch_size=4, lazy_background=False)
SYSTEM = torch.randint(0, 128, (37,), generator=torch.Generator().manual_seed(5)).tolist()
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)
VARIANTS = [("naive-evict", "dense", False), ("vtoken", "dense", False), ("vtoken", "lazy", False),
            ("vtoken", "lazy", True)]  # the last: lazy compaction in the background
OPTIONS = {"streaming_llm": {"n_sink": 2}, "h2o windowed": {"prefill_window": 6}}
NATIVE = EvictionSettings(policy="native")


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def prompts(n: int = 4) -> list[list[int]]:
    """The system prompt and 3 to 11 private tokens each."""
    g = torch.Generator().manual_seed(9)
    return [SYSTEM + torch.randint(0, 128, (3 + i * 8 // n,), generator=g).tolist() for i in range(n)]


def engine_for(model, **overrides) -> Engine:
    values = dict(policy="h2o", budget=14, tokens_per_block=TPB, num_blocks=120, max_seq_len=80,
                  check_invariants=True, **CHUNKED)
    values.update(overrides)
    return Engine(model, EngineConfig(**values), record_trace=True)


def alone_together_uncached(model, batch, **config):
    """Each request alone, one after another in an engine whose cache holds the system prompt
    (left by a native request); all at once in a fresh engine; all at once without caching."""
    engine = engine_for(model, **config)
    drain(engine, [engine.add_request(SYSTEM + [0], SamplingParams(max_tokens=1, eviction=NATIVE), req_id=100)])
    before = engine.stats.cached_prompt_tokens
    alone = [drain(engine, [engine.add_request(p, PARAMS, req_id=i)])[0] for i, p in enumerate(batch)]
    reused = engine.stats.cached_prompt_tokens - before
    together_engine = engine_for(model, **config)
    together = drain(together_engine, [together_engine.add_request(p, PARAMS, req_id=i) for i, p in enumerate(batch)])
    off = engine_for(model, **config, prefix_caching=False)
    uncached = drain(off, [off.add_request(p, PARAMS, req_id=i) for i, p in enumerate(batch)])
    return alone, together, uncached, reused


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
@pytest.mark.parametrize("policy", sorted(POLICIES.names()) + ["h2o windowed"])
def test_a_request_decides_alike_alone_in_a_batch_and_without_caching(model, policy, overlap):
    batch, reference = prompts(), None
    for variant, mode, background in VARIANTS:
        alone, together, uncached, reused = alone_together_uncached(
            model, batch, variant=variant, mode=mode, lazy_background=background, policy=policy.split()[0],
            policy_options=OPTIONS.get(policy, {}), overlap_scheduler=overlap)
        # Each took the cached blocks before its first chunk's end: 3 blocks (12 of 16 tokens).
        assert reused == len(batch) * (CHUNK - TPB), f"{variant} {mode}: {reused}"
        for a, b, c in zip(alone, together, uncached):
            assert a.evictions == b.evictions == c.evictions, f"{variant} {mode}: request {a.req_id}"
            assert a.output_ids == b.output_ids == c.output_ids
        reference = reference or together
        for a, b in zip(reference, together):  # vtoken == naive-evict, decision for decision
            assert a.evictions == b.evictions and a.output_ids == b.output_ids, f"{variant} {mode} == naive-evict"
    assert any(any(r.evictions[:2]) for r in reference), "the policy evicted between chunks"


@pytest.mark.parametrize("variant", ["native", "vtoken"])
def test_native_requests_take_the_whole_cached_prefix(model, variant):
    """A native request (the native variant, or a request's own ``policy="native"``) decides
    nothing: it takes every cached block of its prompt, also the ones a later chunk filled, and
    generates the tokens it does without caching."""
    params = SamplingParams(max_tokens=10, ignore_eos=True, eviction=None if variant == "native" else NATIVE)
    batch = prompts(3)
    engine = engine_for(model, variant=variant)
    first = drain(engine, [engine.add_request(batch[0], params)])[0]
    before = engine.stats.cached_prompt_tokens
    rest = [drain(engine, [engine.add_request(p, params)])[0] for p in batch[1:]]
    assert engine.stats.cached_prompt_tokens - before == 2 * (len(SYSTEM) // TPB * TPB)  # 36 tokens, 3 chunks' blocks
    off = engine_for(model, variant=variant, prefix_caching=False)
    uncached = drain(off, [off.add_request(p, params) for p in batch])
    assert [r.output_ids for r in [first, *rest]] == [r.output_ids for r in uncached]


def test_a_cached_prefix_inside_the_first_chunk_is_taken_whole(model):
    """A cached prefix shorter than the first chunk is taken as it is (the request computes the
    rest of the chunk); the chunks then end where they end without the cache."""
    engine = engine_for(model, variant="vtoken")
    drain(engine, [engine.add_request(SYSTEM[:9], SamplingParams(max_tokens=1, eviction=NATIVE))])
    req_id = engine.add_request(SYSTEM + [1, 2], PARAMS)
    forwards = []
    run = engine.forwards.run
    engine.forwards.run = lambda rows, tokens, **kw: forwards.append(len(tokens[0])) or run(rows, tokens, **kw)
    drain(engine, [req_id])
    assert engine.stats.cached_prompt_tokens == 8
    assert forwards[:3] == [CHUNK - 8, CHUNK, len(SYSTEM) + 2 - 2 * CHUNK]  # prompt chunks end at 16, 32, 39


def test_an_evicting_requests_chunks_are_cached_until_its_first_eviction(model):
    """StreamingLLM keeping 36 tokens (4 sinks) over a 48-token prompt: nothing is evicted after
    the first two chunks, so their blocks hold a fresh prefill's KV and are keyed as they fill;
    the eviction after the third chunk (tokens 4-15) cuts the chain at its lowest victim's block,
    and only the first block stays keyed."""
    engine = engine_for(model, variant="vtoken", policy="streaming_llm", budget=36, policy_options={"n_sink": 4},
                        overlap_scheduler=False)
    req_id = engine.add_request(SYSTEM + list(range(1, 12)), PARAMS)
    keyed = []
    for _ in range(3):
        engine.step()
        keyed.append([engine.kv.prefix.cache.is_cached(b) for b in engine.kv.layout.block_ids(req_id)])
    assert keyed[:2] == [[True] * 4, [True] * 8]
    assert keyed[2][:1] == [True] and not any(keyed[2][1:])
    drain(engine, [req_id])


def test_chunked_prefill_takes_prefix_caching(model):
    config = EngineConfig(**CHUNKED)
    assert config.prefix_caching and config.prefill_chunk_tokens == CHUNK
    assert EngineConfig(**CHUNKED, prefix_reuse="share", admission="greedy").admission == "greedy"


@pytest.mark.parametrize("policy", ["streaming_llm", "h2o"])
def test_greedy_admission_shares_no_block_of_an_evicting_prompt_in_chunks(model, policy):
    """Found by fuzzing (share, greedy admission and chunked prefill were refused together for
    it): prompts of 50, 45 and 40 tokens with a common prefix, 11 blocks, budget 24. A newcomer
    sharing the oldest prompt's blocks made them protected, on top of its budget: its next chunk
    did not fit, it preempted the newer prompts and then itself, and greedy admission took them
    in again, for ever (291 preemptions in 300 iterations). Now, while a prompt that may evict has
    chunks to come, a newcomer prefills those tokens itself; all three end."""
    engine = engine_for(model, policy=policy, policy_options={"n_sink": 2} if policy == "streaming_llm" else {},
                        budget=24, num_blocks=11, max_seq_len=96, prefix_reuse="share", admission="greedy")
    ids = [engine.add_request((SYSTEM * 2)[:n], SamplingParams(max_tokens=10, ignore_eos=True)) for n in (50, 45, 40)]
    blocks, iterations = engine.kv.layout.block_ids, 0
    while engine.has_unfinished() and iterations < 300:
        engine.step()
        iterations += 1
        for i, req_id in enumerate(engine.running):  # no later request holds a block of a prompt in chunks
            if req_id in engine.scheduler.prefilling:
                assert set(blocks(req_id)).isdisjoint(set().union(*map(blocks, engine.running[i + 1 :])))
    assert not engine.has_unfinished() and iterations == 36 and engine.stats.preemptions == 10
    assert all(len(engine.pop_finished(r).output_ids) == 10 for r in ids)


def fuzzed_batch(model, seed: int) -> Engine:
    """One configuration of the fuzz that found the case above: share, greedy admission, chunks
    of 16, a random policy, variant, budget and pool (8 to 24 blocks), and 2 to 6 prompts that
    share a random prefix of 16 to 80 tokens."""
    rng = random.Random(seed)
    policy, options = rng.choice([("h2o", {}), ("h2o", {"prefill_window": 6}), ("streaming_llm", {"n_sink": 2}),
                                  ("sliding_window", {})])
    variant, mode = rng.choice([("vtoken", "dense"), ("vtoken", "lazy"), ("naive-evict", "dense")])
    budget, num_blocks, n = rng.choice([8, 12, 16, 24, 32]), rng.randrange(8, 25), rng.randrange(2, 7)
    engine = Engine(model, EngineConfig(**CHUNKED, variant=variant, mode=mode, policy=policy, policy_options=options,
                                        budget=budget, tokens_per_block=TPB, num_blocks=num_blocks, max_seq_len=128,
                                        prefix_reuse="share", admission="greedy"))
    shared = [rng.randrange(128) for _ in range(rng.randrange(16, 80))]
    for _ in range(n):
        prompt = shared[: rng.randrange(len(shared) // 2, len(shared) + 1)]
        prompt += [rng.randrange(128) for _ in range(rng.randrange(1, 12))]
        with contextlib.suppress(ValueError):  # longer than the pool holds alone
            engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(3, 40), ignore_eos=True))
    return engine


@pytest.mark.parametrize("seed", [165, 224, 268, 326, 353])
def test_the_fuzzed_batches_that_ran_for_ever_end(model, seed):
    """The 5 of the fuzz's first 400 configurations that had not ended after 500 iterations (each
    preempting 444-490 times) before the rule above; they end now."""
    engine = fuzzed_batch(model, seed)
    for _ in range(500):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished() and engine.stats.preemptions < 100


@pytest.mark.parametrize("variant", ["native", "vtoken"])
@pytest.mark.parametrize("max_tokens", [1, 6])
def test_every_full_block_of_a_chunked_prompt_is_cached_however_soon_it_ends(model, variant, max_tokens):
    """A 38-token prompt in chunks of 16 keys its 9 full blocks, the last chunk's too, before its
    forwards run: a request ending right after its prompt (one token) leaves as much cached as
    a whole prefill does."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, eviction=None if variant == "native" else NATIVE)
    reused = {}
    for chunked in (False, True):
        engine = engine_for(model, variant=variant,
                            **({} if chunked else {"enable_chunked_prefill": False, "max_num_tokens": None}))
        drain(engine, [engine.add_request(SYSTEM + [0], params)])
        drain(engine, [engine.add_request(SYSTEM + [0, 1, 2], params)])
        reused[chunked] = engine.stats.cached_prompt_tokens
    assert reused == {False: 36, True: 36}


def test_greedy_admission_counts_the_first_chunk_after_a_long_cached_prefix(model):
    """Greedy admission, a native request whose cached prefix (40 tokens) is longer than a chunk:
    its first forward computes [40, 48), two new blocks, and its 10 cached blocks stop being
    reclaimable. With 2 free blocks, 1 other reclaimable one and a headroom of 2 that does not
    fit: it prefills its whole prompt instead, and the headroom stays available."""
    g = torch.Generator().manual_seed(5)
    system = torch.randint(0, 128, (40,), generator=g).tolist()
    other = torch.randint(0, 128, (41,), generator=g).tolist()
    engine = engine_for(model, variant="vtoken", num_blocks=24, admission="greedy", evacuation_headroom=2,
                        overlap_scheduler=False)
    drain(engine, [engine.add_request(system + [0], SamplingParams(max_tokens=6, ignore_eos=True, eviction=NATIVE))])
    engine.add_request(other, SamplingParams(max_tokens=3, ignore_eos=True, eviction=NATIVE))
    while engine.scheduler.prefilling or engine.waiting:
        engine.step()
    assert (engine.kv.pool.num_free, engine.kv.prefix.cache.num_reclaimable) == (2, 11)
    engine.add_request(system + list(range(1, 11)), SamplingParams(max_tokens=4, ignore_eos=True, eviction=NATIVE))
    engine.step()
    assert engine.kv.num_available >= 2 and engine.stats.cached_prompt_tokens == 0
    drain(engine, list(engine.requests))


@pytest.mark.parametrize("impl", ["cpp", "python"])
def test_a_cached_block_a_request_held_outside_its_table_comes_back_empty(model, impl):
    """Found by fuzzing (overlap scheduler, greedy admission, chunks): request 2003 (native) takes
    cached blocks 2000 holds, 2000 leaves while they are shared (their slots are kept), and 2003
    ends at its first forward, its step never run: the blocks were never in its table row. Its
    release empties their slots, else a request given one later as a partly written block finds
    2000's tokens beside its own (``check_integrity`` checks every block no request holds)."""
    prefix = [5, 1, 7, 4, 5, 5, 6, 0, 7, 5, 0, 7, 0, 3, 6, 7, 0, 2, 0, 2]
    arrivals = {3: [(1, prefix + [4], 7, None), (2002, prefix + [3], 6, None)],
                6: [(2000, prefix + [1], 5, NATIVE), (2003, prefix[:13], 1, NATIVE)],
                7: [(0, [1, 7, 4, 5, 5, 6, 0, 7], 1, None),
                    (2, torch.randint(0, 8, (41,), generator=torch.Generator().manual_seed(1)).tolist(), 1, None),
                    (2001, [7, 3, 2, 1, 3, 6, 2, 6, 1, 1, 6, 4, 6, 5, 0, 6, 3], 2, None)]}
    engine = engine_for(model, variant="naive-evict", policy_options={"prefill_window": 6}, budget=0.5,
                        num_blocks=18, max_batch_size=3, max_seq_len=128, max_num_tokens=25, admission="greedy",
                        overlap_scheduler=True, step_impl=impl)
    step = 0
    while step <= 7 or engine.has_unfinished():
        for req_id, prompt, max_tokens, eviction in arrivals.get(step, []):
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, eviction=eviction),
                               req_id=req_id)
        if engine.has_unfinished():
            engine.step()
            engine.kv.check_integrity()
        step += 1
    assert engine.kv.num_available == engine.kv.pool.num_blocks
