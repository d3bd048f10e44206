# SPDX-License-Identifier: Apache-2.0
"""Every timed headline of the main job's benchmarks carries its spread over the runs and a
verdict that names a side only outside it (the numbers themselves are not asserted: timing is
not tested). ``step`` is run here small; ``sla``'s and ``trtllm-mass``'s summaries are built from
runs whose spreads are set."""

from __future__ import annotations

import pytest

from trtllm_vtoken.bench.repeats import at_most_verdict
from trtllm_vtoken.bench.sla import compare
from trtllm_vtoken.bench.step import run_step_bench
from trtllm_vtoken.bench.step_config import StepBenchConfig
from trtllm_vtoken.bench.trtllm_mass import ratio_summary

VERDICTS = ("within the spread",)


def test_each_step_row_held_to_a_target_carries_its_spread_and_verdict():
    cfg = StepBenchConfig(batches=(4,), context=256, tokens_per_block=16, steps=3, warmup=1, repeats=2,
                          impls=("cpp", "python"))
    rows = run_step_bench(cfg)["rows"]
    judged = [r for r in rows if r["target"] is not None]
    assert {r["variant"] for r in judged} == {"indirection-only", "vtoken"}
    assert {r["impl"] for r in judged} == {"cpp"}  # the Python core is the specification: no target
    for row in judged:
        field = "added_pct" if row["variant"] == "indirection-only" else "added_us_p50"
        assert row[f"{field}_min"] <= row[field] <= row[f"{field}_max"]
        assert row["verdict"] in VERDICTS or row["verdict"].startswith(("<= ", "> "))
    assert all(r["verdict"] is None for r in rows if r["target"] is None)


@pytest.mark.parametrize(("low", "high", "verdict"), [(0.5, 0.9, "<= 1x"), (1.1, 1.3, "> 1x"),
                                                      (0.9, 1.1, "within the spread")])
def test_a_verdict_names_a_side_only_outside_the_spread(low, high, verdict):
    assert at_most_verdict(low, high, 1.0, "x") == verdict
    assert ratio_summary([low, high], [1.0, 1.0])["verdict"] == verdict


def test_sla_compares_throughput_with_its_range():
    def run(tokens_per_s, low, high):
        return {"tokens_per_s": tokens_per_s, "tokens_per_s_min": low, "tokens_per_s_max": high}

    apart = compare(run(12.0, 11.5, 12.5), run(10.0, 9.5, 10.5))
    assert apart["verdict"] == "higher" and apart["throughput_ratio_min"] <= apart["throughput_ratio"] \
        <= apart["throughput_ratio_max"]
    assert compare(run(10.2, 9.0, 11.0), run(10.0, 9.5, 10.5))["verdict"] == "within the spread"
