# SPDX-License-Identifier: Apache-2.0
"""The step's prefix-caching hooks: protected shared tokens kept on top of the budget (in the
batched selection, and with the C++ core's native pass deciding for the rows without shared
blocks), ``on_victims`` between the decision and the token table, and a shared block joining
several requests of one batch."""

from __future__ import annotations

import numpy as np
import pytest

from trtllm_vtoken.policies import make_policy
from trtllm_vtoken.step import StepInput

from tests.step.drive import Host, decided_in_python, make_step
from trtllm_vtoken.core.native import load

TPB = 4


@pytest.mark.parametrize("impl", ["python", "cpp"])
@pytest.mark.parametrize("name", ["streaming_llm", "h2o"])
def test_shared_tokens_are_kept_on_top_of_the_budget(impl, name):
    """Two requests share a 2-block prefix; a third holds nothing shared. Budget 6 applies to the
    unshared tokens: each keeps its 8 shared tokens plus 6 of its own, the third 6 in all; no
    shared token dies. With the C++ core the third row is decided natively, the others in
    Python, and the victims equal the Python core's."""
    host = Host(32, TPB)
    policy = make_policy(name, 6, **({"n_sink": 1} if name == "streaming_llm" else {}))
    step = make_step(host, impl, "dense", policy=policy)
    for req in (1, 2, 3):
        step.add_request(req)
    prefix = host.allocate(2)
    host.shared.update(prefix)  # held by requests 1 and 2 (a prefix cache's shared blocks)
    mass = np.random.default_rng(0).random((3, 20)) if name == "h2o" else None
    blocks = prefix + host.allocate(3) + prefix + host.allocate(3) + host.allocate(4)
    out = step.run(StepInput([1, 2, 3], [18, 18, 14], [0, 5, 10, 14], blocks, mass=mass))
    live = {req: step.num_live(req) for req in (1, 2, 3)}
    assert live == {1: 8 + 6, 2: 8 + 6, 3: 6}
    for i, req in enumerate((1, 2, 3)):
        victims = out.victims_of(i)
        assert not [t for t in victims if t < 8 and req != 3], "a shared token died"
    tokens = step.batch_tokens([1, 2])
    assert (tokens[:, : 2 * TPB] >= 0).all()


def test_native_and_python_cores_pick_the_same_victims_with_shared_blocks():
    def run(impl):
        host = Host(32, TPB)
        step = make_step(host, impl, "dense", policy=make_policy("h2o", 0.5))
        for req in (1, 2, 3):
            step.add_request(req)
        prefix = host.allocate(1)
        host.shared.update(prefix)
        blocks = prefix + host.allocate(2) + prefix + host.allocate(2) + host.allocate(3)
        rng = np.random.default_rng(1)
        out = [step.run(StepInput([1, 2, 3], [11, 12, 10], [0, 3, 6, 9], blocks, mass=rng.random((3, 12))))]
        for _ in range(6):
            extra = [host.allocate(1) if step.kv_len(r) % TPB == 0 else [] for r in (1, 2, 3)]
            out.append(step.run(StepInput([1, 2, 3], [1, 1, 1], np.cumsum([0] + [len(e) for e in extra]),
                                          [b for e in extra for b in e], mass=rng.random((3, 24)))))
        return [[list(o.victims_of(i)) for i in range(3)] for o in out]

    assert run("python") == run("cpp")


# the Python core; the C++ core's call with the victims decided in Python; the call deciding itself
PATHS = [("python", False), ("cpp", False), ("cpp", True)]


def sliding_window_step(impl: str, native: bool):
    if impl == "cpp" and load() is None:
        pytest.skip("the C++ core is not built")
    host = Host(16, TPB)
    policy = make_policy("sliding_window", 4)
    return host, make_step(host, impl, "dense", policy=policy if native else decided_in_python(policy))


@pytest.mark.parametrize("impl, native", PATHS)
def test_on_victims_runs_between_the_decision_and_the_table(impl, native):
    """With the Python core and inside the C++ core's call alike."""
    host, step = sliding_window_step(impl, native)
    seen = []

    def on_victims(req_ids, offsets, victims, block_ids):
        # the token table has not run the step yet (not even the new tokens are there)
        seen.append((req_ids.tolist(), offsets.tolist(), victims.tolist(), step.core.sequence(7).num_tokens,
                     block_ids(7)))

    step.on_victims = on_victims
    step.add_request(7)
    blocks = host.allocate(3)
    step.run(StepInput([7], [10], [0, 3], blocks))
    assert seen == [([7], [0, 6], [0, 1, 2, 3, 4, 5], 0, blocks)]  # the blocks as the decision saw them
    assert step.num_live(7) == 4
    assert step.stats.native_decisions == int(native)


@pytest.mark.parametrize("impl, native", PATHS)
def test_a_failing_victims_hook_leaves_the_step_unusable_with_its_own_error(impl, native):
    host, step = sliding_window_step(impl, native)

    def on_victims(req_ids, offsets, victims, block_ids):
        raise LookupError("the prefix cache lost request 7")

    step.on_victims = on_victims
    step.add_request(7)
    with pytest.raises(LookupError, match="lost request 7"):
        step.run(StepInput([7], [10], [0, 3], host.allocate(3)))
    with pytest.raises(RuntimeError, match="unusable after an earlier failure: the victims hook failed"):
        step.run(StepInput.decode([7]))


def test_a_shared_block_may_join_several_requests_of_one_batch_only_if_shared():
    host = Host(16, TPB)
    step = make_step(host, "python", "dense")
    step.add_request(1), step.add_request(2)
    block = host.allocate(1)
    with pytest.raises(ValueError, match="given twice"):
        step.run(StepInput([1, 2], [4, 4], [0, 1, 2], block + block))
    host.shared.update(block)
    step.run(StepInput([1, 2], [6, 5], [0, 2, 4], block + host.allocate(1) + block + host.allocate(1)))
    assert step.block_ids(1)[0] == step.block_ids(2)[0] == block[0]
    step.check_integrity()


@pytest.mark.parametrize("impl, native", PATHS)
def test_a_shared_slot_gets_the_h2o_mass_of_every_request_holding_it(impl, native):
    """Two requests share a prefix block; one step's mass is added to its slots once per holder,
    row after row, on every path (the native pass adds in place; the Python path as it does)."""
    if impl == "cpp" and load() is None:
        pytest.skip("the C++ core is not built")
    host = Host(16, TPB)
    policy = make_policy("h2o", 64)
    step = make_step(host, impl, "dense", policy=policy if native else decided_in_python(policy))
    prefix = host.allocate(1)
    host.shared.update(prefix)
    step.add_request(1), step.add_request(2)
    mass = np.array([[0.5] * 6, [0.25] * 6])
    step.run(StepInput([1, 2], [6, 6], [0, 2, 4], prefix + host.allocate(1) + prefix + host.allocate(1), mass=mass))
    slots = prefix[0] * TPB + np.arange(TPB)
    assert step.slots.stats["mass"][slots].tolist() == [0.75] * TPB  # each holder's mass
    own = step.block_ids(1)[1] * TPB
    assert step.slots.stats["mass"][own : own + 2].tolist() == [0.5, 0.5]
    assert step.stats.native_decisions == int(native)
