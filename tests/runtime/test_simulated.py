# SPDX-License-Identifier: Apache-2.0
"""The simulated-attention backend: the real scheduler, table, planner and pool without a model."""

from __future__ import annotations

import numpy as np
import pytest

from trtllm_vtoken.bench.capacity import PAPER_SETTINGS, analytic_bound, frontier, run_once
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.runtime.simulated import MODEL_SHAPES, SimulatedModel, SyntheticAttention


def test_synthetic_attention_is_deterministic_normalised_and_growth_independent():
    a, b = SyntheticAttention(seed=1), SyntheticAttention(seed=1)
    a.weights(7, 100)
    grown = a.weights(7, 3000)  # grown in two steps
    assert np.array_equal(grown, b.weights(7, 3000))
    assert (grown[:4] == 50.0).all() and (grown[4:] > 0).all()
    ids = np.arange(0, 3000, 3)
    scores = a.scores(7, ids, 3000, num_queries=2)
    assert scores.sum() == pytest.approx(2.0) and not np.array_equal(a.weights(8, 3000), grown)


@pytest.mark.parametrize("variant,mode", [("naive-evict", "dense"), ("vtoken", "dense"), ("vtoken", "lazy")])
def test_simulated_engine_holds_real_block_accounting(variant, mode):
    shape = MODEL_SHAPES["llama-3.1-8b"]
    engine = Engine(SimulatedModel(shape), EngineConfig(
        variant=variant, mode=mode, policy="h2o", budget=0.5, tokens_per_block=16, num_blocks=400,
        max_seq_len=1024, check_invariants=True))
    ids = [engine.add_request([1] * 300, SamplingParams(max_tokens=200, ignore_eos=True)) for _ in range(4)]
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_integrity()
        if variant == "vtoken" and mode == "dense":
            for r in engine.running:
                assert len(engine.kv.step.block_ids(r)) == -(-engine.kv.step.num_live(r) // 16)
    done = [engine.pop_finished(i) for i in ids]
    assert all(len(r.output_ids) == 200 for r in done) and engine.kv.num_available == 400
    assert engine.kv.cache is None  # no KV tensors at all
    if variant == "vtoken":
        stats = engine.kv.step_stats
        assert stats.bytes_copied == stats.moves * shape.kv_bytes_per_token > 0
        assert stats.invariant_checks == stats.compactions


def test_capacity_frontier_at_small_scale_matches_the_packed_and_full_bounds():
    setting = PAPER_SETTINGS[0].scaled(32)  # 169 blocks, 126 + 384 tokens
    native = frontier(setting, "native")
    vtoken = frontier(setting, "vtoken")
    assert native["max_concurrency"] == analytic_bound(setting, "native", 0.5) == 5
    assert vtoken["max_concurrency"] == analytic_bound(setting, "vtoken", 0.5) == 10
    assert [r["feasible"] for r in vtoken["runs"]] == [True, False]
    assert frontier(setting, "naive-evict")["max_concurrency"] >= native["max_concurrency"]
    infeasible = run_once(setting, "native", 30)
    assert not infeasible["feasible"] and infeasible["steps"] == 1  # most requests could not even start


def test_lazy_compaction_runs_under_memory_pressure():
    """Lazy mode with a threshold no request reaches compacts only when the pool runs short: the
    manager passes ``pressure`` when fewer blocks are free than the batch may need next step."""
    def run(num_blocks: int):
        engine = Engine(SimulatedModel(MODEL_SHAPES["llama-3.1-8b"]), EngineConfig(
            variant="vtoken", mode="lazy", fragmentation_threshold=40, policy="h2o", budget=0.5,
            tokens_per_block=16, num_blocks=num_blocks, max_seq_len=512, admission="greedy", check_invariants=True,
            prefix_caching=False))  # identical placeholder prompts must not share blocks here
        for _ in range(4):
            engine.add_request([1] * 100, SamplingParams(max_tokens=120, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        return engine

    roomy, tight = run(400), run(48)  # 4 requests x 14 blocks at full length do not fit 48
    assert roomy.kv.step_stats.blocks_freed == 0 and roomy.kv.step_stats.compactions == 0
    assert tight.kv.step_stats.blocks_freed > 0 and tight.stats.preemptions == 0
