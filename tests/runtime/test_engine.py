# SPDX-License-Identifier: Apache-2.0
"""The continuous-batching engine on a tiny random model: variants, admission, preemption,
cancellation, stops, and block accounting, exactly."""

from __future__ import annotations

import random

import pytest
import torch

from trtllm_vtoken.policies import POLICIES
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM
from trtllm_vtoken.runtime.request import Status
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.runtime.simulated import MODEL_SHAPES, SimulatedModel

TPB = 4
POLICY_OPTIONS = {"streaming_llm": {"n_sink": 2}}
VARIANTS = [("naive-evict", "dense"), ("vtoken", "dense"), ("vtoken", "lazy")]


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny()).eval()


def prompts(n: int = 10, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 30, (n,), generator=g).tolist()
    return [torch.randint(0, 128, (length,), generator=g).tolist() for length in lengths]


def config(**overrides) -> EngineConfig:
    values = dict(policy="h2o", budget=12, tokens_per_block=TPB, num_blocks=96, max_batch_size=6,
                  max_seq_len=64, check_invariants=True)
    values.update(overrides)
    return EngineConfig(**values)


def run(engine: Engine, batch: list[list[int]], params: SamplingParams, each_step=None) -> list:
    ids = [engine.add_request(p, params) for p in batch]
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_integrity()
        if each_step:
            each_step(engine)
    assert engine.kv.num_available == engine.kv.pool.num_blocks, "blocks left after all finished"
    assert not engine.kv.admission.running and not engine.kv.layout.request_ids()
    return [engine.pop_finished(i) for i in ids]


def dense_holds_ideal_blocks(engine: Engine) -> None:
    for req_id in engine.running:
        live = engine.kv.step.num_live(req_id)
        assert len(engine.kv.step.block_ids(req_id)) == -(-live // TPB), req_id


LONG = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("policy", sorted(POLICIES.names()))
def test_vtoken_matches_naive_evict_decisions_and_outputs(model, policy):
    opts = POLICY_OPTIONS.get(policy, {})
    naive = run(Engine(model, config(variant="naive-evict", policy=policy, policy_options=opts),
                       record_trace=True), prompts(), LONG)
    for mode in ("dense", "lazy"):
        engine = Engine(model, config(variant="vtoken", mode=mode, policy=policy, policy_options=opts),
                        record_trace=True)
        check = dense_holds_ideal_blocks if mode == "dense" else None
        got = run(engine, prompts(), LONG, check)
        for a, b in zip(naive, got):
            assert a.evictions == b.evictions, f"{mode}: request {a.req_id} evicted differently"
            assert a.output_ids == b.output_ids, f"{mode}: request {a.req_id} generated differently"
            torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), rtol=1e-4, atol=1e-4)
        stats = engine.kv.step_stats
        assert stats.compactions > 0 and stats.invariant_checks == stats.compactions


def test_native_keeps_everything_and_evictions_free_blocks(model):
    native = Engine(model, config(variant="native"))
    run(native, prompts(), LONG)
    assert native.kv.step is None and native.kv.step_stats.tokens_evicted == 0  # no table, no policy
    vtoken = Engine(model, config(variant="vtoken"))
    run(vtoken, prompts(), LONG)
    assert vtoken.kv.step_stats.tokens_evicted > 0
    assert vtoken.kv.stats.peak_blocks_used < native.kv.stats.peak_blocks_used


def test_vtoken_admits_more_requests_into_the_same_pool(model):
    """Peak-demand admission credits the budget: vToken runs more requests at once."""
    def most_running(variant):
        engine, seen = Engine(model, config(variant=variant, num_blocks=40, max_batch_size=10)), []
        run(engine, prompts(10), LONG, lambda e: seen.append(len(e.running)))
        return max(seen), engine.stats.preemptions

    native, native_preempted = most_running("native")
    vtoken, vtoken_preempted = most_running("vtoken")
    assert vtoken > native and native_preempted == vtoken_preempted == 0


@pytest.mark.parametrize("variant,mode", [("native", "dense"), *VARIANTS])
def test_greedy_admission_preempts_and_recomputes_without_loss(model, variant, mode):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    roomy = run(Engine(model, config(variant=variant, mode=mode, budget=16)), prompts(), params)
    # The smallest pools the longest request fits alone in. Only vToken's budget bounds a
    # request's peak; naive-evict cannot count on any block dying, so it needs native's.
    blocks = 9 if variant == "vtoken" else 14
    tight = Engine(model, config(variant=variant, mode=mode, budget=16, num_blocks=blocks,
                                 admission="greedy"))
    squeezed = run(tight, prompts(), params)
    assert tight.stats.preemptions > 0
    assert all(len(r.output_ids) == 20 and r.finish_reason == "length" for r in squeezed)
    if variant == "native":  # recomputation reproduces the same KV, hence the same tokens
        assert [r.output_ids for r in squeezed] == [r.output_ids for r in roomy]


def test_an_iteration_that_preempts_admits_no_one_while_others_run():
    """As vLLM's V1 scheduler: no waiting request is admitted in an iteration that preempted one
    while others run. Here (greedy admission, prompts in chunks sharing a cached prefix) the
    preempted prompt, first in the queue, found its blocks cached and was admitted again at once,
    running the pool dry for the next row: 12 preemptions instead of 8."""
    engine = Engine(SimulatedModel(MODEL_SHAPES["llama-3.1-8b"]), EngineConfig(
        variant="native", tokens_per_block=4, num_blocks=16, max_seq_len=96, admission="greedy",
        enable_chunked_prefill=True, max_num_tokens=24, max_batch_size=8))
    rng = random.Random(0)
    shared = [rng.randrange(2) for _ in range(8)]
    for _ in range(3):
        engine.add_request(shared + [rng.randrange(2) for _ in range(rng.randrange(4, 40))],
                           SamplingParams(max_tokens=rng.randrange(8, 24), ignore_eos=True))
    preempting = 0
    while engine.has_unfinished():
        before, running = engine.stats.preemptions, set(engine.running)
        engine.step()
        if engine.stats.preemptions > before and engine.running:
            preempting += 1
            assert set(engine.running) <= running  # nobody joined
    assert preempting > 0 and engine.stats.preemptions == 8


def test_a_preempted_request_whose_recomputation_never_fits_ends_instead_of_waiting(model):
    """Greedy admission preempts the newest request; recomputed, it prefills its output too, all
    of it before its policy evicts: here 6 + 3 tokens in an 8-block pool that holds it while it
    decodes (its budget 4 + 1). Nothing else runs once the first finishes, so it could never be
    admitted again: it ends with "length" and the tokens it had, and the engine stops."""
    engine = Engine(model, config(policy="streaming_llm", budget=4, tokens_per_block=1, num_blocks=8,
                                  admission="greedy", overlap_scheduler=False, prefix_caching=False, max_seq_len=128))
    ids = [engine.add_request(p, SamplingParams(max_tokens=60, ignore_eos=True)) for p in ([3], [4] * 6)]
    for _ in range(200):  # it waited for ever before
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished() and engine.kv.num_available == engine.kv.pool.num_blocks
    first, second = map(engine.pop_finished, ids)
    assert engine.stats.preemptions == 1 and second.num_preemptions == 1
    assert (first.finish_reason, len(first.output_ids)) == ("length", 60)
    assert second.finish_reason == "length" and 0 < len(second.output_ids) < 60
    assert len(second.prefill_ids()) > 8


def test_a_request_ended_that_way_hands_over_all_its_text(tiny_llm_folder):
    """The streamed pieces add up to the decoded output: what the text stream held back (a stop
    string's prefix, a partial character) comes out with the ending."""
    from trtllm_vtoken.runtime.model import load_llama
    from trtllm_vtoken.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_llm_folder)
    engine = Engine(load_llama(tiny_llm_folder), config(policy="streaming_llm", budget=4, tokens_per_block=1,
                                                        num_blocks=8, admission="greedy", overlap_scheduler=False,
                                                        prefix_caching=False, max_seq_len=128), tokenizer=tokenizer)
    params = SamplingParams(max_tokens=60, ignore_eos=True, stop=["\u2603 never"])
    words = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    ids = [engine.add_request(p, params) for p in (words[:1], words[1:7])]
    texts = {i: "" for i in ids}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for delta in engine.step():
            texts[delta.req_id] += delta.text_delta
    for req_id in ids:
        request = engine.pop_finished(req_id)
        assert request.finish_reason == "length"
        assert texts[req_id] == request.text == tokenizer.decode(request.output_ids)
    assert engine.stats.preemptions == 1


def test_cancel_frees_blocks_of_running_and_waiting_requests(model):
    engine = Engine(model, config(max_batch_size=2))
    ids = [engine.add_request(p, LONG) for p in prompts(4)]
    engine.step()
    assert engine.requests[ids[0]].status is Status.RUNNING
    assert engine.requests[ids[3]].status is Status.WAITING
    assert engine.cancel(ids[0]) and engine.cancel(ids[3])
    assert not engine.cancel(ids[3])
    outputs = engine.step()
    cancelled = {o.req_id: o for o in outputs if o.finish_reason == "cancelled"}
    assert set(cancelled) == {ids[0], ids[3]} and all(o.finished for o in cancelled.values())
    engine.kv.check_integrity()
    for req_id in ids[1:3]:
        engine.cancel(req_id)
    assert engine.kv.num_available == engine.kv.pool.num_blocks and not engine.has_unfinished()


def test_requests_that_can_never_fit_are_refused(model):
    engine = Engine(model, config(variant="native", num_blocks=8, max_seq_len=64))
    with pytest.raises(ValueError, match="exceeds max_seq_len 64"):
        engine.add_request([1] * 60, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="more KV blocks than the pool's 8"):
        engine.add_request([1] * 30, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match=r"must lie in \[0, 128\)"):
        engine.add_request([1, 500])
    with pytest.raises(ValueError, match="need an engine with a tokenizer"):
        engine.add_request([1, 2], SamplingParams(stop=("x",)))
    assert not engine.has_unfinished()
    # vToken's budget bounds the live tokens, so the same long request fits the same pool.
    Engine(model, config(variant="vtoken", budget=8, num_blocks=8)).add_request([1] * 30, SamplingParams(max_tokens=5))


def test_finish_reasons(model):
    engine = Engine(model, config(variant="native"), eos_token_ids=frozenset())
    [free] = run(engine, [prompts(1)[0]], SamplingParams(max_tokens=7))
    assert free.finish_reason == "length" and len(free.output_ids) == 7
    stop_at = free.output_ids[3]
    first = free.output_ids.index(stop_at)
    engine = Engine(model, config(variant="native"), eos_token_ids=frozenset({stop_at}))
    [eos] = run(engine, [prompts(1)[0]], SamplingParams(max_tokens=7))
    assert eos.finish_reason == "stop" and eos.output_ids == free.output_ids[: first + 1]
    [ignored] = run(engine, [prompts(1)[0]], SamplingParams(max_tokens=7, ignore_eos=True))
    assert ignored.output_ids == free.output_ids
    [stopped] = run(engine, [prompts(1)[0]], SamplingParams(max_tokens=7, ignore_eos=True,
                                                            stop_token_ids=(stop_at,)))
    assert stopped.output_ids == eos.output_ids
    assert stopped.stop_reason == stop_at and eos.stop_reason is None and free.stop_reason is None


def test_cumulative_logprob_sums_the_chosen_tokens_log_probabilities(model):
    import copy

    flat = copy.deepcopy(model)  # the random model's logits are near one-hot; flatten them
    flat.model.norm.weight.data *= 0.02
    engine = Engine(flat, config(variant="native"), record_trace=True)
    [done] = run(engine, [prompts(1)[0]], SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True))
    expected = sum(float(torch.log_softmax(logits, -1)[t]) for logits, t in zip(done.logits, done.output_ids))
    assert done.cumulative_logprob == pytest.approx(expected) and done.cumulative_logprob < 0


def test_seeded_sampling_is_reproducible_and_batch_independent(model):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    alone = run(Engine(model, config()), prompts(1), params)[0].output_ids
    together = run(Engine(model, config()), prompts(1) + prompts(5, seed=9), params)[0].output_ids
    assert alone == together


def test_batch_never_exceeds_max_batch_size(model):
    seen = []
    run(Engine(model, config(max_batch_size=3)), prompts(8), LONG, lambda e: seen.append(len(e.running)))
    assert max(seen) == 3


def test_config_rejects_bad_settings():
    with pytest.raises(KeyError, match="Unknown eviction policy 'nope'"):
        EngineConfig(policy="nope")
    with pytest.raises(ValueError, match="variant must be one of"):
        EngineConfig(variant="magic")
    with pytest.raises(ValueError, match="unknown EngineConfig key"):
        EngineConfig.from_dict({"tokens_per_blok": 16})
    with pytest.raises(ValueError, match="must not be negative"):
        EngineConfig(budget=-3)
    with pytest.raises(ValueError, match="unknown option"):
        EngineConfig(policy="h2o", policy_options={"window": 3})


@pytest.mark.cuda
@pytest.mark.parametrize("variant,mode", VARIANTS)
def test_cuda_engine_agrees_with_cpu(model, variant, mode):
    """The same engine on CUDA: relocation on the side stream, commits ordered by event (I3)."""
    import copy

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    cpu = run(Engine(model, config(variant=variant, mode=mode), record_trace=True), prompts(), params)
    gpu_engine = Engine(copy.deepcopy(model), config(variant=variant, mode=mode, device="cuda"), record_trace=True)
    gpu = run(gpu_engine, prompts(), params)
    for a, b in zip(cpu, gpu):
        assert a.evictions == b.evictions and a.output_ids == b.output_ids
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), rtol=1e-3, atol=1e-3)
    if variant == "vtoken":
        assert gpu_engine.kv.step_stats.invariant_checks == gpu_engine.kv.step_stats.compactions > 0
