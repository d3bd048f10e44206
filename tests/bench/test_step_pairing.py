# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench step``'s paired runs: each step of a row beside a step of its own native engine,
in alternating order, and the row's added time from the per-step differences."""

from __future__ import annotations

import numpy as np
import pytest

from trtllm_vtoken.bench import step as step_bench
from trtllm_vtoken.bench.step_config import StepBenchConfig


def test_a_paired_run_alternates_the_order_and_reads_the_per_step_differences(monkeypatch):
    """Native first on even steps, the row first on odd ones; the added time and % are the medians
    of the per-step differences and ratios, warm-up steps left out."""
    cfg = StepBenchConfig(batches=(2,), context=96, tokens_per_block=8, steps=6, warmup=2, repeats=1)
    native_us = [900.0, 900.0, 100.0, 200.0, 100.0, 200.0, 100.0, 200.0]  # the first two: warm-up
    row_us = [999.0, 999.0, 120.0, 220.0, 130.0, 210.0, 115.0, 240.0]
    order: list[str] = []

    def timed_step(engine) -> float:
        kind = "native" if engine.config.variant == "native" else "row"
        order.append(kind)
        return (native_us if kind == "native" else row_us)[order.count(kind) - 1]

    monkeypatch.setattr(step_bench, "_timed_step", timed_step)
    row = dict(variant="indirection-only", mode="dense", policy="streaming_llm", impl="python")
    out = step_bench._run(cfg, 2, row)
    pairs = [order[i:i + 2] for i in range(0, len(order), 2)]
    assert pairs == [["native", "row"], ["row", "native"]] * ((cfg.warmup + cfg.steps) // 2)
    mine, theirs = np.array(row_us[2:]), np.array(native_us[2:])
    assert out["host_us_p50"] == pytest.approx(170.0) and out["native_us_p50"] == pytest.approx(150.0)
    assert out["added_us_p50"] == pytest.approx(np.median(mine - theirs)) == pytest.approx(20.0)
    assert out["added_pct"] == pytest.approx(100 * (np.median(mine / theirs) - 1)) == pytest.approx(17.5)


def test_every_row_reports_its_paired_native_and_the_runs_range(tmp_path):
    cfg = StepBenchConfig(batches=(4,), context=96, tokens_per_block=8, steps=3, warmup=1, repeats=3,
                          impls=("python",))
    rows = step_bench.run_step_bench(cfg)["rows"]
    assert [r["label"] for r in rows] == [label for label, _ in cfg.rows()]
    for r in rows:
        assert r["native_us_p50"] > 0 and r["host_us_p50"] > 0
        for name in ("added_us_p50", "added_pct", "step_us"):
            assert r[f"{name}_min"] <= r[name] <= r[f"{name}_max"], name
    assert rows[0]["variant"] == "native" and rows[0]["step_us"] == 0  # native against native: no step
