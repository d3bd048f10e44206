# SPDX-License-Identifier: Apache-2.0
"""The engine's overlap scheduler (``EngineConfig.overlap_scheduler``, ``runtime/overlap.py``):
the step of iteration N starts once forward N+1's tables are written, runs beside it, and its
copy comes after it; a step that may evict runs before it (``decode_decision="at_once"``).
Proved by the order of the calls, by the decisions (the plain order's deciding at once, one
iteration late lagged; naive-evict and vtoken alike either way), and by native's outputs, which
it does not change."""

from __future__ import annotations

import pytest
import torch

from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.step import DecodeStep

TPB = 4
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [1, 4, 1, 4, 2, 1]]


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny()).eval()


def config(**overrides) -> EngineConfig:
    values = dict(variant="vtoken", policy="h2o", budget=10, tokens_per_block=TPB, num_blocks=64, max_batch_size=4,
                  max_seq_len=64, check_invariants=True)
    return EngineConfig(**{**values, **overrides})


def generate(model, cfg: EngineConfig, prompts=PROMPTS, max_tokens: int = 20, tokenizer=None) -> list:
    engine = Engine(model, cfg, tokenizer, record_trace=True)
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert engine.kv.num_available == cfg.num_blocks, "blocks left after all finished"
    return [engine.pop_finished(i) for i in ids]


def test_overlap_is_the_default():
    assert EngineConfig().overlap_scheduler


@pytest.mark.parametrize("step_impl", ["cpp", "python"])
def test_step_n_starts_after_forward_n_plus_1_has_its_tables_and_copies_after_its_model(tiny, step_impl, monkeypatch):
    """The calls of one iteration in order: set_batch (forward N+1's tables), step N's start,
    the model (forward N+1), step N's finish; step N's rows are forward N's."""
    events: list[tuple] = []
    start, finish, forward = DecodeStep.start, DecodeStep.finish, LlamaForCausalLM.forward

    def spy_start(step, inp, overlap=False, forward_between=False):
        events.append(("start", tuple(inp.req_ids), forward_between))
        start(step, inp, overlap, forward_between)

    def spy_finish(step):
        events.append(("finish",))
        return finish(step)

    def spy_forward(model, input_ids, *args, **kwargs):
        events.append(("model", input_ids.shape[0]))
        return forward(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(DecodeStep, "start", spy_start)
    monkeypatch.setattr(DecodeStep, "finish", spy_finish)
    monkeypatch.setattr(LlamaForCausalLM, "forward", spy_forward)
    engine = Engine(tiny, config(step_impl=step_impl, prefill_decision="lagged", decode_decision="lagged"))
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in PROMPTS]
    engine.step()  # three prefills, no step yet
    assert events == [("model", 1)] * 3
    events.clear()
    engine.step()  # decode forward 2, beside it the prefills' step
    assert events == [("start", tuple(ids), True), ("model", 3), ("finish",)]
    events.clear()
    engine.step()  # decode forward 3, beside it decode 2's step
    assert events == [("start", tuple(ids), True), ("model", 3), ("finish",)]

    events.clear()
    engine = Engine(tiny, config(step_impl=step_impl, decode_decision="lagged"))  # prefill_decision="at_once"
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in PROMPTS]
    engine.step()  # three prefills, then their step before the first decode forward
    assert events == [("model", 1)] * 3 + [("start", tuple(ids), False), ("finish",)]
    events.clear()
    engine.step()  # the first decode forward: no step beside it (the prefills' ran already)
    assert events == [("model", 3)]
    events.clear()
    engine.step()  # decode forward 3, beside it decode 2's step
    assert events == [("start", tuple(ids), True), ("model", 3), ("finish",)]


def test_native_outputs_do_not_change_with_overlap(tiny):
    plain = generate(tiny, config(variant="native", overlap_scheduler=False))
    overlapped = generate(tiny, config(variant="native"))
    assert [r.output_ids for r in plain] == [r.output_ids for r in overlapped]


@pytest.mark.parametrize("policy", ["h2o", "streaming_llm", "sliding_window", "scissorhands", "random"])
@pytest.mark.parametrize("mode", ["dense", "lazy"])
@pytest.mark.parametrize("decision", ["at_once", "lagged"])
def test_vtoken_decides_and_decodes_as_naive_evict_in_either_order(tiny, policy, mode, decision):
    """Both variants take each decision at the same point: the same victims at every step and
    the same tokens. With ``decode_decision="at_once"`` (the default) those are the plain
    order's, for every policy; lagged, H2O and Scissorhands decide one iteration late."""
    opts = {"streaming_llm": {"n_sink": 2}, "scissorhands": {"history_window": 4, "recent_window": 2}}.get(policy, {})
    common = dict(policy=policy, policy_options=opts, decode_decision=decision)
    naive = generate(tiny, config(variant="naive-evict", **common))
    vtoken = generate(tiny, config(mode=mode, **common))
    for a, b in zip(naive, vtoken):
        assert a.evictions == b.evictions, f"request {a.req_id} evicted differently"
        assert a.output_ids == b.output_ids
    assert any(any(e) for r in vtoken for e in r.evictions), "nothing was evicted"
    if decision == "at_once":
        plain = generate(tiny, config(mode=mode, overlap_scheduler=False, policy=policy, policy_options=opts))
        assert evicting_steps(plain) == evicting_steps(vtoken)
        assert [r.output_ids for r in plain] == [r.output_ids for r in vtoken]


def evicting_steps(requests) -> list[list[tuple[int, ...]]]:
    """Each request's victims, step by step, of the steps that evicted: deciding at once, a step
    beside the next forward takes two tokens in and the next step none, so the steps that evict
    nothing fall otherwise than in the plain order."""
    return [[e for e in r.evictions if e] for r in requests]


@pytest.mark.parametrize("unit", [1, TPB])
@pytest.mark.parametrize("budget", [12, 16, 18])
@pytest.mark.parametrize("policy", ["h2o", "scissorhands"])
def test_observing_policies_deciding_at_once_are_the_plain_order_at_every_budget(tiny, policy, budget, unit):
    """Budgets that leave rows below them for several steps (their steps beside the next forward
    take that forward's token in, which Scissorhands must not count before it is attended), and
    whole-block units (a row may evict every few steps)."""
    opts = {"history_window": 8, "recent_window": 2} if policy == "scissorhands" else {}
    common = dict(policy=policy, policy_options=opts, budget=budget, eviction_unit=unit)
    plain = generate(tiny, config(overlap_scheduler=False, **common), max_tokens=24)
    at_once = generate(tiny, config(**common), max_tokens=24)
    assert evicting_steps(plain) == evicting_steps(at_once) and any(evicting_steps(plain))
    assert [r.output_ids for r in plain] == [r.output_ids for r in at_once]


def test_prefill_decisions_at_once_are_the_plain_orders(tiny):
    """H2O's prompt compression (each request's first decision) is the plain order's with
    ``prefill_decision="at_once"``; lagged, it counts the first generated token too."""
    plain = generate(tiny, config(overlap_scheduler=False, budget=8))
    at_once = generate(tiny, config(budget=8))
    lagged = generate(tiny, config(budget=8, prefill_decision="lagged"))
    assert [r.evictions[0] for r in at_once] == [r.evictions[0] for r in plain]
    assert [r.evictions[0] for r in lagged] != [r.evictions[0] for r in plain]


def test_the_lag_shows_in_the_decisions(tiny):
    """With ``decode_decision="lagged"`` the step of iteration N registers forward N+1's token
    too, so a request's k-th decision counts one more token than in the plain order; at once (the
    default) the decisions are the plain order's."""
    plain = generate(tiny, config(overlap_scheduler=False, budget=8))
    overlapped = generate(tiny, config(budget=8, decode_decision="lagged"))
    assert evicting_steps(plain) != evicting_steps(overlapped)
    assert evicting_steps(generate(tiny, config(budget=8))) == evicting_steps(plain)


@pytest.mark.parametrize(("overlap", "decision", "budget", "order"), [
    (False, "at_once", 10, ["wait", "step"]),
    (True, "lagged", 10, ["step", "wait"]),
    (True, "at_once", 10, ["wait", "step"]),  # the step evicts: it waits for the forward's mass
    (True, "at_once", 40, ["step", "wait"]),  # nothing to evict: the step takes the tokens in beside it
])
def test_a_simulated_device_forward_is_waited_for_after_the_step_only_where_it_may_not_evict(
        overlap, decision, budget, order, monkeypatch):
    """The simulated backend's device time: the engine waits for it before the step reads the
    forward (plain order, or a step that may evict decided at once) or after the step, before
    sampling (overlap: the step in its shadow)."""
    import time

    from trtllm_vtoken.runtime.forward import Forwards
    from trtllm_vtoken.runtime.simulated import MODEL_SHAPES, SimulatedModel

    events: list[str] = []
    start, wait = DecodeStep.start, Forwards.wait
    monkeypatch.setattr(DecodeStep, "start", lambda step, *a, **k: (events.append("step"), start(step, *a, **k))[1])
    monkeypatch.setattr(Forwards, "wait", lambda forwards: (events.append("wait"), wait(forwards))[1])
    engine = Engine(SimulatedModel(MODEL_SHAPES["smollm2-135m"], device_forward_us=20_000),
                    config(overlap_scheduler=overlap, decode_decision=decision, budget=budget, prefix_caching=False))
    engine.add_request([1] * 9, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # the prefill (and, overlapped or not, its step)
    engine.step()  # the first decode forward (overlapped: nothing beside it)
    events.clear()
    begun = time.perf_counter()
    engine.step()
    assert time.perf_counter() - begun >= 0.02  # one forward's device time
    assert events == order


@pytest.mark.slow
def test_real_model_vtoken_equals_naive_evict_under_overlap_and_native_is_unchanged(smollm2_model, smollm2_tokenizer):
    """SmolLM2-135M-Instruct on ShareGPT prompts: with the overlap scheduler, vtoken (dense) and
    naive-evict make the same decisions and the same greedy tokens; native's tokens are those of
    the plain order."""
    from trtllm_vtoken.workloads import make_workload

    model = smollm2_model
    items = make_workload("sharegpt", 4, smollm2_tokenizer, max_prompt_tokens=200)
    prompts = [smollm2_tokenizer.encode(item.prompt, chat=True) for item in items]
    real = dict(tokens_per_block=16, num_blocks=256, max_batch_size=4, max_seq_len=512, budget=0.5)
    naive = generate(model, config(variant="naive-evict", **real), prompts, 12, smollm2_tokenizer)
    vtoken = generate(model, config(**real), prompts, 12, smollm2_tokenizer)
    assert [r.evictions for r in naive] == [r.evictions for r in vtoken]
    assert [r.output_ids for r in naive] == [r.output_ids for r in vtoken]
    assert sum(len(e) for r in vtoken for e in r.evictions) > 0
    plain = generate(model, config(variant="native", overlap_scheduler=False, **real), prompts, 12, smollm2_tokenizer)
    overlapped = generate(model, config(variant="native", **real), prompts, 12, smollm2_tokenizer)
    assert [r.output_ids for r in plain] == [r.output_ids for r in overlapped]


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["dense", "lazy"])
@pytest.mark.parametrize("decision", ["at_once", "lagged"])
def test_on_cuda_vtoken_decides_and_decodes_as_naive_evict_and_as_on_the_cpu(tiny, mode, decision):
    """On CUDA the copy of a step beside forward N+1 is enqueued after it (its side stream waits
    for the compute stream), that of a step taken at once before it: the same decisions and
    tokens as naive-evict, and as on the CPU; deciding at once, as the plain order on CUDA."""
    import copy

    model = copy.deepcopy(tiny)
    naive = generate(model, config(variant="naive-evict", device="cuda", decode_decision=decision))
    vtoken = generate(model, config(mode=mode, device="cuda", decode_decision=decision))
    cpu = generate(tiny, config(mode=mode, decode_decision=decision))
    assert [r.evictions for r in naive] == [r.evictions for r in vtoken] == [r.evictions for r in cpu]
    assert [r.output_ids for r in naive] == [r.output_ids for r in vtoken] == [r.output_ids for r in cpu]
    if decision == "at_once":
        plain = generate(model, config(mode=mode, device="cuda", overlap_scheduler=False))
        assert evicting_steps(plain) == evicting_steps(vtoken)
