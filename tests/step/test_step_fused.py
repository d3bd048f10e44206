# SPDX-License-Identifier: Apache-2.0
"""The C++ core's call (``step/fused.py``: decision, table step and layout update in one native
call) equals its specification, the Python core's call (``step/spec.py``), whether it decides
itself or takes the victims decided in Python: the same random batches under one policy at a time
(each of the five, and none), each compaction (background lazy compaction included: the call
plans, the step commits later), blocks becoming shared, give the same victims, moves, freed
blocks, lengths, tables, layouts and KV, with I1/I2 checked around every step; batches the call
cannot decide (several policies, a policy the C++ core does not decide) are decided in Python."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.step.drive import POLICY_SPECS, Host, decided_in_python, join_some, make_step, same_batches, share_a_block
from tests.step.test_step_parity import outputs_equal, tables_equal
from trtllm_vtoken.core.native import load
from trtllm_vtoken.policies import make_policy
from trtllm_vtoken.step import StepInput
from trtllm_vtoken.step.decide import BadMass
from trtllm_vtoken.step.fused import FusedOutput

pytestmark = pytest.mark.skipif(load() is None, reason="the C++ core is not built")

# decided in one native pass (ScorePolicy.scores_are_ids / score_stat)
NATIVE = {"h2o", "streaming_llm", "sliding_window"}


def three_steps(tpb: int, compaction: str, threshold: int, spec, native_checks: bool = True):
    """Python core; C++ core with the victims decided in Python; C++ core deciding in its call:
    each on its own host, one policy each. ``native_checks`` off, the call deciding itself
    registers each batch too (no invariant checks read the registered layout before it)."""
    hosts = [Host(256, tpb, 1) for _ in range(3)]
    policies = [None if spec is None else make_policy(spec[0], spec[1], **spec[2]) for _ in hosts]
    policies[1] = decided_in_python(policies[1])
    steps = [make_step(h, impl, compaction, threshold, p, checks)
             for h, (impl, checks), p in zip(hosts, (("python", True), ("cpp", True), ("cpp", native_checks)),
                                             policies)]
    return hosts, steps


@settings(max_examples=30, deadline=None)
@given(compaction=st.sampled_from(["dense", "lazy", "dead-blocks", "lazy-background"]), tpb=st.sampled_from([2, 4, 8]),
       spec=st.sampled_from(POLICY_SPECS + [None]), steps=st.integers(1, 20), threshold=st.integers(1, 3),
       seed=st.integers(0, 2**31), checks=st.booleans())
def test_the_native_call_equals_the_python_core_deciding_itself_or_not(compaction, tpb, spec, steps, threshold,
                                                                       seed, checks):
    rng = np.random.default_rng(seed)
    hosts, steps_ = three_steps(tpb, compaction, threshold, spec, checks)
    next_req, undecided, expected = 0, 0, 0
    for _ in range(steps):
        joining = join_some(rng, steps_, next_req)
        next_req += len(joining)
        if not steps_[0].request_ids():
            continue
        share_a_block(rng, steps_, hosts, 0.15)
        inputs = same_batches(rng, steps_, hosts, joining)
        outs = [step.run(inp) for step, inp in zip(steps_, inputs)]
        name = None if spec is None else spec[0]
        undecided += not len(inputs[0].req_ids) or name is None  # no victims to decide: the call's own
        expected += not len(inputs[0].req_ids) or name is None or name in NATIVE
        for out in outs[1:]:
            outputs_equal(outs[0], out)
        for host, out in zip(hosts, outs):
            host.release(out.table.freed)
        for step in steps_[1:]:
            tables_equal(steps_[0], step)
            assert step.stats.compactions == steps_[0].stats.compactions
        assert torch.equal(hosts[0].kv, hosts[2].kv) and torch.equal(hosts[1].kv, hosts[2].kv)
        for req in steps_[0].request_ids():  # some finish
            if rng.random() < 0.08:
                for step, host in zip(steps_, hosts):
                    host.release(b for b in step.remove_request(req) if b not in host.shared)
    python, in_python, native = (s.stats for s in steps_)
    assert python.native_decisions == 0 and in_python.native_decisions == undecided
    # Every batch of a natively decided policy (or none) is decided in the call, shared blocks or
    # not; an empty one under any policy.
    assert native.native_decisions == expected


def test_the_call_refuses_given_victims_that_do_not_fit_and_changes_nothing():
    """Victims decided in Python (the given selector) are checked against the layout before the
    call changes anything: ascending batch indices within the batch, positions below the row's
    length holding a live token, a batch the host registered."""
    native = load()
    host = Host(16, 4)
    policy = decided_in_python(make_policy("streaming_llm", 4, n_sink=1))
    step = make_step(host, "cpp", "lazy", threshold=3, policy=policy, checks=False)
    step.add_request(0), step.add_request(1)
    step.run(StepInput([0, 1], [6, 3], [0, 2, 3], host.allocate(3)))
    tokens = step.batch_tokens([0])[0, : step.kv_len(0)].tolist()
    live, dead = [p for p, t in enumerate(tokens) if t >= 0], tokens.index(-1)  # lazy: a hole below kv_len
    before = (step.slots.tokens.copy(), step.counters([0, 1]), step.core.sequence(0).num_live)
    ids, none = np.array([0, 1], dtype=np.int64), np.zeros(2, dtype=np.int64)
    call = dict(layout=step.slots.native_layout(), table=step.core.table, req_ids=ids, rows=step.slots.rows([0, 1]),
                num_new=none, offsets=np.zeros(3, dtype=np.int64), blocks=np.zeros(0, dtype=np.int64), selector=3,
                rule=(-1, 1.0, 0, 0, 0.0, 1), compaction=1, fragmentation_threshold=3, pressure=False)

    def given(index, positions, **more):
        return native.slots_decide_step(**call, victim_index=np.array(index, dtype=np.int64),
                                        victim_pos=np.array(positions, dtype=np.int64), **more)

    for index, positions, more, match in (
            ([1, 0], [0, live[0]], {}, "ascend"), ([0, 2], [live[0], 0], {}, "ascend"),
            ([0], [len(tokens)], {}, "no live token"), ([0], [-1], {}, "no live token"),
            ([0], [dead], {}, "no live token"), ([0, 1], [0], {}, "one length"),
            ([0], [live[0]], {"num_blocks": 16}, "registered before")):
        with pytest.raises(ValueError, match=match):
            given(index, positions, **more)
    with pytest.raises(ValueError, match="given selector"):  # victims with another selector
        native.slots_decide_step(**{**call, "selector": 1}, victim_index=ids, victim_pos=none)
    assert np.array_equal(step.slots.tokens, before[0]) and step.counters([0, 1]) == before[1]
    assert step.core.sequence(0).num_live == before[2]
    out = FusedOutput(given([0, 1], [live[-1], 0]))
    assert out.victims.tolist() == [tokens[live[-1]], 0] and out.victim_offsets.tolist() == [0, 1, 2]
    assert step.num_live(0) == before[2] - 1 and step.num_live(1) == 2


@pytest.mark.parametrize("name", ["streaming_llm", "h2o"])
def test_shared_blocks_are_protected_in_the_call_and_several_policies_are_decided_in_python(name):
    """A shared block's tokens are kept on top of the budget and never evicted, the batch still
    decided in the call (the selection passes over them; H2O's mass is still added to them)."""
    host = Host(32, 4)
    shared: set[int] = set()
    policy = make_policy(name, 5, **({"n_sink": 2} if name == "streaming_llm" else {}))
    step = make_step(host, "cpp", "dense", policy=policy)
    step.shared_blocks, step.is_shared = (lambda: shared), shared.__contains__
    step.add_request(0)
    mass = (lambda n: np.ones((1, n))) if name == "h2o" else (lambda n: None)
    step.run(StepInput([0], [8], [0, 2], host.allocate(2), mass=mass(8)))
    assert step.stats.native_decisions == 1
    shared.add(step.block_ids(0)[0])  # a prefix cache shares its first block: 4 live tokens
    protected = set(step.batch_tokens([0])[0, :4].tolist())
    evicted = []
    for _ in range(6):
        extra = host.allocate(1) if step.kv_len(0) % 4 == 0 else []
        out = step.run(StepInput([0], [1], [0, len(extra)], extra, mass=mass(step.kv_len(0) + 1)))
        evicted += out.victims_of(0)
        assert not set(out.victims_of(0)) & protected  # the shared block's tokens are protected
    assert evicted and step.num_live(0) == 4 + 5  # the budget applies to the unshared tokens
    assert step.stats.native_decisions == 7
    shared.clear()
    step.add_request(1, make_policy("sliding_window", 4))  # a second policy joins the batch
    decided = step.stats.native_decisions
    step.run(StepInput([0, 1], [1, 3], [0, int(step.kv_len(0) % 4 == 0), int(step.kv_len(0) % 4 == 0) + 1],
                       (host.allocate(1) if step.kv_len(0) % 4 == 0 else []) + host.allocate(1),
                       mass=np.ones((2, 16)) if name == "h2o" else None))
    assert step.stats.native_decisions == decided and step.stats.steps == 8


def test_a_bad_mass_function_stops_the_step_decided_natively_or_in_python_alike():
    """A mass function's result is checked when it comes: the new tokens are registered by then,
    so the step refuses to go on, whoever decides, with the same message."""
    messages = []
    for native in (False, True):
        host = Host(16, 4)
        policy = make_policy("h2o", 6)
        step = make_step(host, "cpp", "dense", policy=policy if native else decided_in_python(policy))
        step.add_request(0)
        with pytest.raises(BadMass) as caught:
            step.run(StepInput([0], [5], [0, 2], host.allocate(2), mass=lambda tokens: np.ones((2, 8))))
        with pytest.raises(RuntimeError, match="unusable"):
            step.run(StepInput.decode([0], mass=np.ones((1, 8))))
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


def test_a_failure_while_the_mass_is_read_stops_the_step_only_once_the_batch_is_registered():
    """A mass function that raises (a device error) comes after the batch's tokens joined the
    layout: the step then refuses to go on, as for a bad result. A cross-rank sum that raises on
    an array's mass, with the C++ core registering in its call, comes before anything changed:
    the step stays usable and its next batch runs as in a step that never saw the failure."""
    def failing(tokens):
        raise RuntimeError("device lost")

    host = Host(16, 4)
    step = make_step(host, "cpp", "dense", policy=make_policy("h2o", 6), checks=False)
    step.add_request(0)
    with pytest.raises(RuntimeError, match="device lost"):
        step.run(StepInput([0], [5], [0, 2], host.allocate(2), mass=failing))
    with pytest.raises(RuntimeError, match="unusable after an earlier failure: device lost"):
        step.run(StepInput.decode([0], mass=np.ones((1, 8))))

    failures = [RuntimeError("rank 1 is gone")]

    def reduce(mass):
        if failures:
            raise failures.pop()
        return mass

    outputs = []
    for reduce_mass in (reduce, None):
        host = Host(16, 4)
        step = make_step(host, "cpp", "dense", policy=make_policy("h2o", 6), checks=False, reduce_mass=reduce_mass)
        step.add_request(0)
        blocks = host.allocate(2)
        batch = StepInput([0], [7], [0, 2], blocks, mass=np.arange(8.0)[None])
        if reduce_mass is not None:
            with pytest.raises(RuntimeError, match="rank 1 is gone"):
                step.run(batch)
        outputs.append(step.run(batch))
    assert outputs[0].victims.tolist() == outputs[1].victims.tolist() == [0]
    assert outputs[0].table.kv_lens.tolist() == outputs[1].table.kv_lens.tolist()


def test_an_engine_with_prefix_caching_cuts_its_chains_inside_the_call_as_the_python_core():
    """The reference engine's default: prefix caching on, its cut inside the C++ core's call. Two
    requests with their own prompts evict (StreamingLLM, 8 sinks): their chains are cut at the
    first victim's block, inside the call; two later requests start with the first prompt's
    two cached blocks and share them (their prefill registers those shared blocks as new tokens,
    protected from the first step on). The same tokens, evictions and prefix-cache counts as with
    the Python core, every batch decided in the call."""
    from trtllm_vtoken.runtime.config import EngineConfig
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams
    from trtllm_vtoken.runtime.simulated import MODEL_SHAPES, SimulatedModel

    def run(impl: str):
        config = EngineConfig(tokens_per_block=4, num_blocks=96, max_batch_size=4, max_seq_len=64,
                              policy="streaming_llm", budget=12, policy_options={"n_sink": 8}, step_impl=impl,
                              check_invariants=True)
        engine = Engine(SimulatedModel(MODEL_SHAPES["smollm2-135m"]), config, record_trace=True)
        first = [1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1]  # the simulated model's vocabulary is {0, 1}
        ids = [engine.add_request(prompt, SamplingParams(max_tokens=14, ignore_eos=True))
               for prompt in (first, [0, 1, 0, 0, 1, 1, 0, 1, 0, 0])]
        while engine.has_unfinished():
            engine.step()
        alone = (engine.kv.step_stats.native_decisions, engine.kv.step_stats.steps)
        ids += [engine.add_request(first[:8] + [i] * 5, SamplingParams(max_tokens=10, ignore_eos=True)) for i in (0, 1)]
        while engine.has_unfinished():
            engine.step()
        requests = [engine.requests[r] for r in ids]
        stats = engine.kv.step_stats
        return [(r.output_ids, r.evictions) for r in requests], engine.kv.prefix.cache.stats, alone, stats

    python, native = run("python"), run("cpp")
    assert python[0] == native[0] and python[1] == native[1]
    assert python[1].hit_tokens >= 16 and python[1].dropped_keys > 0  # cached blocks hit, chains cut
    assert python[3].native_decisions == 0
    native_alone, steps_alone = native[2]
    assert native_alone == steps_alone > 0  # every batch of the first phase decided in the call, its cuts inside it
    assert native[3].native_decisions == native[3].steps > steps_alone  # and those holding shared blocks
