# SPDX-License-Identifier: Apache-2.0
"""``select_batch`` (vectorised over a batch) picks exactly what ``select`` picks request by
request, for every policy and budget, with holes, protected tokens, sinks, windows, ties and
rows evicting several tokens at once; and a policy written for one request runs in a batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from tests.helpers import add_sequence, make_table
from trtllm_vtoken.policies import POLICIES, Budget, PolicyView, ScorePolicy, make_policy, policy_view
from trtllm_vtoken.policies.batch import BatchView

OPTIONS = {"streaming_llm": {"n_sink": 3}, "scissorhands": {"history_window": 4, "recent_window": 3},
           "h2o": {"recent_ratio": 0.3}}


def batch_of(table, req_ids, stats, protected_blocks):
    """The batch view of the table's requests (positions = the table's positions)."""
    tpb = table.tokens_per_block
    width = max(table.num_blocks(r) for r in req_ids) * tpb
    tokens = np.full((len(req_ids), width), -1, dtype=np.int32)
    protected = np.zeros((len(req_ids), width), dtype=bool)
    for i, r in enumerate(req_ids):
        seq = table.seq(r)
        held = seq.token_at[: seq.kv_len]
        live = table.position_live_mask(r)
        tokens[i, : seq.kv_len] = np.where(live, held, -1)
        for k, b in enumerate(seq.block_ids):
            protected[i, k * tpb : (k + 1) * tpb] = b in protected_blocks
    return BatchView(np.array(req_ids), np.array([table.num_tokens(r) for r in req_ids]),
                     np.array([table.num_live(r) for r in req_ids]), tokens,
                     protected if protected.any() else None, stats)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # -inf + inf is NaN, as meant, and silent
@pytest.mark.parametrize("name", POLICIES.names())
@pytest.mark.parametrize("budget", [6, 17, 0.4, 0.9])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("non_finite", [False, True])
def test_batched_selection_equals_per_request_selection(name, budget, seed, non_finite):
    """``non_finite``: the masses hold NaN, +inf and -inf too (an attention that overflowed), and
    one request's are all NaN: both order them as the exact sort does (NaN after +inf)."""
    rng = np.random.default_rng(seed)
    pool, table = make_table(num_blocks=128, tokens_per_block=4)
    req_ids = list(range(6))
    for r in req_ids:
        add_sequence(pool, table, r, int(rng.integers(1, 40)))
    for r in req_ids:  # holes, as in lazy mode
        live = table.live_ids(r)
        if len(live) > 2:
            table.evict_tokens(r, rng.choice(live, size=int(rng.integers(0, len(live) // 2)), replace=False))
    shared = set()
    for r in req_ids[:3]:  # their first blocks become shared: live tokens there are protected
        pool.share(table.block_ids(r)[:1])
        shared |= set(table.block_ids(r)[:1])
    single, batched = (make_policy(name, budget, **OPTIONS.get(name, {})) for _ in range(2))
    width = max(table.num_blocks(r) for r in req_ids) * 4
    stats = {k: np.zeros((len(req_ids), width), dtype=d) for k, d in batched.slot_stats.items()}
    for _ in range(3):
        # Ties on purpose: masses drawn from a few values.
        mass = rng.choice([0.0, 0.25, 0.5, 1.0] + [np.nan, np.inf, -np.inf] * non_finite, size=(len(req_ids), width))
        if non_finite:
            mass[3] = np.nan
        view = batch_of(table, req_ids, stats, shared)
        batched.observe_batch(view, mass)
        for i, r in enumerate(req_ids):
            live = table.position_live_mask(r)
            kv_len = table.kv_len(r)
            single.observe(r, table.seq(r).token_at[:kv_len][live].astype(np.int64), mass[i, :kv_len][live])
    view = batch_of(table, req_ids, stats, shared)
    picks = batched.select_batch(view)
    assert (np.diff(picks.rows) >= 0).all()
    for i, r in enumerate(req_ids):
        assert picks.of_row(view, i).tolist() == single.select(policy_view(table, r)).tolist(), r


@dataclass
class EveryThirdPolicy(ScorePolicy):
    """A policy written for one request only (no batched method): evicts ids 0 mod 3 first."""

    def score(self, view: PolicyView) -> np.ndarray:
        return (view.live_ids % 3 != 0).astype(float) + view.live_ids / 1e6


def test_a_policy_written_for_one_request_runs_in_a_batch():
    pool, table = make_table(num_blocks=32, tokens_per_block=4)
    for r in range(3):
        add_sequence(pool, table, r, 10 + r)
    policy = EveryThirdPolicy(budget=Budget(tokens=6))
    view = batch_of(table, [0, 1, 2], {}, set())
    picks = policy.select_batch(view)
    for i in range(3):
        assert picks.of_row(view, i).tolist() == policy.select(policy_view(table, i)).tolist()


@pytest.mark.filterwarnings("error::RuntimeWarning")  # -inf + inf is NaN, as meant, and silent
def test_one_victim_a_row_orders_non_finite_scores_as_the_exact_sort():
    """Rows evicting one token each (a decode step) take the vectorised path: the lowest score,
    ties to the lower id, -inf < numbers < +inf < NaN as ``np.lexsort`` orders them, and only a
    candidate (not a sink, a recent token or an empty slot, whatever their scores) is a victim."""
    rows_mass = {0: [1.0, np.nan, 0.5, np.nan], 1: [np.nan] * 4, 2: [np.nan, np.inf, np.nan, np.inf],
                 3: [np.inf] * 4, 4: [2.0, -np.inf, np.nan, -np.inf], 5: [0.25, 0.25, np.nan, 0.25]}
    pool, table = make_table(num_blocks=32, tokens_per_block=4)
    single, batched = (make_policy("h2o", 8, n_sink=2, recent_window=2, recent_ratio=0.0) for _ in range(2))
    for r, middle in rows_mass.items():  # 9 tokens, 8 kept: ids 2-6 are the candidates, 6 NaN
        add_sequence(pool, table, r, 9)
        mass = np.array([-np.inf, -np.inf, *middle, np.nan, -np.inf, -np.inf])[None]  # sinks, recent: -inf
        view = batch_of(table, [r], {"mass": np.zeros((1, 12), dtype=np.float32)}, set())
        single.observe(r, np.arange(9), mass[0, :9])
        batched.observe_batch(view, np.pad(mass, ((0, 0), (0, 3))))
        if r == 0:
            stats = view.stats
        else:
            stats = {"mass": np.concatenate([stats["mass"], view.stats["mass"]])}
    view = batch_of(table, list(rows_mass), stats, set())
    picks = batched.select_batch(view)
    got = [picks.of_row(view, i).tolist() for i in range(len(rows_mass))]
    assert got == [single.select(policy_view(table, r)).tolist() for r in rows_mass]
    assert got == [[4], [2], [3], [2], [3], [2]]
