# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import add_sequence, make_table
from trtllm_vtoken.policies import POLICIES, Budget, make_policy, policy_view

ALL = POLICIES.names()


def test_every_required_policy_is_registered():
    assert ALL == ["h2o", "random", "scissorhands", "sliding_window", "streaming_llm"]


def _feed(policy, req_id: int, num_tokens: int, steps: int = 3) -> None:
    rng = np.random.default_rng(1)
    ids = np.arange(num_tokens)
    for _ in range(steps):
        policy.observe(req_id, ids, rng.random(num_tokens))


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("budget", [8, 20, 0.5])
def test_policy_meets_budget_and_spares_protected_tokens(name, budget):
    pool, table = make_table(num_blocks=32, tokens_per_block=4)
    blocks = add_sequence(pool, table, 0, 40)
    pool.share(blocks[:1])  # tokens 0-3 are protected
    policy = make_policy(name, budget)
    _feed(policy, 0, 40)
    evict = policy.select(policy_view(table, 0))
    # The 4 protected tokens are kept on top of the budget, which applies to the other 36.
    target = 4 + Budget.parse(budget).target(40 - 4)
    assert len(evict) == 40 - target
    assert evict.dtype == np.int64 and np.all(np.diff(evict) > 0)
    assert not set(evict.tolist()) & {0, 1, 2, 3}
    table.evict_tokens(0, evict)  # never raises: nothing protected, dead or repeated
    assert table.num_live(0) == target
    assert len(policy.select(policy_view(table, 0))) == 0  # within budget now


@pytest.mark.parametrize("name", ALL)
def test_policy_is_deterministic(name):
    picks = []
    for _ in range(2):
        pool, table = make_table(num_blocks=32, tokens_per_block=4)
        add_sequence(pool, table, 5, 40)
        policy = make_policy(name, 10)
        _feed(policy, 5, 40)
        picks.append(policy.select(policy_view(table, 5)).tolist())
    assert picks[0] == picks[1]


@pytest.mark.parametrize("name", ALL)
def test_policy_evicts_what_it_can_when_protection_blocks_the_budget(name):
    pool, table = make_table(num_blocks=32, tokens_per_block=4)
    blocks = add_sequence(pool, table, 0, 12)
    pool.share(blocks)  # every token protected
    assert make_policy(name, 4).select(policy_view(table, 0)).tolist() == []


def test_streaming_llm_keeps_sinks_and_recent_window():
    pool, table = make_table(num_blocks=32, tokens_per_block=4)
    add_sequence(pool, table, 0, 20)
    evict = make_policy("streaming_llm", 10, n_sink=4).select(policy_view(table, 0))
    assert evict.tolist() == list(range(4, 14))  # keeps 0-3 and 14-19


def test_sliding_window_keeps_only_recent():
    pool, table = make_table(num_blocks=32, tokens_per_block=4)
    add_sequence(pool, table, 0, 20)
    assert make_policy("sliding_window", 5).select(policy_view(table, 0)).tolist() == list(range(15))


def test_h2o_keeps_heavy_hitters_and_recent_half():
    pool, table = make_table(num_blocks=32, tokens_per_block=4)
    add_sequence(pool, table, 0, 16)
    policy = make_policy("h2o", 6)  # 3 recent (13-15) + 3 heavy hitters
    attention = np.zeros(16)
    attention[[2, 7, 9]] = [5.0, 3.0, 4.0]
    attention[4] = 1.0
    policy.observe(0, np.arange(16), attention)
    keep = set(range(16)) - set(policy.select(policy_view(table, 0)).tolist())
    assert keep == {2, 7, 9, 13, 14, 15}


def test_scissorhands_counts_persistence_over_history_window():
    pool, table = make_table(num_blocks=32, tokens_per_block=4)
    add_sequence(pool, table, 0, 12)
    policy = make_policy("scissorhands", 4, history_window=2, recent_window=2)
    ids = np.arange(12)
    hot = np.full(12, 0.01)
    hot[3] = 1.0
    policy.observe(0, ids, hot)  # token 3 important once, long ago: expires from the window
    later = np.full(12, 0.01)
    later[[5, 6]] = 1.0
    policy.observe(0, ids, later)
    policy.observe(0, ids, later)
    keep = set(range(12)) - set(policy.select(policy_view(table, 0)).tolist())
    assert keep == {5, 6, 10, 11}


def test_random_is_seeded_per_request():
    pool, table = make_table(num_blocks=32, tokens_per_block=4)
    add_sequence(pool, table, 0, 20)
    add_sequence(pool, table, 1, 20)
    a = make_policy("random", 10, seed=3)
    b = make_policy("random", 10, seed=4)
    assert a.select(policy_view(table, 0)).tolist() != a.select(policy_view(table, 1)).tolist()
    assert make_policy("random", 10, seed=3).select(policy_view(table, 0)).tolist() == \
        make_policy("random", 10, seed=3).select(policy_view(table, 0)).tolist()
    assert len(b.select(policy_view(table, 0))) == 10


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: make_policy("h20", 8), KeyError, "Unknown eviction policy 'h20'. Known: h2o, random"),
        (lambda: make_policy("h2o", -3), ValueError, "must not be negative"),
        (lambda: make_policy("h2o", 1.5), ValueError, r"ratio must lie in \(0, 1\]"),
        (lambda: make_policy("h2o", "lots"), ValueError, "neither a token count nor a ratio"),
        (lambda: make_policy("h2o", 8, windw=3), ValueError, r"unknown option\(s\) \['windw'\]"),
        # private state and class constants are not options (nor listed as known ones)
        (lambda: make_policy("h2o", 8, _mass=None), ValueError,
         r"unknown option\(s\) \['_mass'\] for policy 'h2o'; known: \['n_sink', 'prefill_window', 'recent_ratio', "
         r"'recent_window'\]$"),
        (lambda: make_policy("scissorhands", 8, slot_stats={}), ValueError, r"unknown option\(s\) \['slot_stats'\]"),
        (lambda: make_policy("streaming_llm", 8, n_sink=-1), ValueError, "must be >= 0"),
    ],
)
def test_bad_policy_configuration(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_budget_parsing():
    assert Budget.parse("512") == Budget(tokens=512)
    assert Budget.parse(0.25) == Budget(ratio=0.25)
    assert Budget.parse("0.5").target(9) == 5
    assert Budget(tokens=100).target(40) == 40


@pytest.mark.parametrize("plain", [Budget(tokens=10), Budget(tokens=3), Budget(ratio=0.5), Budget(ratio=0.3)])
@pytest.mark.parametrize("unit", [1, 2, 4, 16])
def test_most_kept_bounds_every_target_on_the_way(plain, unit):
    """A unit budget's target is not monotone in the length (count 10, unit 4: 10 kept at length
    10, 8 at 12, 7 at 31); admission reserves ``most_kept`` of the final length, which bounds the
    target at every length before it (a plain budget's final target itself)."""
    budget = plain.in_units(unit)
    for final in range(1, 80):
        on_the_way = max(budget.target(n) for n in range(1, final + 1))
        assert on_the_way <= budget.most_kept(final) <= max(plain.target(final), unit - 1)
        if unit == 1:
            assert budget.most_kept(final) == plain.target(final) == on_the_way
    assert Budget(tokens=10, unit=4).target(31) == 7 < Budget(tokens=10, unit=4).most_kept(31) == 10
