# SPDX-License-Identifier: Apache-2.0
"""Lazy compaction in the background: a plan's copy starts in its step, the plan commits at the
request's next step once the copy has finished; meanwhile the table (and so the attention's mask)
still points at the sources. Same decisions as committing at once; conservation (I1) checked at
every commit; on CUDA, the compute stream does not wait for the copy. Under memory pressure the
plans commit in their own step instead, the next forward ordered after their copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.step.drive import Host, make_step
from trtllm_vtoken.policies import make_policy
from trtllm_vtoken.step import StepInput


def attention(salt: int):
    """Mass as a function of the token (as attention is), not of where the token sits."""
    return lambda tokens: np.where(tokens >= 0, np.modf(np.sin(tokens * 12.9898 + salt * 78.233) * 43758.5453)[0] ** 2, 0)


def decode(step, host, salt, req_ids):
    blocks = []
    for req in req_ids:
        need = -(-(step.kv_len(req) + 1) // host.tpb) - step.num_blocks(req)
        blocks.append(host.allocate(max(need, 0)))
    out = step.run(StepInput.decode(req_ids, blocks, mass=attention(salt)))
    host.release(out.table.freed)
    return out


@pytest.mark.parametrize("impl", ["python", "auto"])
def test_background_commits_a_step_later_with_the_same_decisions(impl):
    hosts = [Host(128, 4, seed=1), Host(128, 4, seed=1)]
    steps = [make_step(hosts[0], impl, "lazy"), make_step(hosts[1], impl, "lazy-background")]
    for step, host in zip(steps, hosts):
        step.policy = None
        for req, n in enumerate((13, 22)):
            step.add_request(req, make_policy("h2o", 0.5))
            blocks = host.allocate(-(-n // 4))
            step.run(StepInput([req], [n], [0, len(blocks)], blocks, mass=np.ones((1, n))))
    pending = set()
    for salt in range(30):
        now, later = (decode(step, host, salt, [0, 1]) for step, host in zip(steps, hosts))
        assert now.victims.tolist() == later.victims.tolist()  # decisions never depend on the layout
        flying = set(steps[1].background.requests())
        for i, req in enumerate((0, 1)):
            if req in pending:  # planned last step: committed now, as the synchronous step did then
                assert later.table.moves_of(i) or later.table.freed_of(i)
            if req in flying:  # planned now: the table still points at the sources
                src = steps[1].background.flight(req).src.tolist()
                ids, slots = steps[1].core.live_slots(req)
                assert set(src) <= set(slots.tolist())
        pending = set(flying)
    assert steps[1].stats.compactions > 0 and steps[1].stats.invariant_checks > 0
    assert steps[0].stats.blocks_freed >= steps[1].stats.blocks_freed > 0
    for req in (0, 1):  # the same live tokens, each with the same KV
        (ids0, slots0), (ids1, slots1) = steps[0].core.live_slots(req), steps[1].core.live_slots(req)
        assert ids0.tolist() == ids1.tolist()
        for s0, s1 in zip(slots0.tolist(), slots1.tolist()):
            assert torch.equal(hosts[0].kv[s0 // 4, :, :, :, s0 % 4], hosts[1].kv[s1 // 4, :, :, :, s1 % 4])


def test_a_request_leaving_with_a_plan_in_flight_waits_for_its_copy():
    host = Host(64, 4)
    step = make_step(host, "auto", "lazy-background")
    step.add_request(0, make_policy("streaming_llm", 6, n_sink=1))
    blocks = host.allocate(5)
    step.run(StepInput([0], [20], [0, 5], blocks))
    assert 0 in step.background.requests() and step.relocating_blocks()
    host.release(step.remove_request(0))
    assert not step.background.requests() and not step.relocating_blocks()


@pytest.mark.parametrize("impl", ["python", "auto"])
def test_under_pressure_the_plans_commit_in_their_own_step(impl):
    """``StepInput.pressure``: a plan made in the step and a plan in flight from an earlier one
    commit at the step's end, and the layout is lazy compaction's without the background (a plan
    deferred there held the blocks the next reservation needed: a request running alone in a
    pool just big enough for it was preempted)."""
    hosts = [Host(64, 4, seed=2), Host(64, 4, seed=2)]
    steps = [make_step(hosts[0], impl, "lazy"), make_step(hosts[1], impl, "lazy-background")]
    outs = []
    for step, host in zip(steps, hosts):
        step.add_request(0, make_policy("streaming_llm", 6, n_sink=1))
        step.add_request(1, make_policy("streaming_llm", 6, n_sink=1))
        first = step.run(StepInput([0], [20], [0, 5], host.allocate(5)))  # no pressure: in flight
        host.release(first.table.freed)
        out = step.run(StepInput([0, 1], [0, 20], [0, 0, 5], host.allocate(5), pressure=True))
        host.release(out.table.freed)
        outs.append(out)
    assert not steps[1].background.requests()
    assert outs[1].table.freed_of(0) and outs[1].table.freed_of(1)  # the earlier plan and the new one
    for req in (0, 1):
        (ids0, slots0), (ids1, slots1) = (step.core.live_slots(req) for step in steps)
        assert ids0.tolist() == ids1.tolist() and steps[0].num_blocks(req) == steps[1].num_blocks(req)
        for s0, s1 in zip(slots0.tolist(), slots1.tolist()):
            assert torch.equal(hosts[0].kv[s0 // 4, :, :, :, s0 % 4], hosts[1].kv[s1 // 4, :, :, :, s1 % 4])
    assert sorted(hosts[0].free) == sorted(hosts[1].free)


def delayed_copy_step():
    """(pool, step): a CUDA KV pool whose copies wait ~0.1 s on the side stream, and a lazy
    background step over it with request 0 (StreamingLLM, 6 tokens, one sink)."""
    from trtllm_vtoken.core import BlockPool
    from trtllm_vtoken.reclaim.copy import TorchCopyExecutor
    from trtllm_vtoken.step import DecodeStep, StepConfig

    pool = BlockPool(32, 4)
    kv = torch.randn(32, 2, 2, 1, 4, 8, device="cuda")
    executor = TorchCopyExecutor([kv], copy_delay_cycles=200_000_000)
    step = DecodeStep(StepConfig("lazy", background=True, check_invariants=False), 32, 4,
                      make_policy("streaming_llm", 6, n_sink=1), executor, pool.is_shared, lambda: pool.shared)
    step.add_request(0)
    return pool, step


@pytest.mark.cuda
def test_under_pressure_a_plan_commits_before_its_copy_has_finished_and_the_stream_waits_for_it():
    """A copy delayed on the side stream: under pressure its plan commits at once, and work
    queued on the compute stream after the step runs after the copy (the forward reads the
    moved KV)."""
    pool, step = delayed_copy_step()
    stream = torch.cuda.current_stream()
    out = step.run(StepInput([0], [20], [0, 5], pool.allocate(5), stream=stream, pressure=True))
    assert 0 not in step.background.requests() and out.table.freed_of(0)
    after = torch.cuda.Event()
    after.record(stream)
    after.synchronize()
    assert out.copy.done()  # the compute stream's work waited for the copy


@pytest.mark.cuda
def test_the_forward_does_not_wait_for_a_background_copy():
    """A copy delayed on the side stream (~0.1 s): work queued on the compute stream after the
    step completes while the copy still runs (a dense step would have queued a wait on it), and
    the plan commits only at a step after the copy's event has completed."""
    pool, step = delayed_copy_step()
    stream = torch.cuda.current_stream()
    out = step.run(StepInput([0], [20], [0, 5], pool.allocate(5), stream=stream))
    assert 0 in step.background.requests() and out.copy is not None
    after = torch.cuda.Event()
    after.record(stream)  # the next forward's work would be queued here
    after.synchronize()
    assert not out.copy.done()  # the compute stream ran ahead of the copy
    step.run(StepInput([0], [1], [0, 1], pool.allocate(1), stream=stream))
    assert 0 in step.background.requests()  # its copy is still running: no commit
    out.copy.synchronize()
    later = step.run(StepInput([0], [0], [0, 0], [], stream=stream))
    assert later.table.freed_of(0) and 0 not in step.background.requests()


@pytest.mark.parametrize("impl", ["python", "auto"])
def test_a_plan_that_no_longer_applies_leaves_the_step_unusable(impl):
    """A plan in flight whose tokens left their sources (here: committed behind the step's back)
    cannot commit: RuntimeError naming the request, in both cores' words; the step then refuses
    every later batch."""
    host = Host(64, 4)
    step = make_step(host, impl, "lazy-background")
    step.add_request(0, make_policy("streaming_llm", 6, n_sink=1))
    step.run(StepInput([0], [20], [0, 5], host.allocate(5)))
    flight = step.background.flight(0)
    assert flight is not None and len(flight.src) and step.background.requests() == [0]
    step.core.commit_lazy(0, flight.tokens.tolist(), flight.src.tolist(), flight.dst.tolist(), flight.blocks.tolist())
    with pytest.raises(RuntimeError, match="request 0: a background compaction could not commit: "):
        step.run(StepInput([0], [0], [0, 0], []))
    with pytest.raises(RuntimeError, match="unusable after an earlier failure"):
        step.run(StepInput([0], [0], [0, 0], []))
