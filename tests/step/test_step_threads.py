# SPDX-License-Identifier: Apache-2.0
"""H2O's native pass split over threads (``StepConfig.threads``, ``cpp/core/select.h``) decides as
one thread does: the same victims, in the same order, and bit-identical statistics, for batches
large enough to split (at least 64Ki tokens per thread), with ties, float32 and float64 mass,
rows evicting none, one or several tokens; shared blocks keep one thread."""

from __future__ import annotations

import numpy as np
import pytest

from tests.step.drive import Host, decided_in_python
from trtllm_vtoken.core.native import load
from trtllm_vtoken.policies import make_policy
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.step import DecodeStep, StepConfig, StepInput

pytestmark = pytest.mark.skipif(load() is None, reason="the C++ core is not built")

TPB = 32


def random_layout(rng: np.random.Generator, batch: int, longest: int):
    """A slot layout whose rows hold blocks scattered over the pool, live ids with holes."""
    blocks_per_row = -(-longest // TPB)
    num_blocks = batch * blocks_per_row + 4
    placed = rng.permutation(num_blocks).astype(np.int32)
    block_table = placed[: batch * blocks_per_row].reshape(batch, blocks_per_row).copy()
    tokens = np.full(num_blocks * TPB, -1, dtype=np.int32)
    kv_len = rng.integers(longest // 2, longest + 1, size=batch)
    for row, length in enumerate(kv_len):
        slots = (block_table[row].astype(np.int64).repeat(TPB) * TPB + np.tile(np.arange(TPB), blocks_per_row))[:length]
        ids = np.sort(rng.choice(length * 2, size=length, replace=False)).astype(np.int32)
        ids[rng.random(length) < 0.1] = -1  # holes
        tokens[slots] = ids
    return tokens, block_table, kv_len.astype(np.int64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ties", [False, True])
def test_the_pass_over_threads_picks_what_one_thread_picks(dtype, ties):
    native = load()
    rng = np.random.default_rng(7)
    batch, longest = 80, 4096  # ~245k tokens: up to three threads' worth
    tokens, block_table, kv_len = random_layout(rng, batch, longest)
    rows = rng.permutation(batch).astype(np.int64)
    lengths = kv_len[rows]
    lo = rng.integers(0, 8, size=batch).astype(np.int64)
    hi = (lengths * 2 - rng.integers(0, 64, size=batch)).astype(np.int64)
    excess = rng.choice([0, 1, 1, 1, 3], size=batch).astype(np.int64)
    shape = (batch, longest + 5)
    mass = (rng.choice([0.0, 0.25, 1.0], size=shape) if ties else rng.random(shape)).astype(dtype)
    start = (rng.random(len(tokens)) if not ties else np.zeros(len(tokens))).astype(np.float32)
    results = {}
    for threads in (1, 2, 3, 8):
        stat = start.copy()
        for _ in range(3):  # a few steps: the statistic accumulates
            picked = native.select_lowest(tokens, block_table, TPB, rows, lengths, lo, hi, excess, stat, mass,
                                          None, threads)
        results[threads] = (picked, stat)
    one_rows, one_positions = results[1][0]
    assert len(one_rows) > batch // 2  # the batch evicts
    for threads, ((victim_rows, positions), stat) in results.items():
        np.testing.assert_array_equal(victim_rows, one_rows, err_msg=f"{threads} threads")
        np.testing.assert_array_equal(positions, one_positions, err_msg=f"{threads} threads")
        assert stat.tobytes() == results[1][1].tobytes(), f"{threads} threads"


def test_threads_must_be_positive():
    native = load()
    tokens, block_table, kv_len = random_layout(np.random.default_rng(0), 2, 64)
    rows = np.arange(2, dtype=np.int64)
    zeros = np.zeros(2, dtype=np.int64)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        native.select_lowest(tokens, block_table, TPB, rows, kv_len, zeros, zeros, zeros, None, None, None, 0)
    with pytest.raises(ValueError, match="threads must be >= 0"):
        StepConfig(threads=-1)
    with pytest.raises(ValueError, match="step_threads must be >= 0"):
        EngineConfig(step_threads=-1)
    assert StepConfig(threads=1).pass_threads() == 1 and 1 <= StepConfig().pass_threads() <= 4
    assert EngineConfig().step_threads == StepConfig().threads == 0  # automatic by default


def h2o_step(host: Host, threads: int, native: bool) -> DecodeStep:
    config = StepConfig("dense", check_invariants=False, impl="cpp", threads=threads)
    policy = make_policy("h2o", 3600)
    return DecodeStep(config, host.num_blocks, host.tpb, policy if native else decided_in_python(policy), None,
                      host.shared.__contains__, lambda: host.shared)


@pytest.mark.parametrize("native", [True, False])
def test_a_large_h2o_batch_steps_alike_on_one_and_on_several_threads(native):
    """40 requests of ~4k tokens (the pass inside the call, and the one a decision made in Python
    runs): the threaded steps' outputs, tables and statistics equal the one-threaded step's; while
    a block is shared, the pass keeps one thread and still agrees."""
    batch, prompt = 40, 4000
    hosts = [Host(batch * (prompt // TPB + 3), TPB) for _ in range(3)]
    steps = [h2o_step(host, threads, native) for host, threads in zip(hosts, (1, 2, 4))]
    rng = np.random.default_rng(3)
    for step in steps:
        for req in range(batch):
            step.add_request(req)
    for t in range(6):
        mass = rng.random((batch, prompt + t + 1)).astype(np.float32)
        outs = []
        for step, host in zip(steps, hosts):
            num_new, blocks = [], []
            for req in range(batch):
                n = prompt - req % TPB if t == 0 else 1
                need = -(-(step.kv_len(req) + n) // TPB) - step.num_blocks(req)
                num_new.append(n)
                blocks.append(host.allocate(max(need, 0)))
            offsets = np.cumsum([0] + [len(b) for b in blocks])
            out = step.run(StepInput(list(range(batch)), num_new, offsets, [b for bl in blocks for b in bl],
                                     mass=mass))
            host.release(out.table.freed)
            outs.append(out)
        if t == 3:  # a prefix block becomes shared: one thread from here on, the same answers
            for host in hosts:
                host.shared.add(steps[0].block_ids(0)[0])
        for out in outs[1:]:
            np.testing.assert_array_equal(out.victim_offsets, outs[0].victim_offsets)
            np.testing.assert_array_equal(out.victims, outs[0].victims)
            np.testing.assert_array_equal(out.table.move_src, outs[0].table.move_src)
            np.testing.assert_array_equal(out.table.kv_lens, outs[0].table.kv_lens)
        if 0 < t <= 3:  # every request evicts one token per decode step (later request 0 keeps its shared block)
            assert len(outs[0].victims) == batch
    for step in steps[1:]:
        assert step.slots.stats["mass"].tobytes() == steps[0].slots.stats["mass"].tobytes()
        for req in range(batch):
            assert step.block_ids(req) == steps[0].block_ids(req)
    assert all(step.stats.native_decisions == (6 if native else 0) for step in steps)
