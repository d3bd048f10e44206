# SPDX-License-Identifier: Apache-2.0
"""Under the engine's overlap scheduler, policies that decide from counts alone (StreamingLLM,
sliding window, Random) take their step before the next forward: no lag, the plain order's
decisions and tokens. Attention-observing policies (H2O, Scissorhands) do too where their step may
evict (``decode_decision="at_once"``, the default); with ``"lagged"`` they keep the one-step lag,
and a batch mixing both does each request its own way. Tiny random model, fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trtllm_vtoken.policies.request_settings import EvictionSettings
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM
from trtllm_vtoken.runtime.overlap import pending_rows
from trtllm_vtoken.runtime.request import Status
from trtllm_vtoken.runtime.sampling import SamplingParams

TPB = 4
SYSTEM = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
PROMPTS = [SYSTEM + [7, 7, 1], SYSTEM + [2, 7, 1, 8, 2, 8, 1, 8, 2], [1, 4, 1, 4, 2, 1], SYSTEM + [6]]
COUNTED = {"streaming_llm": {"n_sink": 2}, "sliding_window": {}, "random": {}}


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny()).eval()


def generate(model, params, **overrides) -> list:
    values = dict(variant="vtoken", policy="h2o", budget=9, tokens_per_block=TPB, num_blocks=64, max_batch_size=4,
                  max_seq_len=64, check_invariants=True)
    engine = Engine(model, EngineConfig(**{**values, **overrides}), record_trace=True)
    per = params if isinstance(params, list) else [params] * len(PROMPTS)
    ids = [engine.add_request(p, q, req_id=i) for i, (p, q) in enumerate(zip(PROMPTS, per))]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(i) for i in ids]


@pytest.mark.parametrize("impl", ["cpp", "python"])
@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("policy", sorted(COUNTED))
def test_count_based_policies_decide_under_overlap_as_in_the_plain_order(tiny, policy, caching, impl):
    """The C++ core's step and its Python specification alike."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    common = dict(policy=policy, policy_options=COUNTED[policy], prefix_caching=caching, step_impl=impl)
    want = generate(tiny, params, variant="naive-evict", overlap_scheduler=False, **common)
    assert any(any(e) for r in want for e in r.evictions), "the budget evicts"
    for variant, mode in (("naive-evict", "dense"), ("vtoken", "dense"), ("vtoken", "lazy")):
        for overlap in (True, False):
            got = generate(tiny, params, variant=variant, mode=mode, overlap_scheduler=overlap, **common)
            for a, b in zip(want, got):
                assert a.evictions == b.evictions, f"{variant} {mode} overlap={overlap}: request {a.req_id}"
                assert a.output_ids == b.output_ids


def test_a_mixed_batch_does_each_request_its_own_way(tiny):
    """StreamingLLM and sliding-window rows decide as in the plain order; H2O and Scissorhands
    rows as well by default, and one iteration late with ``decode_decision="lagged"``, as in a
    batch of their own kind under overlap."""
    settings = [EvictionSettings(policy="streaming_llm", n_sink=2), EvictionSettings(policy="h2o"),
                EvictionSettings(policy="sliding_window"), EvictionSettings(policy="scissorhands", recent_window=2)]
    params = [SamplingParams(max_tokens=16, ignore_eos=True, eviction=s) for s in settings]
    plain = generate(tiny, params, overlap_scheduler=False, budget=8)
    at_once = generate(tiny, params, budget=8)
    assert [r.evictions for r in at_once] == [r.evictions for r in plain]
    assert [r.output_ids for r in at_once] == [r.output_ids for r in plain]
    lagged = generate(tiny, params, budget=8, decode_decision="lagged")
    for i in (0, 2):
        assert lagged[i].evictions == plain[i].evictions and lagged[i].output_ids == plain[i].output_ids
    evicting = [[e for e in r.evictions if e] for r in (*plain, *lagged)]
    assert any(evicting[i] != evicting[4 + i] for i in (1, 3)), "the observing rows lag"
    observing_only = generate(tiny, [params[1], params[1], params[3], params[3]], budget=8, decode_decision="lagged")
    for i in (1, 3):
        assert lagged[i].evictions == observing_only[i].evictions


@pytest.mark.parametrize("decision", ["at_once", "lagged"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_budgets_hold_after_every_iteration_under_overlap(tiny, seed, decision):
    """Random mixes of policies, budgets and arrivals: after every iteration a request holds at
    most its budget of tokens (registered live ones plus those written and not yet taken in); with
    ``decode_decision="lagged"`` an attention-observing one at most its budget plus that
    iteration's new tokens."""
    rng = np.random.default_rng(seed)
    names = ["streaming_llm", "sliding_window", "random", "h2o", "scissorhands"]
    for mode in ("dense", "lazy"):
        engine = Engine(tiny, EngineConfig(variant="vtoken", mode=mode, tokens_per_block=TPB, num_blocks=96,
                                           max_batch_size=6, max_seq_len=64, check_invariants=True,
                                           decode_decision=decision))
        budgets: dict[int, int] = {}
        arrivals = sorted(rng.integers(0, 12, size=8).tolist())
        for it in range(60):
            while arrivals and arrivals[0] <= it:
                arrivals.pop(0)
                name, budget = names[int(rng.integers(len(names)))], int(rng.integers(6, 14))
                options = {"n_sink": 2} if name == "streaming_llm" else {}
                prompt = rng.integers(0, 128, size=int(rng.integers(3, 20))).tolist()
                req_id = engine.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(4, 24)), ignore_eos=True,
                                                                   eviction=EvictionSettings(policy=name, budget=budget,
                                                                                             **options)))
                budgets[req_id] = budget
            if not engine.has_unfinished():
                continue
            before = {r: engine.kv.layout.num_tokens(r) if r in engine.kv.layout.request_ids() else 0
                      for r in engine.running}
            engine.step()
            running = [r for r in engine.running if engine.requests[r].status is Status.RUNNING]
            for r, (_, num_tokens, pending) in zip(running, pending_rows(engine.kv.layout, engine.kv.writes, running)):
                held = engine.kv.layout.num_live(r) + pending
                bound = budgets[r]
                if decision == "lagged" and not engine.kv.decides_from_counts(r):  # this iteration's tokens wait
                    bound += num_tokens + pending - before.get(r, 0)
                assert held <= bound, f"{mode} iteration {it}: request {r} holds {held} > {bound}"
        assert not arrivals


@pytest.mark.slow
def test_real_model_streaming_llm_under_overlap_is_the_plain_order(smollm2_model, smollm2_tokenizer):
    """SmolLM2-135M-Instruct, ShareGPT prompts, StreamingLLM (4 sinks) at 64 tokens: the default
    order (overlap) decides and decodes as the plain order, vtoken dense and naive-evict alike,
    so the first decode forward already attends the compressed prompt, as published."""
    from trtllm_vtoken.workloads import make_workload

    model = smollm2_model
    items = make_workload("sharegpt", 4, smollm2_tokenizer, max_prompt_tokens=200)
    prompts = [smollm2_tokenizer.encode(item.prompt, chat=True) for item in items]
    runs = []
    for variant, overlap in (("vtoken", False), ("vtoken", True), ("naive-evict", True)):
        engine = Engine(model, EngineConfig(variant=variant, policy="streaming_llm", budget=64,
                                            policy_options={"n_sink": 4}, tokens_per_block=16, num_blocks=128,
                                            max_batch_size=4, max_seq_len=512, overlap_scheduler=overlap),
                        smollm2_tokenizer, record_trace=True)
        ids = [engine.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True), req_id=i)
               for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
        runs.append([engine.pop_finished(i) for i in ids])
    assert sum(len(e) for r in runs[0] for e in r.evictions) > 0
    for got in runs[1:]:
        assert [r.evictions for r in got] == [r.evictions for r in runs[0]]
        assert [r.output_ids for r in got] == [r.output_ids for r in runs[0]]
