# SPDX-License-Identifier: Apache-2.0
"""Where the C++ core's call's time goes (``StepStats.core_parts``): the call's own clocks time
its decision pass always, and, inside ``compaction_timed``, the planning and committing of each
request that has holes to compact (``cpp/core/batch.h`` StepResult). The parts lie inside "core";
outside the switch, or in a step with no holes, no compaction is timed; the Python core times
none of them."""

from __future__ import annotations

import numpy as np
import pytest

from tests.step.drive import Host, make_step
from trtllm_vtoken.core.native import compaction_timed, load
from trtllm_vtoken.policies import make_policy
from trtllm_vtoken.step import StepInput
from trtllm_vtoken.step.config import CORE_PARTS

needs_cpp = pytest.mark.skipif(load() is None, reason="the C++ core is not built")


def decode(step, host: Host, steps: int, observes: bool, overlap: bool = False) -> None:
    """Four requests of 20 tokens, then ``steps`` decode steps of one token each (H2O: with a
    random mass), each started and finished as an engine makes it."""
    rng = np.random.default_rng(0)
    req_ids = [0, 1, 2, 3]
    for req in req_ids:
        step.add_request(req)
    lengths = [20] * 4

    def mass():
        return rng.random((4, max(step.kv_len(r) for r in req_ids) + 1)).astype(np.float32) if observes else None

    step.run(StepInput.of_lists(req_ids, lengths, [host.allocate(-(-n // host.tpb)) for n in lengths],
                                mass=rng.random((4, 20)).astype(np.float32) if observes else None))
    for _ in range(steps):
        fresh = [host.allocate(1) if step.kv_len(r) == step.num_blocks(r) * host.tpb else [] for r in req_ids]
        step.start(StepInput.of_lists(req_ids, [1] * 4, fresh, mass=mass()), overlap=overlap)
        host.release(step.finish().table.freed)


@needs_cpp
@pytest.mark.parametrize("overlap", [False, True])
def test_an_evicting_step_times_its_decision_plan_and_commit_inside_core(overlap):
    host = Host(64, 8)
    step = make_step(host, "cpp", "dense", policy=make_policy("h2o", 16), checks=False)
    with compaction_timed():
        decode(step, host, 12, observes=True, overlap=overlap)
    stats = step.stats
    parts = stats.core_parts
    assert stats.native_decisions == 13 and stats.tokens_evicted > 0
    assert set(parts) == set(CORE_PARTS)
    assert parts["decide"] > 0 and parts["plan"] > 0 and parts["commit"] > 0
    assert sum(parts.values()) <= stats.seconds["core"]
    assert not load().compaction_is_timed()  # switched off again after the block


@needs_cpp
def test_outside_the_switch_only_the_decision_is_timed():
    host = Host(64, 8)
    step = make_step(host, "cpp", "dense", policy=make_policy("h2o", 16), checks=False)
    decode(step, host, 12, observes=True, overlap=True)
    assert step.stats.tokens_evicted > 0 and step.stats.core_parts["decide"] > 0
    assert step.stats.core_parts["plan"] == 0.0 and step.stats.core_parts["commit"] == 0.0


@needs_cpp
def test_a_step_with_no_holes_times_no_compaction():
    host = Host(64, 8)
    step = make_step(host, "cpp", "dense", policy=make_policy("streaming_llm", 1.0), checks=False)
    with compaction_timed():
        decode(step, host, 8, observes=False)
    assert step.stats.native_decisions == 9 and step.stats.tokens_evicted == 0
    assert step.stats.core_parts["plan"] == 0.0 and step.stats.core_parts["commit"] == 0.0


def test_the_python_core_times_no_parts():
    host = Host(64, 8)
    step = make_step(host, "python", "dense", policy=make_policy("h2o", 16), checks=False)
    with compaction_timed():
        decode(step, host, 6, observes=True)
    assert step.stats.tokens_evicted > 0 and step.stats.native_decisions == 0
    assert step.stats.core_parts == dict.fromkeys(CORE_PARTS, 0.0)
