# SPDX-License-Identifier: Apache-2.0
"""Committing a plan is all or nothing: a plan that no longer applies is refused before the table
changes, and the backend forgets it so the request can be planned again."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import add_sequence, make_kv, make_table, table_fingerprint
from trtllm_vtoken.reclaim import ReclaimBackend, ReclaimConfig
from trtllm_vtoken.reclaim.copy import TorchCopyExecutor
from trtllm_vtoken.reclaim.planner import commit_plan, plan_dense, plan_lazy


def stale_dense_setup():
    """tokens_per_block 4, tokens 0-5 in two blocks, token 1 evicted. The dense plan moves token 5
    into token 1's slot and truncates to 5; then the engine writes token 6 at position 6."""
    pool, table = make_table(num_blocks=8, tokens_per_block=4)
    kv = make_kv(pool)
    table.add_request(0)
    table.append_tokens(0, pool.allocate(2), 6)
    table.evict_tokens(0, [1])
    return pool, table, kv


def test_stale_dense_plan_is_refused_by_the_backend_with_nothing_changed():
    pool, table, kv = stale_dense_setup()
    backend = ReclaimBackend(table, pool, TorchCopyExecutor([kv]), ReclaimConfig(mode="dense"))
    plan = backend.plan(0)
    assert plan.token_ids == (5,) and plan.new_kv_len == 5
    backend.submit(plan)
    table.append_tokens(0, [], 1)  # token 6, at position 6: beyond the plan's new length
    before = table_fingerprint(table)
    with pytest.raises(ValueError, match="taken from table version 2, table is at 3"):
        backend.commit_blocking(0)
    assert table_fingerprint(table) == before
    assert table.lookup(0, 5) == (1, 1) and table.lookup(0, 1) == (0, 1)  # nothing moved
    assert not backend.in_flight(0) and pool.num_free == 6
    # The refused plan is gone: the request plans afresh and commits.
    fresh = backend.plan(0)
    assert fresh is not None and fresh.new_kv_len == 6
    backend.submit(fresh)
    backend.commit_blocking(0)
    assert table.kv_len(0) == 6 and table.num_live(0) == 6
    table.check_integrity()


def test_stale_dense_plan_is_refused_by_commit_plan():
    _, table, _ = stale_dense_setup()
    plan = plan_dense(table, 0)
    table.append_tokens(0, [], 1)
    before = table_fingerprint(table)
    with pytest.raises(ValueError, match="taken from table version"):
        commit_plan(table, plan)
    assert table_fingerprint(table) == before


def test_a_dense_plan_commits_once():
    """Evicting the newest token: a plan with no move that only shortens the request."""
    pool, table = make_table(num_blocks=8, tokens_per_block=4)
    add_sequence(pool, table, 0, 6)
    table.evict_tokens(0, [5])
    plan = plan_dense(table, 0)
    assert plan.num_moves == 0 and plan.new_kv_len == 5
    assert commit_plan(table, plan) == []
    before = table_fingerprint(table)
    with pytest.raises(ValueError, match="taken from table version"):
        commit_plan(table, plan)
    assert table_fingerprint(table) == before


def test_lazy_plan_whose_release_became_invalid_is_refused_whole():
    """A lazy plan empties block 0, whose tokens are all dead (no move). The block becomes shared
    while the copy runs: releasing it is refused, and so is the whole commit."""
    pool, table = make_table(num_blocks=8, tokens_per_block=4)
    kv = make_kv(pool)
    blocks = add_sequence(pool, table, 0, 12)
    backend = ReclaimBackend(table, pool, TorchCopyExecutor([kv]), ReclaimConfig(mode="lazy"))
    table.evict_tokens(0, [0, 1, 2, 3])
    plan = backend.plan(0)
    assert plan.blocks_to_free == (blocks[0],) and plan.num_moves == 0
    backend.submit(plan)
    pool.share([blocks[0]])
    before = table_fingerprint(table)
    with pytest.raises(ValueError, match=f"cannot release shared block {blocks[0]}"):
        backend.commit_blocking(0)
    assert table_fingerprint(table) == before and not backend.in_flight(0)


def test_lazy_plan_survives_evictions_and_appends_made_while_its_copy_ran():
    """Background compaction: a lazy plan stays valid across evictions and appends."""
    pool, table = make_table(num_blocks=8, tokens_per_block=4)
    kv = make_kv(pool)
    blocks = add_sequence(pool, table, 0, 14)
    backend = ReclaimBackend(table, pool, TorchCopyExecutor([kv]), ReclaimConfig(mode="lazy"))
    table.evict_tokens(0, [1, 2, 3, 6, 8, 10])
    plan = plan_lazy(table, 0)
    backend.submit(plan)
    table.evict_tokens(0, [plan.token_ids[0]])
    table.sync_new_tokens(0, blocks, 15)
    assert backend.commit_blocking(0) is plan and table.num_blocks(0) == 3
    table.check_integrity()


def test_removed_request_leaves_no_plan_in_flight():
    pool, table = make_table(num_blocks=8, tokens_per_block=4)
    kv = make_kv(pool)
    add_sequence(pool, table, 0, 6)
    backend = ReclaimBackend(table, pool, TorchCopyExecutor([kv]), ReclaimConfig(mode="dense"))
    table.evict_tokens(0, [1])
    backend.submit(backend.plan(0))
    pool.free(table.remove_request(0))
    with pytest.raises(KeyError, match="unknown request 0"):
        backend.commit_blocking(0)
    assert not backend.in_flight(0)
    assert torch.isfinite(kv).all()
