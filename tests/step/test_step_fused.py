# SPDX-License-Identifier: Apache-2.0
"""The C++ core's fused decode step (``step/fused.py``: decision, table step and layout update in
one native call) equals the general path and the Python core: the same random batches under one
policy at a time (each of the five, and none), each compaction (background lazy compaction
included: the call plans, the step commits later), blocks becoming shared, give the same victims,
moves, freed blocks, lengths, tables, layouts and KV, with I1/I2 checked around every step;
batches it cannot serve (several policies, a policy the C++ core does not decide) take the
general path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.step.drive import POLICY_SPECS, Host, join_some, make_step, same_batches, share_a_block
from tests.step.test_step_parity import outputs_equal, tables_equal
from trtllm_vtoken.core.native import load
from trtllm_vtoken.policies import make_policy
from trtllm_vtoken.step import StepInput
from trtllm_vtoken.step.decide import BadMass

pytestmark = pytest.mark.skipif(load() is None, reason="the C++ core is not built")

# decided in one native pass (ScorePolicy.scores_are_ids / score_stat)
NATIVE = {"h2o", "streaming_llm", "sliding_window"}


def three_steps(tpb: int, compaction: str, threshold: int, spec, fused_checks: bool = True):
    """Python core, C++ general path, C++ fused path: each on its own host, one policy each.
    ``fused_checks`` off, the fused call registers each batch itself (no invariant checks read the
    registered layout before it)."""
    hosts = [Host(256, tpb, 1) for _ in range(3)]
    policies = [None if spec is None else make_policy(spec[0], spec[1], **spec[2]) for _ in hosts]
    steps = [make_step(h, impl, compaction, threshold, p, fused, checks)
             for h, (impl, fused, checks), p in zip(hosts, (("python", True, True), ("cpp", False, True),
                                                            ("cpp", True, fused_checks)), policies)]
    return hosts, steps


@settings(max_examples=30, deadline=None)
@given(compaction=st.sampled_from(["dense", "lazy", "dead-blocks", "lazy-background"]), tpb=st.sampled_from([2, 4, 8]),
       spec=st.sampled_from(POLICY_SPECS + [None]), steps=st.integers(1, 20), threshold=st.integers(1, 3),
       seed=st.integers(0, 2**31), checks=st.booleans())
def test_fused_step_equals_general_path_and_python(compaction, tpb, spec, steps, threshold, seed, checks):
    rng = np.random.default_rng(seed)
    hosts, steps_ = three_steps(tpb, compaction, threshold, spec, checks)
    next_req, expected = 0, 0
    for _ in range(steps):
        joining = join_some(rng, steps_, next_req)
        next_req += len(joining)
        if not steps_[0].request_ids():
            continue
        share_a_block(rng, steps_, hosts, 0.15)
        inputs = same_batches(rng, steps_, hosts, joining)
        outs = [step.run(inp) for step, inp in zip(steps_, inputs)]
        name = None if spec is None else spec[0]
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
    python, general, fused = (s.stats for s in steps_)
    assert python.fused_steps == general.fused_steps == 0
    # Every batch of a natively decided policy (or none) fuses, shared blocks or not; an empty one
    # under any policy.
    assert fused.fused_steps == expected


@pytest.mark.parametrize("name", ["streaming_llm", "h2o"])
def test_shared_blocks_are_protected_in_the_fused_call_and_several_policies_never_fuse(name):
    """A shared block's tokens are kept on top of the budget and never evicted, the batch still
    fused (the selection passes over them; H2O's mass is still added to them)."""
    host = Host(32, 4)
    shared: set[int] = set()
    policy = make_policy(name, 5, **({"n_sink": 2} if name == "streaming_llm" else {}))
    step = make_step(host, "cpp", "dense", policy=policy)
    step.shared_blocks, step.is_shared = (lambda: shared), shared.__contains__
    step.add_request(0)
    mass = (lambda n: np.ones((1, n))) if name == "h2o" else (lambda n: None)
    step.run(StepInput([0], [8], [0, 2], host.allocate(2), mass=mass(8)))
    assert step.stats.fused_steps == 1
    shared.add(step.block_ids(0)[0])  # a prefix cache shares its first block: 4 live tokens
    protected = set(step.batch_tokens([0])[0, :4].tolist())
    evicted = []
    for _ in range(6):
        extra = host.allocate(1) if step.kv_len(0) % 4 == 0 else []
        out = step.run(StepInput([0], [1], [0, len(extra)], extra, mass=mass(step.kv_len(0) + 1)))
        evicted += out.victims_of(0)
        assert not set(out.victims_of(0)) & protected  # the shared block's tokens are protected
    assert evicted and step.num_live(0) == 4 + 5  # the budget applies to the unshared tokens
    assert step.stats.fused_steps == 7
    shared.clear()
    step.add_request(1, make_policy("sliding_window", 4))  # a second policy joins the batch
    fused = step.stats.fused_steps
    step.run(StepInput([0, 1], [1, 3], [0, int(step.kv_len(0) % 4 == 0), int(step.kv_len(0) % 4 == 0) + 1],
                       (host.allocate(1) if step.kv_len(0) % 4 == 0 else []) + host.allocate(1),
                       mass=np.ones((2, 16)) if name == "h2o" else None))
    assert step.stats.fused_steps == fused


def test_a_bad_mass_function_stops_the_fused_step_as_the_general_one():
    """A mass function's result is checked when it comes: the new tokens are registered by then,
    so the step refuses to go on, on either path, with the same message."""
    messages = []
    for fused in (False, True):
        host = Host(16, 4)
        step = make_step(host, "cpp", "dense", policy=make_policy("h2o", 6), fused=fused)
        step.add_request(0)
        with pytest.raises(BadMass) as caught:
            step.run(StepInput([0], [5], [0, 2], host.allocate(2), mass=lambda tokens: np.ones((2, 8))))
        with pytest.raises(RuntimeError, match="unusable"):
            step.run(StepInput.decode([0], mass=np.ones((1, 8))))
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


def test_an_engine_with_prefix_caching_fuses_and_cuts_its_chains_alike():
    """The reference engine's default: prefix caching on, its cut inside the fused call. Two
    requests with their own prompts evict (StreamingLLM, 8 sinks): their chains are cut at the
    first victim's block, inside the fused call; two later requests start with the first prompt's
    two cached blocks and share them (their prefill registers those shared blocks as new tokens,
    protected from the first step on). The same tokens, evictions and prefix-cache counts as with
    the general path only, every batch fused."""
    from trtllm_vtoken.runtime.config import EngineConfig
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams
    from trtllm_vtoken.runtime.simulated import MODEL_SHAPES, SimulatedModel

    def run(fused: bool):
        config = EngineConfig(tokens_per_block=4, num_blocks=96, max_batch_size=4, max_seq_len=64,
                              policy="streaming_llm", budget=12, policy_options={"n_sink": 8}, step_impl="cpp",
                              step_fused=fused, check_invariants=True)
        engine = Engine(SimulatedModel(MODEL_SHAPES["smollm2-135m"]), config, record_trace=True)
        first = [1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1]  # the simulated model's vocabulary is {0, 1}
        ids = [engine.add_request(prompt, SamplingParams(max_tokens=14, ignore_eos=True))
               for prompt in (first, [0, 1, 0, 0, 1, 1, 0, 1, 0, 0])]
        while engine.has_unfinished():
            engine.step()
        alone = (engine.kv.step_stats.fused_steps, engine.kv.step_stats.steps)
        ids += [engine.add_request(first[:8] + [i] * 5, SamplingParams(max_tokens=10, ignore_eos=True)) for i in (0, 1)]
        while engine.has_unfinished():
            engine.step()
        requests = [engine.requests[r] for r in ids]
        stats = engine.kv.step_stats
        return [(r.output_ids, r.evictions) for r in requests], engine.kv.prefix.cache.stats, alone, stats

    general, fused = run(False), run(True)
    assert general[0] == fused[0] and general[1] == fused[1]
    assert general[1].hit_tokens >= 16 and general[1].dropped_keys > 0  # cached blocks hit, chains cut
    assert general[3].fused_steps == 0
    fused_alone, steps_alone = fused[2]
    assert fused_alone == steps_alone > 0  # every batch of the first phase fused, its cuts inside the call
    assert fused[3].fused_steps == fused[3].steps > steps_alone  # and those holding shared blocks
