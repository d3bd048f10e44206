# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import add_sequence, make_table, table_fingerprint
from trtllm_vtoken.core import TokenTable


def test_sync_assigns_sequential_ids_and_exact_slots():
    pool, table = make_table(num_blocks=8, tokens_per_block=4)
    table.add_request(7)
    pool.allocate(1)  # block 0 belongs to someone else
    blocks = pool.allocate(2)  # [1, 2]
    assert table.sync_new_tokens(7, blocks, 6) == range(0, 6)
    assert [table.lookup(7, t) for t in range(6)] == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1)]
    # The decode step: one more token, then a new block.
    assert table.sync_new_tokens(7, blocks, 7) == range(6, 7)
    more = blocks + pool.allocate(1)  # [1, 2, 3]
    assert table.sync_new_tokens(7, more, 9) == range(7, 9)
    assert table.lookup(7, 8) == (3, 0)
    assert table.token_at_slot(7, 3 * 4 + 0) == 8
    assert table.token_at_slot(7, 3 * 4 + 1) is None
    assert table.live_counts_per_block(7).tolist() == [4, 4, 1]
    assert (table.kv_len(7), table.num_tokens(7), table.num_live(7)) == (9, 9, 9)
    table.check_integrity()


def test_evict_marks_dead_without_moving():
    pool, table = make_table()
    add_sequence(pool, table, 0, 10)
    table.evict_tokens(0, [1, 5])
    table.evict_token(0, 9)
    assert table.live_ids(0).tolist() == [0, 2, 3, 4, 6, 7, 8]
    assert table.lookup(0, 5) == (1, 1)  # KV stays where it was until relocated
    assert table.hole_positions(0) == [1, 5, 9]
    assert table.position_live_mask(0).tolist() == [1, 0, 1, 1, 1, 0, 1, 1, 1, 0]
    assert table.live_counts_per_block(0).tolist() == [3, 3, 1]
    table.check_integrity()


@pytest.mark.parametrize(
    "ids, error, match",
    [
        ([10], ValueError, r"token id 10 out of range \[0, 10\)"),
        ([-1], ValueError, "out of range"),
        ([3, 3], ValueError, "repeat"),
        ([2, 1], ValueError, "token 1 is already dead"),
    ],
)
def test_bad_evictions_raise_and_change_nothing(ids, error, match):
    pool, table = make_table()
    add_sequence(pool, table, 0, 10)
    table.evict_token(0, 1)
    before = table_fingerprint(table)
    with pytest.raises(error, match=match):
        table.evict_tokens(0, ids)
    assert table_fingerprint(table) == before


def test_unknown_request_is_a_key_error():
    _, table = make_table()
    with pytest.raises(KeyError, match="unknown request 3"):
        table.evict_token(3, 0)
    with pytest.raises(KeyError, match="unknown request 3"):
        table.sync_new_tokens(3, [0], 1)
    table.add_request(3)
    with pytest.raises(ValueError, match="already in the token table"):
        table.add_request(3)


def test_tokens_in_shared_blocks_are_protected():
    pool, table = make_table()
    blocks = add_sequence(pool, table, 0, 6)
    pool.share(blocks[:1])  # another request reuses block 0 as its prefix
    assert table.protected_ids(0).tolist() == [0, 1, 2, 3]
    before = table_fingerprint(table)
    with pytest.raises(ValueError, match="token 2 is protected: block 0 is shared"):
        table.evict_tokens(0, [5, 2])
    assert table_fingerprint(table) == before
    table.evict_token(0, 5)


@pytest.mark.parametrize(
    "blocks, total, match",
    [
        ([1, 0], 8, "must extend the current one"),
        ([0, 1, 1], 9, "repeat a block"),
        ([0, 1], 9, r"total_len 9 must lie in \[6, 8\]"),
        ([0, 1], 5, r"total_len 5 must lie in \[6, 8\]"),
    ],
)
def test_bad_sync_raises_and_changes_nothing(blocks, total, match):
    pool, table = make_table()
    add_sequence(pool, table, 0, 6)  # blocks [0, 1]
    before = table_fingerprint(table)
    with pytest.raises(ValueError, match=match):
        table.sync_new_tokens(0, blocks, total)
    assert table_fingerprint(table) == before


def test_apply_moves_points_tokens_at_new_slots_and_clears_sources():
    pool, table = make_table()
    add_sequence(pool, table, 0, 10)  # blocks [0, 1, 2]
    table.evict_tokens(0, [1, 5])
    table.apply_moves(0, [9, 8], [1, 5])  # fill the holes with the two highest tokens
    assert table.lookup(0, 9) == (0, 1) and table.lookup(0, 8) == (1, 1)
    assert table.lookup(0, 1) is None and table.lookup(0, 5) is None  # dead, KV overwritten
    assert table.token_at_slot(0, 8) is None and table.token_at_slot(0, 9) is None
    assert table.live_counts_per_block(0).tolist() == [4, 4, 0]
    assert table.truncate(0, 8) == [2]
    assert (table.kv_len(0), table.block_ids(0)) == (8, [0, 1])
    table.check_integrity()


@pytest.mark.parametrize(
    "tokens, dsts, match",
    [
        ([9], [2], "slot 2 is occupied by live token 2"),
        ([9], [40], "slot 40 is not in one of its blocks"),
        ([9], [10], "slot 10 lies beyond kv_len 10"),
        ([9, 8], [1, 1], "repeats"),
        ([1], [5], "token 1 holds no slot"),
        ([9, 5], [5, 1], "slot 5 is the source of another move"),
        ([12], [1], "token id 12 out of range"),
        ([9], [1, 5], "1 tokens but 2 destination slots"),
    ],
)
def test_bad_moves_raise_and_change_nothing(tokens, dsts, match):
    pool, table = make_table()
    add_sequence(pool, table, 0, 10)
    table.evict_tokens(0, [1, 5])
    table.apply_moves(0, [9], [1])  # token 1 now has no slot
    before = table_fingerprint(table)
    with pytest.raises(ValueError, match=match):
        table.apply_moves(0, tokens, dsts)
    assert table_fingerprint(table) == before


def test_moves_into_shared_blocks_are_refused():
    pool, table = make_table()
    blocks = add_sequence(pool, table, 0, 8)
    table.evict_token(0, 1)
    pool.share(blocks[:1])
    with pytest.raises(ValueError, match="shared block 0"):
        table.apply_moves(0, [7], [1])


def test_truncate_refuses_live_tail_and_shared_tail():
    pool, table = make_table()
    blocks = add_sequence(pool, table, 0, 8)
    with pytest.raises(ValueError, match="live tokens beyond new length 4"):
        table.truncate(0, 4)
    table.evict_tokens(0, [4, 5, 6, 7])
    pool.share(blocks[1:])
    with pytest.raises(ValueError, match=r"cannot release shared blocks \[1\]"):
        table.truncate(0, 4)


def test_release_blocks_from_the_middle_shifts_positions():
    pool, table = make_table()
    add_sequence(pool, table, 0, 14)  # blocks [0, 1, 2, 3], kv_len 14
    table.evict_tokens(0, [4, 5, 6, 7, 9])
    with pytest.raises(ValueError, match="block 2 still holds live tokens"):
        table.release_blocks(0, [2])
    table.release_blocks(0, [1])
    assert table.block_ids(0) == [0, 2, 3] and table.kv_len(0) == 10
    assert table.lookup(0, 12) == (3, 0)  # slots never change
    assert table.lookup(0, 4) is None
    assert table.hole_positions(0) == [5]  # token 9 at block 2 offset 1, now position 4 + 1
    assert table.position_live_mask(0).tolist() == [1, 1, 1, 1, 1, 0, 1, 1, 1, 1]
    table.check_integrity()


def test_remove_request_returns_its_blocks():
    pool, table = make_table()
    blocks = add_sequence(pool, table, 4, 9)
    assert table.remove_request(4) == blocks
    assert 4 not in table


def test_metadata_is_linear_in_length():
    pool, table = make_table(num_blocks=4096, tokens_per_block=32)
    for req_id, length in enumerate([100, 1000, 4000]):
        add_sequence(pool, table, req_id, length)
    per_token = table.metadata_bytes_per_token()
    # int32 slot + uint8 live per token, int32 per position, int32 per block: ~9 B, plus padding
    assert 9.0 <= per_token < 9.5
    table2 = TokenTable(32)
    assert table2.metadata_bytes_per_token() == 0.0


def test_live_ids_and_slots_are_arrays():
    pool, table = make_table()
    add_sequence(pool, table, 0, 5)
    ids = table.live_ids(0)
    assert ids.dtype == np.int64 and table.slots_of(0, ids).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("tokens_per_block", [1, 16, 64])
def test_arrays_grow_past_every_capacity_step(tokens_per_block):
    pool, table = make_table(num_blocks=2048, tokens_per_block=tokens_per_block)
    table.add_request(0)
    blocks: list[int] = []
    for length in [*range(1, 70), 255, 256, 257, 1000, 1001]:
        while len(blocks) * tokens_per_block < length:
            blocks += pool.allocate(1)
        table.sync_new_tokens(0, blocks, length)
    assert table.lookup(0, 1000) == divmod(blocks[1000 // tokens_per_block] * tokens_per_block
                                           + 1000 % tokens_per_block, tokens_per_block)
    table.check_integrity()
