# SPDX-License-Identifier: Apache-2.0
"""The step served by the C++ core equals the step served by the Python core: the same random
batches (prefill and decode rows, five policies and opted-out requests mixed in one batch,
requests joining and leaving, blocks becoming shared) give the same victims, moves, freed blocks,
lengths, tables and KV, with I1/I2 checked around every step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.step.drive import Host, make_step, random_policies, same_batches, share_a_block
from trtllm_vtoken.core.native import load

pytestmark = pytest.mark.skipif(load() is None, reason="the C++ core is not built")


def outputs_equal(a, b) -> None:
    for name in ("req_ids", "victim_offsets", "victims", "lost", "num_tokens"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    for name, x, y in zip(a.table._fields, a.table, b.table):
        assert np.array_equal(x, y), name


def tables_equal(a, b) -> None:
    assert a.request_ids() == b.request_ids()
    # The batch layouts too: the C++ core updates it in one call each side of its step
    # (cpp/core/slots.h), the Python core through SlotMap's own methods.
    for name in ("tokens", "block_table", "num_blocks_of", "kv_len", "num_tokens", "num_live"):
        assert np.array_equal(getattr(a.slots, name), getattr(b.slots, name)), name
    assert a.slots.stats.keys() == b.slots.stats.keys()
    held = a.slots.tokens >= 0  # statistics of slots without a live token are never read
    for name in a.slots.stats:
        assert np.array_equal(a.slots.stats[name][held], b.slots.stats[name][held], equal_nan=True), name
    num_blocks = a.slots.num_blocks
    assert [a.core.table.holders_of(k) for k in range(num_blocks)] == \
        [b.core.table.holders_of(k) for k in range(num_blocks)]
    for req in a.request_ids():
        sa, sb = a.core.sequence(req), b.core.sequence(req)
        nb = len(sa.block_ids) * a.tokens_per_block
        assert (sa.block_ids, sa.kv_len, sa.num_tokens, sa.num_live, sa.version) == \
            (sb.block_ids, sb.kv_len, sb.num_tokens, sb.num_live, sb.version), req
        assert np.array_equal(sa.token_at[:nb], sb.token_at[:nb]) and sorted(sa.pending_dead) == sorted(sb.pending_dead)
        assert np.array_equal(sa.live[: sa.num_tokens], sb.live[: sb.num_tokens])


@pytest.mark.filterwarnings("error::RuntimeWarning")  # -inf + inf is NaN, as meant, and silent
@settings(max_examples=40, deadline=None)
@given(compaction=st.sampled_from(["dense", "lazy", "dead-blocks", "lazy-background"]), tpb=st.sampled_from([2, 4, 8]),
       steps=st.integers(1, 25), threshold=st.integers(1, 3), seed=st.integers(0, 2**31), non_finite=st.booleans())
def test_cpp_step_equals_python_step(compaction, tpb, steps, threshold, seed, non_finite):
    """``non_finite``: masses with NaN and infinities (an attention that overflowed) rank alike in
    both cores: NaN after +inf, as numpy sorts (the C++ core once crashed on a row all NaN)."""
    rng = np.random.default_rng(seed)
    hosts = [Host(256, tpb, seed), Host(256, tpb, seed)]
    policies = [random_policies(np.random.default_rng(seed)) for _ in hosts]
    steps_ = [make_step(h, impl, compaction, threshold, p[0]) for h, impl, p in zip(hosts, ("python", "cpp"), policies)]
    next_req = 0
    for _ in range(steps):
        joining = list(range(next_req, next_req + int(rng.integers(0, 3))))
        next_req += len(joining)
        choice = [int(rng.integers(0, len(policies[0]))) for _ in joining]
        for step, pols in zip(steps_, policies):
            for req, k in zip(joining, choice):
                step.add_request(req, pols[k])
        if not steps_[0].request_ids():
            continue
        share_a_block(rng, steps_, hosts, 0.1)
        inputs = same_batches(rng, steps_, hosts, joining, non_finite)
        outs = [step.run(inp) for step, inp in zip(steps_, inputs)]
        outputs_equal(*outs)
        for host, out in zip(hosts, outs):
            host.release(out.table.freed)
        tables_equal(*steps_)
        assert torch.equal(hosts[0].kv, hosts[1].kv)
        for req in steps_[0].request_ids():  # some finish
            if rng.random() < 0.08:
                for step, host in zip(steps_, hosts):
                    host.release(b for b in step.remove_request(req) if b not in host.shared)
    for step in steps_:
        step.check_integrity()
    assert steps_[0].stats.tokens_evicted == steps_[1].stats.tokens_evicted


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("name", ["h2o", "scissorhands"])
def test_an_attention_that_overflowed_ranks_alike_and_silently(name):
    """Every slot takes +inf one step, then every other slot -inf (an attention that overflowed
    both ways): H2O's sums and Scissorhands' means become NaN in both cores, alike, and numpy
    warns of none of it (the Python core adds the slot-wise mass itself, ``BatchDecision.add_mass``)."""
    from trtllm_vtoken.policies import make_policy
    from trtllm_vtoken.step import StepInput

    outs = []
    for impl in ("python", "cpp"):
        host = Host(16, 4)
        step = make_step(host, impl, "dense", policy=make_policy(name, 6))
        step.add_request(0), step.add_request(1)
        ran = [step.run(StepInput([0, 1], [9, 7], [0, 3, 5], host.allocate(5), mass=np.full((2, 9), np.inf)))]
        for overflowed in (True, False):
            width = max(step.kv_len(0), step.kv_len(1)) + 1
            mass = np.where(np.arange(width) % 2, -np.inf, np.inf) if overflowed else np.ones(width)
            blocks = [host.allocate(-(-(step.kv_len(r) + 1) // 4) - step.num_blocks(r)) for r in (0, 1)]
            ran.append(step.run(StepInput.of_lists([0, 1], [1, 1], blocks, mass=np.stack([mass, mass]))))
            host.release(ran[-1].table.freed)
        outs.append(ran)
    for a, b in zip(*outs):
        outputs_equal(a, b)
    assert sum(len(out.victims) for out in outs[0]) > 0


def bad_input_errors(impl: str) -> list[str]:
    """Runs bad batches through a step of ``impl``; checks that none changed anything; returns
    the errors, in order."""
    from trtllm_vtoken.policies import make_policy
    from trtllm_vtoken.step import StepInput

    host = Host(16, 4)
    step = make_step(host, impl, "dense", policy=make_policy("h2o", 6))
    step.add_request(0), step.add_request(1)
    step.run(StepInput([0, 1], [6, 2], [0, 2, 3], host.allocate(3), mass=np.ones((2, 6))))
    held = [step.block_ids(0), step.block_ids(1)]
    before = (step.table_digest(), step.slots.tokens.copy(), step.slots.block_table.copy(), step.kv_len(0))
    spare = host.allocate(1)
    bad = [StepInput([0], [1], [0, 0], [], mass=None),  # H2O needs the mass
           StepInput([0], [1], [0, 0], [], mass=np.ones((1, 5))),  # narrower than the request
           StepInput([0], [3], [0, 0], [], mass=np.ones((1, 9))),  # 3 new tokens do not fit
           StepInput([0, 0], [1, 1], [0, 0, 0], [], mass=np.ones((2, 9))),  # a request twice
           StepInput([0], [1], [0, 1], [99], mass=np.ones((1, 9))),  # a block outside the pool
           StepInput([0], [1], [0, 2], spare, mass=np.ones((1, 9))),  # offsets past the blocks
           StepInput([0, 1], [-1, -2], [0, 0, 0], [], mass=np.ones((2, 9))),  # negative counts
           StepInput([0, 1], [1, 1], [0, 1, 2], spare + spare, mass=np.ones((2, 9))),  # an unshared block twice
           StepInput([0], [1], [0, 1], [held[1][0]], mass=np.ones((1, 9))),  # request 1's block
           StepInput([0], [1], [0, 1], [held[0][0]], mass=np.ones((1, 9))),  # its own block again
           StepInput([0], [1], [0], [], mass=np.ones((1, 9))),  # offsets of the wrong size
           StepInput([7], [1], [0, 0], [], mass=np.ones((1, 9)))]  # an unknown request
    # New blocks one list per request: an array, a range or a bare id per request, or ids that are
    # no int64 integers (the spare block as a float would be truncated to it)
    bad += [StepInput.of_lists([0], [1], [blocks], mass=np.ones((1, 9)))
            for blocks in (np.array(spare), range(spare[0], spare[0] + 1), spare[0], [float(spare[0])], ["a"], [2**63])]
    errors = []
    for inp in bad:
        with pytest.raises((ValueError, KeyError)) as caught:
            step.run(inp)
        errors.append(f"{caught.type.__name__}: {caught.value}")
        assert (step.table_digest(), step.kv_len(0)) == (before[0], before[3])
        assert np.array_equal(step.slots.tokens, before[1]) and np.array_equal(step.slots.block_table, before[2])
    step.run(StepInput([0], [1], [0, 0], [], mass=np.ones((1, 7))))  # still usable
    return errors


def test_bad_input_changes_nothing_and_both_cores_refuse_it_alike():
    """Every check of a batch runs before the step changes anything (mass shape included); the
    C++ core's registration call checks the new blocks and tokens in the Python step's words."""
    python, native = bad_input_errors("python"), bad_input_errors("cpp")
    assert python == native
    assert "step: num_new must be >= 0, got [-1, -2]" in python[6]
    assert python[-6:] == ["ValueError: slots: new blocks must be one sequence of block ids per request"] * 6
    held = [e for e in python if "held by a request already" in e]  # a block given to a second request
    assert len(held) == 2 and held[0].startswith("ValueError: step: new block ")


@pytest.mark.parametrize("compaction", ["dense", "lazy"])
def test_id_scored_victims_from_the_table_include_this_steps_new_tokens(compaction):
    """StreamingLLM and sliding window decide from the C++ table's liveness (``lowest_live_ids``),
    which does not hold the step's new tokens yet: with no recent window left (budget = sinks, a
    window of 0) the newest tokens are candidates too, at the positions after the table's
    length. Both cores evict the same ids, step after step, prefill included."""
    from trtllm_vtoken.policies import make_policy
    from trtllm_vtoken.step import StepInput

    hosts = [Host(64, 4), Host(64, 4)]
    policies = [[make_policy("streaming_llm", 3, n_sink=3), make_policy("sliding_window", 2)] for _ in hosts]
    steps_ = [make_step(h, impl, compaction, policy=None) for h, impl in zip(hosts, ("python", "cpp"))]
    for step, (sink, window) in zip(steps_, policies):
        step.add_request(0, sink), step.add_request(1, window)
    evicted = []
    for n in (9, 1, 2, 1, 5, 1):  # prompts, then decode and a few multi-token steps
        outs = []
        for step, host in zip(steps_, hosts):
            need = [-(-(step.kv_len(r) + n) // 4) - step.num_blocks(r) for r in (0, 1)]
            blocks = [host.allocate(max(k, 0)) for k in need]
            outs.append(step.run(StepInput([0, 1], [n, n], np.cumsum([0] + [len(b) for b in blocks]),
                                           [b for bl in blocks for b in bl])))
            host.release(outs[-1].table.freed)
        outputs_equal(*outs)
        tables_equal(*steps_)
        evicted.append([outs[1].victims_of(0), outs[1].victims_of(1)])
    assert evicted[0] == [[3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6]]  # the prompt beyond the sinks / window
    assert evicted[1] == [[9], [7]]  # the newest token itself goes: no recent window is left


@pytest.mark.parametrize("impl", ["python", "cpp"])
def test_a_row_of_none_and_a_row_of_two_are_not_a_decode_step(impl):
    """New tokens [0, 2] sum to the row count as a decode step's [1, 1] do: row 0 registers
    nothing and row 1 both its tokens, checked against the table (I1/I2)."""
    from trtllm_vtoken.step import DecodeStep, StepConfig, StepInput

    step = DecodeStep(StepConfig("dense", impl=impl, check_invariants=True), 16, 4)
    step.add_request(0), step.add_request(1)
    step.run(StepInput.of_lists([0, 1], [4, 3], [[0], [1]]))
    step.run(StepInput.of_lists([0, 1], [0, 2], [[], [2]]))
    assert step.batch_tokens([0, 1]).tolist() == [[0, 1, 2, 3, -1, -1, -1, -1], [0, 1, 2, 3, 4, -1, -1, -1]]
    assert (step.slots.tokens[16 * 4:] == -1).all()  # nothing written past the pool (the padding block)
