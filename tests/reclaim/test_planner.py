# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

from tests.helpers import add_sequence, make_table
from trtllm_vtoken.reclaim import fragmentation, plan_dense, plan_lazy


def test_dense_plan_matches_the_docstring_example():
    # [L L . L][. L L L][L L . .]  -> holes 2, 4 below R = 8; sources 9, 8; release block 2
    pool, table = make_table()
    add_sequence(pool, table, 0, 12)
    table.evict_tokens(0, [2, 4, 10, 11])
    plan = plan_dense(table, 0)
    assert list(plan.token_ids) == [9, 8]
    assert list(plan.src_slots) == [9, 8] and list(plan.dst_slots) == [2, 4]
    assert plan.blocks_to_free == (2,) and plan.new_kv_len == 8
    assert (plan.blocks_before, plan.blocks_after) == (3, 2)


def test_dense_plan_with_one_hole_per_step_is_one_copy():
    pool, table = make_table()
    add_sequence(pool, table, 0, 9)  # last block holds one token
    table.evict_token(0, 3)
    plan = plan_dense(table, 0)
    assert list(zip(list(plan.src_slots), list(plan.dst_slots))) == [(8, 3)]
    assert plan.blocks_to_free == (2,) and plan.new_kv_len == 8


def test_dense_plan_without_holes_is_none_and_evicting_the_last_token_needs_no_copy():
    pool, table = make_table()
    add_sequence(pool, table, 0, 6)
    assert plan_dense(table, 0) is None
    table.evict_token(0, 5)
    plan = plan_dense(table, 0)
    assert plan.num_moves == 0 and plan.new_kv_len == 5 and plan.blocks_to_free == ()


def test_dense_plan_leaves_shared_prefix_alone():
    pool, table = make_table()
    blocks = add_sequence(pool, table, 0, 10)
    pool.share(blocks[:1])
    table.evict_tokens(0, [5, 6])
    plan = plan_dense(table, 0)
    assert list(plan.dst_slots) == [5, 6] and list(plan.src_slots) == [9, 8]
    assert all(s // 4 != 0 for s in list(plan.src_slots) + list(plan.dst_slots))


def test_lazy_plan_matches_the_docstring_example():
    # [L . . .][L L . L][. L . L][L L _ _]: 5 holes -> free 1 block, the emptiest (block 0)
    pool, table = make_table()
    add_sequence(pool, table, 0, 14)
    table.evict_tokens(0, [1, 2, 3, 6, 8, 10])
    plan = plan_lazy(table, 0)
    assert plan.blocks_to_free == (0,)
    assert list(plan.token_ids) == [0] and list(plan.src_slots) == [0]
    assert list(plan.dst_slots) == [6]  # the hole of the fullest kept block (block 1)
    assert plan.new_kv_len is None and plan.blocks_after == 3


def test_lazy_plan_is_none_unless_a_block_is_freed():
    pool, table = make_table()
    add_sequence(pool, table, 0, 12)
    table.evict_tokens(0, [1, 5, 9])  # 3 holes < tokens_per_block
    assert plan_lazy(table, 0) is None
    assert fragmentation(table, 0) == 0


def test_lazy_plan_frees_several_blocks_and_skips_shared_and_tail_blocks():
    pool, table = make_table()
    blocks = add_sequence(pool, table, 0, 19)  # 5 blocks, the last one partial
    pool.share(blocks[:1])
    table.evict_tokens(0, [4, 5, 6, 8, 9, 10, 12, 13, 17])
    plan = plan_lazy(table, 0)
    # 9 holes -> 2 blocks; candidates (unshared, full): 1 (1 live), 2 (1 live), 3 (2 live)
    assert plan.blocks_to_free == (1, 2)
    assert sorted(list(plan.token_ids)) == [7, 11]
    assert all(s // 4 in (3, 4) for s in list(plan.dst_slots))
