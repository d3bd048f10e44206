# SPDX-License-Identifier: Apache-2.0
"""The C++ core's decode call's bounds rule (``cpp/core/budget.h``) against the policies' own numpy
(``Budget.targets``, ``ScorePolicy.candidate_bounds``, H2O's recent share): the same integers for
count and ratio budgets, sinks, windows and protected tokens, over lengths where the float
arithmetic rounds (ratios like 0.1 and 1/3 of lengths up to 2^40)."""

from __future__ import annotations

import numpy as np
import pytest

from trtllm_vtoken.core.native import load
from trtllm_vtoken.policies import Budget, make_policy
from trtllm_vtoken.policies.h2o import H2OPolicy

pytestmark = pytest.mark.skipif(load() is None, reason="the C++ core is not built")

BUDGETS = [Budget(tokens=0), Budget(tokens=1), Budget(tokens=96), Budget(ratio=1.0), Budget(ratio=0.5),
           Budget(ratio=0.1), Budget(ratio=1 / 3), Budget(ratio=0.999)]


def lengths(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(num_tokens, num_live, protected_live): small and huge lengths, live <= tokens, protected <= live."""
    num_tokens = np.concatenate([np.arange(0, 300), rng.integers(0, 1 << 40, size=n)]).astype(np.int64)
    num_live = (num_tokens * rng.random(len(num_tokens))).astype(np.int64)
    num_live[::3] = num_tokens[::3]
    protected = (num_live * rng.random(len(num_tokens)) * (rng.random(len(num_tokens)) < 0.3)).astype(np.int64)
    return num_tokens, num_live, protected


@pytest.mark.parametrize("name", ["h2o", "streaming_llm", "sliding_window"])
@pytest.mark.parametrize("budget", BUDGETS, ids=str)
def test_the_rule_gives_the_policys_bounds(name, budget):
    native = load()
    rng = np.random.default_rng(len(name))
    options = {"h2o": [dict(recent_ratio=r, recent_window=w) for r in (0.0, 0.5, 0.3) for w in (0, 5)],
               "streaming_llm": [dict(n_sink=s, recent_window=w) for s in (0, 4) for w in (0, 64)],
               "sliding_window": [{}]}[name]
    for extra in options:
        policy = make_policy(name, budget=budget, **extra)
        rule = policy.bounds_rule()
        assert rule is not None
        num_tokens, num_live, protected = lengths(rng, 2000)
        excess, lo, hi, target = native.candidate_bounds(tuple(rule), num_tokens, num_live, protected)
        want = policy.candidate_bounds(num_tokens, num_live, protected)
        for got, expected, what in zip((excess, lo, hi), want, ("excess", "lo", "hi")):
            np.testing.assert_array_equal(got, expected, err_msg=f"{what} of {policy}")
        np.testing.assert_array_equal(target, budget.targets(num_tokens))
        # Over budget exactly where the policy wants to evict (the native decision's filter without mass).
        np.testing.assert_array_equal(num_live > target, policy.wants_to_evict(num_tokens, num_live))


def test_a_policy_that_sizes_its_window_its_own_way_has_no_rule_and_is_decided_in_python():
    """No rule, no native decision: the step decides by the policy's own bounds in Python and
    hands the victims to the call, keeping the window the subclass asked for."""
    from trtllm_vtoken.core import BlockPool
    from trtllm_vtoken.step import DecodeStep, StepConfig, StepInput

    class Wider(H2OPolicy):
        def recent_tokens_batch(self, targets):
            return super().recent_tokens_batch(targets) + 1

    assert Wider(budget=Budget(ratio=0.5)).bounds_rule() is None
    assert H2OPolicy(budget=Budget(ratio=0.5), recent_ratio=0.25).bounds_rule() == (-1, 0.5, 0, 0, 0.25, 1)
    for policy, native in ((H2OPolicy(budget=Budget(tokens=6)), 1), (Wider(budget=Budget(tokens=6)), 0)):
        pool = BlockPool(num_blocks=16, tokens_per_block=4)
        step = DecodeStep(StepConfig(compaction="dense"), pool.num_blocks, 4, policy)
        step.add_request(0)
        mass = np.arange(8, dtype=np.float32)[::-1].copy()[None, :]  # the oldest tokens weigh most
        out = step.run(StepInput([0], num_new=[8], new_block_offsets=[0, 2], new_blocks=pool.allocate(2), mass=mass))
        assert step.stats.native_decisions == native
        # Budget 6 keeps 6 of 8; H2O's window (half the budget, 3) protects ids 5-7, Wider's 4 ids 4-7:
        # the two lightest candidates go (ids 3 and 4, or 2 and 3).
        assert list(out.victims_of(0)) == ([3, 4] if native else [2, 3])


def test_the_native_call_checks_its_rule():
    """A rule out of range is refused before anything changes; the rule is required."""
    from trtllm_vtoken.step.slots import SlotMap

    native = load()
    slots = SlotMap(4, 8, native)
    table = native.TokenTable(8)
    empty = np.zeros(0, dtype=np.int64)
    call = dict(layout=slots.native_layout(), table=table, req_ids=empty, rows=empty, num_new=empty,
                offsets=np.zeros(1, dtype=np.int64), blocks=empty, selector=1, compaction=0,
                fragmentation_threshold=1, pressure=False)
    native.slots_decide_step(**call, rule=(-1, 0.5, 4, 0, 0.0, 1))  # an empty batch
    with pytest.raises(TypeError):
        native.slots_decide_step(**call)
    for bad in [(-2, 0.5, 0, 0, 0.0, 1), (-1, 0.0, 0, 0, 0.0, 1), (-1, 1.5, 0, 0, 0.0, 1), (8, 1.0, -1, 0, 0.0, 1),
                (8, 1.0, 0, -1, 0.0, 1), (8, 1.0, 0, 0, 1.5, 1), (8, 1.0, 0, 0, 0.0, 0)]:
        with pytest.raises(ValueError, match="bounds rule"):
            native.slots_decide_step(**call, rule=bad)
        with pytest.raises(ValueError, match="out of range"):
            native.candidate_bounds(bad, empty, empty, empty)


def test_the_rule_is_kept_until_an_attribute_of_the_policy_is_set():
    policy = make_policy("h2o", budget=Budget(tokens=96), n_sink=4, recent_ratio=0.5)
    first = policy.bounds_rule()
    assert policy.bounds_rule() is first  # a step asks every iteration: worked out once
    policy.budget = Budget(ratio=0.25)
    assert policy.bounds_rule() == (-1, 0.25, 4, 0, 0.5, 1)
    policy.n_sink, policy.recent_ratio = 8, 0.0
    assert policy.bounds_rule() == (-1, 0.25, 8, 0, 0.0, 1)
    assert make_policy("h2o", budget=Budget(tokens=96), n_sink=4, recent_ratio=0.5).bounds_rule() == first
