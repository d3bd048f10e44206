# SPDX-License-Identifier: Apache-2.0
"""The Python core's ``step_batch``: dense and dead-block steps against the per-request loop that
specifies them (the single-hole shortcut is separate code), lazy steps against an oracle written
from the lazy pairing rule (``reclaim/planner.py``); same results, same tables, same errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import random_step, result_lists, step_loop, table_fingerprint
from trtllm_vtoken.core import TokenTable
from trtllm_vtoken.reclaim.step_batch import step_batch


def fingerprint(table: TokenTable) -> tuple:
    hints = tuple((r, tuple(table.seq(r).pending_dead), tuple(table.seq(r).block_index.items()))
                  for r in sorted(table.request_ids()))
    return table_fingerprint(table), hints


def twin_tables(tpb: int, lengths: list[int], shared: set[int]) -> tuple[TokenTable, TokenTable, int]:
    """Two identical tables; if block 0 is in ``shared``, every request starts with it."""
    shared_prefix = 0 in shared
    tables = [TokenTable(tpb, shared.__contains__) for _ in range(2)]
    next_block = 1
    for req, n in enumerate(lengths):
        blocks = [0] if shared_prefix else []
        n = max(n, tpb) if shared_prefix else n
        blocks += list(range(next_block, next_block + -(-n // tpb) - len(blocks)))
        next_block += len(blocks) - (1 if shared_prefix else 0)
        for table in tables:
            table.add_request(req)
            table.sync_new_tokens(req, blocks, n)
    return tables[0], tables[1], next_block


def share_a_full_block(rng: np.random.Generator, table: TokenTable, shared: set[int]) -> None:
    """Prefix caching registers a block another request now reads: a full one, dead tokens and all."""
    tpb = table.tokens_per_block
    full = [b for r in table.request_ids() for b in table.block_ids(r)[: table.kv_len(r) // tpb]]
    if full:
        shared.add(int(rng.choice(full)))


CASES = dict(tpb=st.sampled_from([1, 2, 4, 8]), lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
             steps=st.integers(1, 30), threshold=st.integers(1, 3), shared_prefix=st.booleans(),
             seed=st.integers(0, 2**31))


def random_steps(tpb: int, lengths: list[int], steps: int, shared_prefix: bool, seed: int):
    """Twin tables and random decode steps for them: yields (first table, second table, step,
    pressure) ``steps`` times; before a step, now and then a full block becomes shared."""
    rng = np.random.default_rng(seed)
    shared = {0} if shared_prefix else set()
    first, second, next_block = twin_tables(tpb, lengths, shared)
    for _ in range(steps):
        if rng.random() < 0.1:
            share_a_full_block(rng, first, shared)
        step, next_block = random_step(rng, first, next_block)
        yield first, second, step, bool(rng.random() < 0.2)


@settings(max_examples=80, deadline=None)
@given(mode=st.sampled_from(["dense", "dead-blocks"]), **CASES)
def test_step_batch_equals_the_loop(mode, tpb, lengths, steps, threshold, shared_prefix, seed):
    for spec, fast, step, pressure in random_steps(tpb, lengths, steps, shared_prefix, seed):
        want = step_loop(spec, step, mode, threshold, pressure)
        result = step_batch(fast, *step["csr"], mode, threshold, pressure)
        assert result_lists(result) == want
        assert result.kv_lens.tolist() == [spec.kv_len(r) for r in step["req_ids"]]
        assert fingerprint(fast) == fingerprint(spec)
        fast.check_integrity()


def lazy_oracle(table: TokenTable, req: int, threshold: int, pressure: bool) -> tuple[list, list[int]]:
    """The lazy plan by the pairing rule in ``reclaim/planner.py``'s docstring, from what the table
    shows (live positions, blocks, sharing): ([(token, source slot, destination slot)], blocks freed)."""
    tpb, blocks, kv_len = table.tokens_per_block, table.block_ids(req), table.kv_len(req)
    if not pressure and len(blocks) - -(-table.num_live(req) // tpb) < threshold:
        return [], []
    live = table.position_live_mask(req)
    live_in = [int(live[i * tpb:(i + 1) * tpb].sum()) for i in range(len(blocks))]
    unshared = [not table.is_shared(b) for b in blocks]
    holes = [p for p in range(kv_len) if not live[p] and unshared[p // tpb]]  # rule 1
    candidates = [i for i in range(kv_len // tpb) if unshared[i]]  # rule 2
    k = min(len(holes) // tpb, len(candidates))  # rule 3
    if k == 0:
        return [], []
    fewest_live_later_first = sorted(candidates, key=lambda i: (live_in[i], -i))  # rule 4
    sources = sorted(fewest_live_later_first[:k])
    slot = lambda p: blocks[p // tpb] * tpb + p % tpb  # noqa: E731
    moving = [p for i in sources for p in range(i * tpb, (i + 1) * tpb) if live[p]]  # rule 5
    targets = sorted((p for p in holes if p // tpb not in sources), key=lambda p: (-live_in[p // tpb], p))
    moves = [(table.token_at_slot(req, slot(p)), slot(p), slot(q)) for p, q in zip(moving, targets)]
    return moves, [blocks[i] for i in sources]  # rule 6


@settings(max_examples=80, deadline=None)
@given(**CASES)
def test_lazy_step_batch_follows_the_pairing_rule(tpb, lengths, steps, threshold, shared_prefix, seed):
    """The oracle's plan, applied with the table's primitives, leaves the table as step_batch does."""
    for oracle, fast, step, pressure in random_steps(tpb, lengths, steps, shared_prefix, seed):
        want_moves, want_freed = [], []
        for req, added, n, victims in zip(step["req_ids"], step["new_blocks"], step["num_new"], step["evictions"]):
            oracle.append_tokens(req, added, n)
            oracle.evict_tokens(req, victims)
            moves, freed = lazy_oracle(oracle, req, threshold, pressure)
            if freed:
                oracle.apply_moves(req, [token for token, _, _ in moves], [dst for _, _, dst in moves])
                oracle.release_blocks(req, freed)
            want_moves.append(moves)
            want_freed.append(freed)
        result = step_batch(fast, *step["csr"], "lazy", threshold, pressure)
        assert result_lists(result) == (want_moves, want_freed)
        assert table_fingerprint(fast) == table_fingerprint(oracle)
        fast.check_integrity()


def test_lazy_oracle_pairs_as_documented():
    """The docstring's example: block 0 (one live token) empties into block 1's hole."""
    table = TokenTable(4)
    table.add_request(0)
    table.sync_new_tokens(0, [10, 11, 12, 13], 14)
    table.evict_tokens(0, [1, 2, 3, 6, 8, 10])
    assert lazy_oracle(table, 0, 1, False) == ([(0, 10 * 4, 11 * 4 + 2)], [10])


def test_one_eviction_fills_the_hole_with_the_last_token(monkeypatch):
    """tokens_per_block 4, blocks [7, 2] full (tokens 0-7). The step writes token 8 into new block
    9 and evicts token 3: token 8 moves to slot 7*4+3 = 31 and block 9 goes back."""
    table = TokenTable(4)
    table.add_request(0)
    table.sync_new_tokens(0, [7, 2], 8)
    fast_path = []
    original = TokenTable.fill_single_hole
    monkeypatch.setattr(TokenTable, "fill_single_hole", lambda *a: fast_path.append(1) or original(*a))
    result = step_batch(table, [0], [1], [0, 1], [9], [0, 1], [3], "dense")
    assert result_lists(result) == ([[(8, 9 * 4, 7 * 4 + 3)]], [[9]]) and result.kv_lens.tolist() == [8]
    assert fast_path == [1]
    assert table.lookup(0, 8) == (7, 3) and table.lookup(0, 3) is None
    assert table.block_ids(0) == [7, 2] and table.kv_len(0) == 8 and table.num_live(0) == 8
    assert table.version(0) == 5  # sync; then append, evict, apply_moves, truncate, as the loop counts
    table.check_integrity()


def test_evicting_the_newest_token_moves_nothing():
    table = TokenTable(4)
    table.add_request(0)
    table.sync_new_tokens(0, [7, 2], 8)
    assert result_lists(step_batch(table, [0], [1], [0, 1], [9], [0, 1], [8], "dense")) == ([[]], [[9]])
    assert table.lookup(0, 8) is None and table.kv_len(0) == 8 and table.block_ids(0) == [7, 2]


def test_lazy_mode_waits_for_a_whole_block_of_holes():
    table = TokenTable(4)
    table.add_request(0)
    table.sync_new_tokens(0, [7, 2, 5], 12)
    assert result_lists(step_batch(table, [0], [0], [0, 0], [], [0, 3], [0, 1, 5], "lazy")) == ([[]], [[]])
    # A fourth hole: blocks 7 and 2 keep two live tokens each; the later one, 2, empties its
    # tokens 4 and 7 into block 7's holes (offsets 0 and 1).
    moves, freed = result_lists(step_batch(table, [0], [0], [0, 0], [], [0, 1], [6], "lazy"))
    assert (moves, freed) == ([[(4, 2 * 4, 7 * 4), (7, 2 * 4 + 3, 7 * 4 + 1)]], [[2]])
    assert table.block_ids(0) == [7, 5] and table.lookup(0, 4) == (7, 0) and table.lookup(0, 7) == (7, 1)


def test_inconsistent_arrays_change_nothing():
    table = TokenTable(4)
    table.add_request(0)
    table.sync_new_tokens(0, [1], 4)
    before = table_fingerprint(table)
    with pytest.raises(ValueError, match="one more"):
        step_batch(table, [0], [1], [0], [], [0, 0], [], "dense")
    with pytest.raises(ValueError, match="new_block_offsets must start at 0"):
        step_batch(table, [0], [1], [0, 5], [2], [0, 0], [], "dense")
    with pytest.raises(ValueError, match="evict_offsets must start at 0, never decrease"):
        step_batch(table, [0], [1], [0, 1], [2], [1, 0], [3], "dense")
    assert table_fingerprint(table) == before


def test_bad_request_stops_the_batch_where_the_loop_would():
    """Request 0's step is done; request 1 is unknown (KeyError); request 2 is untouched. A bad
    victim fails that request's eviction after its append, as the loop does."""
    table = TokenTable(4)
    for req in (0, 2):
        table.add_request(req)
        table.sync_new_tokens(req, [req * 10], 3)
    with pytest.raises(KeyError, match="unknown request 1"):
        step_batch(table, [0, 1, 2], [1, 1, 1], [0, 0, 0, 0], [], [0, 1, 2, 3], [0, 0, 0], "dense")
    assert table.kv_len(0) == 3 and table.num_tokens(0) == 4 and table.lookup(0, 3) == (0, 0)
    assert table.num_tokens(2) == 3
    with pytest.raises(ValueError, match="token 0 is already dead"):
        step_batch(table, [0], [0], [0, 0], [], [0, 1], [0], "dense")
    assert table.num_live(0) == 3 and table.version(0) == 6  # the append (of 0 tokens) counted
