# SPDX-License-Identifier: Apache-2.0
"""The native statistic pass (``cpp/core/select.cpp`` select_lowest) against a plain numpy
statement of what it computes, over layouts whose rows hold runs of consecutive blocks (the pass
merges them into spans of contiguous slots, up to 8 blocks each) broken by jumps, rows that end
inside a block, holes, id windows, ties, shared blocks (observed, never candidates) and rows that
evict none, one or several tokens."""

from __future__ import annotations

import numpy as np
import pytest

from trtllm_vtoken.core.native import load

pytestmark = pytest.mark.skipif(load() is None, reason="the C++ core is not built")

TPB = 8


def run_layout(rng: np.random.Generator, batch: int, longest: int):
    """Rows of blocks laid out in runs of 1 to 20 consecutive block ids, the runs anywhere in the
    pool; live ids ascending with holes; lengths ending anywhere in a block."""
    per_row = -(-longest // TPB)
    num_blocks = batch * per_row * 24
    free = list(rng.permutation(batch * per_row) * 24)  # run starts, far enough apart
    block_table = np.zeros((batch, per_row), dtype=np.int32)
    for row in range(batch):
        filled = 0
        while filled < per_row:
            run = min(int(rng.integers(1, 21)), per_row - filled)
            start = free.pop()
            block_table[row, filled:filled + run] = np.arange(start, start + run)
            filled += run
    tokens = np.full(num_blocks * TPB, -1, dtype=np.int32)
    kv_len = rng.integers(longest // 2, longest + 1, size=batch).astype(np.int64)
    for row, length in enumerate(kv_len):
        slots = slots_of(block_table[row], length)
        ids = np.sort(rng.choice(length * 2, size=length, replace=False)).astype(np.int32)
        ids[rng.random(length) < 0.1] = -1
        tokens[slots] = ids
    return tokens, block_table, kv_len


def slots_of(blocks: np.ndarray, length: int) -> np.ndarray:
    positions = np.arange(length)
    return blocks[positions // TPB].astype(np.int64) * TPB + positions % TPB


def reference(tokens, block_table, rows, kv_len, lo, hi, excess, stat, mass, shared):
    """Row after row: stat += mass at every position; then the excess lowest (stat, id) among live
    ids in [lo, hi) outside shared blocks, in id order, as (batch index, position)."""
    picked_rows, picked_positions = [], []
    for i, row in enumerate(rows):
        slots = slots_of(block_table[row], kv_len[i])
        with np.errstate(invalid="ignore"):  # -inf + inf: NaN, as the pass makes it
            stat[slots] += mass[i, : kv_len[i]]  # a row's slots are distinct: no repeated index
        if excess[i] <= 0:
            continue
        ids = tokens[slots].astype(np.int64)
        candidate = (ids >= lo[i]) & (ids < hi[i]) & ~np.isin(slots // TPB, list(shared))
        positions = np.flatnonzero(candidate)
        order = np.lexsort((ids[positions], stat[slots[positions]]))[: excess[i]]
        chosen = positions[order]
        chosen = chosen[np.argsort(ids[chosen])]
        picked_rows += [i] * len(chosen)
        picked_positions += chosen.tolist()
    return np.array(picked_rows, dtype=np.int64), np.array(picked_positions, dtype=np.int64)


def masses(rng: np.random.Generator, shape: tuple[int, int], kind: str) -> np.ndarray:
    """A step's mass: random, from a few values (ties), or random with non-finite values mixed
    in (a model whose attention overflowed): NaN, +inf and -inf here and there, row 2 all NaN."""
    if kind == "ties":
        return rng.choice([0.0, 0.5, 1.0], size=shape)
    values = rng.random(shape)
    if kind == "non-finite":
        odd = rng.random(shape)
        values[odd < 0.05] = np.nan
        values[(odd >= 0.05) & (odd < 0.07)] = np.inf
        values[(odd >= 0.07) & (odd < 0.08)] = -np.inf
        values[2] = np.nan
    return values


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["random", "ties", "non-finite"])
@pytest.mark.parametrize("with_shared", [False, True])
def test_the_pass_over_spans_equals_its_statement(seed, dtype, kind, with_shared):
    """Non-finite keys order as numpy's sort: -inf, the numbers, +inf, NaN (ties by id)."""
    native = load()
    rng = np.random.default_rng(seed)
    batch, longest = 12, 700
    tokens, block_table, kv_len = run_layout(rng, batch, longest)
    shared: set[int] = set()
    table = None
    if with_shared:  # a prefix block held by two rows, and blocks inside runs
        block_table[1, 0] = block_table[0, 0]
        tokens[slots_of(block_table[1], kv_len[1])[:TPB]] = tokens[slots_of(block_table[0], kv_len[0])[:TPB]]
        shared = {int(block_table[0, 0])} | {int(b) for b in rng.choice(block_table[2:, 1:].ravel(), 6)}
        table = native.TokenTable(TPB)
        for block in shared:
            table.set_shared(block, True)
    rows = rng.permutation(batch).astype(np.int64)
    lengths = kv_len[rows]
    lo = rng.integers(0, 40, size=batch).astype(np.int64)
    hi = (lengths * 2 - rng.integers(0, 200, size=batch)).astype(np.int64)
    hi[0] = lo[0]  # an empty window: no candidate
    excess = rng.choice([0, 1, 1, 1, 4], size=batch).astype(np.int64)
    excess[1] = 10_000  # more than its candidates: all of them
    if kind == "non-finite":
        excess[2] = 1  # a row whose candidates all score NaN, one victim: the lowest id
    start = (np.zeros(len(tokens)) if kind == "ties" else rng.random(len(tokens))).astype(np.float32)  # H2O's float32
    ours, theirs = start.copy(), start.copy()
    for _ in range(3):  # the statistic accumulates over steps
        mass = masses(rng, (batch, longest + 3), kind).astype(dtype)
        got = native.select_lowest(tokens, block_table, TPB, rows, lengths, lo, hi, excess, ours, mass, table, 1)
        want = reference(tokens, block_table, rows, lengths, lo, hi, excess, theirs, mass, shared)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(ours, theirs)  # NaN where NaN
        if kind != "non-finite":
            assert ours.tobytes() == theirs.tobytes()
    assert len(got[0]) > batch // 2


def test_the_statistic_is_float32_and_never_converted():
    """The pass adds to the statistic in place: an array of another dtype would be converted into
    a copy and the additions lost, so it is refused (TypeError), as is a layout buffer of another
    dtype (the step's slot calls write them in place)."""
    native = load()
    rng = np.random.default_rng(0)
    tokens, block_table, kv_len = run_layout(rng, 2, 40)
    rows = np.arange(2, dtype=np.int64)
    bounds = (np.zeros(2, dtype=np.int64), kv_len.astype(np.int64), np.ones(2, dtype=np.int64))
    mass = np.ones((2, 40), dtype=np.float32)
    stat = np.zeros(len(tokens), dtype=np.float32)
    native.select_lowest(tokens, block_table, TPB, rows, kv_len, *bounds, stat, mass, None, 1)
    assert stat.sum() == kv_len.sum()  # every live position's mass landed in this very array
    with pytest.raises(TypeError):
        native.select_lowest(tokens, block_table, TPB, rows, kv_len, *bounds, stat.astype(np.float64), mass, None, 1)
    counters = [np.zeros(2, dtype=np.int64) for _ in range(4)]
    native.BoundLayout(tokens, block_table, TPB, *counters, [stat])
    with pytest.raises(TypeError):
        native.BoundLayout(tokens, block_table, TPB, counters[0].astype(np.int32), *counters[1:], [stat])
