# SPDX-License-Identifier: Apache-2.0
"""Prefix sharing (simulated, exact block counts) and the SLA selection rule."""

from __future__ import annotations

import pytest

from trtllm_vtoken.bench.sharing import SharingBenchConfig, run_sharing_bench
from trtllm_vtoken.bench.sla import SlaBenchConfig, compare, reference_level, select


def test_sharing_never_moves_shared_blocks_and_reaches_the_ideal():
    result = run_sharing_bench(SharingBenchConfig(requests=4, decode_tokens=24, degrees=(1, 2, 4)))
    rows = {(r["degree"], r["variant"]): r for r in result["rows"]}
    for degree in (1, 2, 4):
        vtoken, naive = rows[degree, "vtoken"], rows[degree, "naive-evict"]
        assert vtoken["plans_touching_shared"] == 0
        assert vtoken["invariant_checks"] == vtoken["relocations"] > 0
        assert vtoken["blocks_end"] == vtoken["ideal_blocks_end"] <= naive["blocks_end"]
        assert vtoken["shared_blocks"] == naive["shared_blocks"] == (0 if degree == 1 else 4 // degree * 8)


def test_sharing_config_rejects_degrees_that_do_not_divide_the_requests():
    with pytest.raises(ValueError, match="must divide requests"):
        SharingBenchConfig(requests=6, degrees=(4,))


def test_sla_selects_the_highest_throughput_within_the_sla():
    """C_sel as the paper defines it: the feasible point with the highest throughput, which need
    not be the largest C that meets the SLA."""
    levels = [{"clients": c, "latency_p95_s": p, "tokens_per_s": t}
              for c, p, t in ((1, 1.0, 10.0), (2, 1.2, 18.0), (4, 1.9, 30.0), (8, 1.4, 16.0))]
    assert select(levels, 1.5)["clients"] == 2  # 8 meets the SLA too, with less throughput
    assert select(levels, 2.0)["clients"] == 4
    assert select(levels, 0.5) is None
    tie = [{"clients": c, "latency_p95_s": 1.0, "tokens_per_s": 5.0} for c in (2, 4)]
    assert select(tie, 1.0)["clients"] == 2
    with pytest.raises(ValueError, match="ascending"):
        SlaBenchConfig(concurrency=(4, 2))
    with pytest.raises(ValueError, match="c_ref"):
        SlaBenchConfig(concurrency=(2, 4), c_ref=8)


def test_sla_reference_is_naive_evict_at_c_ref_and_says_whether_the_budget_binds():
    def level(clients, waited_steps=0, preemptions=0):
        return {"clients": clients, "waited_steps": waited_steps, "preemptions": preemptions}

    reference, binds = reference_level([level(4), level(8), level(12, waited_steps=3), level(16, preemptions=1)], 8)
    assert (reference["clients"], binds) == (8, True)
    reference, binds = reference_level([level(4), level(8), level(16)], 8)
    assert (reference["clients"], binds) == (8, False)  # never binds: equal C, not capacity
    reference, binds = reference_level([level(4, waited_steps=1), level(8, waited_steps=9)], 4)
    assert (reference["clients"], binds) == (4, True)


def test_alternating_repeats_report_the_median_run_per_row():
    from trtllm_vtoken.bench.repeats import run_alternating

    calls = []
    speeds = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 6.0, 4.0])}

    def run(label, spec):
        calls.append(label)
        return {"tokens_per_s": next(speeds[label]), "spec": spec}

    rows = run_alternating([("a", 1), ("b", 2)], 3, run)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert [(r["label"], r["tokens_per_s"], r["tokens_per_s_min"], r["tokens_per_s_max"], r["spec"]) for r in rows] == \
        [("a", 2.0, 1.0, 3.0, 1), ("b", 5.0, 4.0, 6.0, 2)]
    with pytest.raises(ValueError, match="repeats must be positive"):
        run_alternating([("a", 1)], 0, run)


def test_sla_verdict_claims_a_direction_only_outside_the_spread():
    def point(speed, low, high):
        return {"tokens_per_s": speed, "tokens_per_s_min": low, "tokens_per_s_max": high}

    assert compare(point(12, 11, 13), point(10, 9, 10.5))["verdict"] == "higher"
    assert compare(point(8, 7, 9), point(10, 9.5, 11))["verdict"] == "lower"
    got = compare(point(10.4, 9.8, 11), point(10, 9, 10.5))
    assert got["verdict"] == "within the spread" and got["throughput_ratio_min"] < 1 < got["throughput_ratio_max"]
    with pytest.raises(ValueError, match="repeats must be positive"):
        SlaBenchConfig(repeats=0)
