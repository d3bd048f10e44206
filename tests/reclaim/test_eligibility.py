# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

from tests.helpers import add_sequence, make_backend, make_kv, make_table
from trtllm_vtoken.reclaim.eligibility import eligible_blocks


def test_eligible_blocks_have_dead_slots_and_are_not_shared():
    pool, table = make_table()
    blocks = add_sequence(pool, table, 0, 14)  # blocks [0, 1, 2, 3]
    assert eligible_blocks(table, 0) == []
    table.evict_tokens(0, [5, 9, 13])
    assert eligible_blocks(table, 0) == [1, 2, 3]
    pool.share(blocks[1:2])  # block 1 became shared after the eviction: hands off
    assert eligible_blocks(table, 0) == [2, 3]


def test_requests_with_a_plan_in_flight_are_not_eligible():
    pool, table = make_table(num_blocks=32)
    add_sequence(pool, table, 0, 12)
    add_sequence(pool, table, 1, 12)
    add_sequence(pool, table, 2, 12)
    backend = make_backend(pool, table, make_kv(pool), mode="lazy")
    table.evict_tokens(0, [0, 1, 2, 3])
    table.evict_tokens(1, [4])
    assert backend.eligible() == [0, 1]
    backend.submit(backend.plan(0))
    assert backend.eligible() == [1]
    backend.commit_blocking(0)
    assert backend.eligible() == [1]  # request 0 has no hole left: block 0 was released
