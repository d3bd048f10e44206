# SPDX-License-Identifier: Apache-2.0
"""The real-model experiments at toy size: they run, and their headline relations hold."""

from __future__ import annotations

import pytest

from trtllm_vtoken.bench.quality import QualityBenchConfig, run_quality_bench
from trtllm_vtoken.bench.shift import ShiftBenchConfig, run_shift_bench
from trtllm_vtoken.bench.utilization import UtilizationBenchConfig, run_utilization_bench

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(smollm2_model):
    return smollm2_model


def test_utilization_vtoken_keeps_fewer_blocks_than_naive_evict(model, smollm2_tokenizer):
    cfg = UtilizationBenchConfig(policies=("h2o", "streaming_llm"), workloads=("sharegpt",), requests=3,
                                 max_prompt_tokens=160, max_output_tokens=8)
    result = run_utilization_bench(cfg, model, smollm2_tokenizer)
    assert [(r["workload"], r["policy"]) for r in result["rows"]] == [("sharegpt", "h2o"), ("sharegpt", "streaming_llm")]
    for row in result["rows"]:
        runs = row["runs"]
        assert runs["native"]["tokens_evicted"] == 0
        assert runs["naive-evict"]["tokens_evicted"] == runs["vtoken"]["tokens_evicted"] > 0
        assert runs["vtoken"]["mean_blocks"] < runs["naive-evict"]["mean_blocks"]
        assert row["utilization_gain_pp"] > 0 and runs["vtoken"]["invariant_checks"] > 0


def test_quality_pairs_are_identical_and_the_default_order_is_the_plain_one(model, smollm2_tokenizer):
    """vtoken says what naive-evict says; H2O under the overlap scheduler, deciding at once (the
    default), gives every answer the plain order gives; each run's order is the one asked for. A
    pool that holds the four prompts (the default's 4,096 blocks took 40% of the test zeroing them)."""
    result = run_quality_bench(QualityBenchConfig(prompts=4, max_tokens=8, max_prompt_tokens=160, num_blocks=128,
                                                  budget="24"), model, smollm2_tokenizer)
    assert result["pairs"] == 4 and result["exact_match_rate"] == 1.0
    assert result["mean_paired_rouge_l_difference"] == 0.0 and result["output_length_ratio"] == 1.0
    plain = result["plain_order"]
    assert plain["same_answer_rate"] == 1.0 and plain["mean_paired_rouge_l_overlap_minus_plain"] == 0.0
    assert plain["rouge_l_vs_native"] == result["rouge_l_vs_native"]["vtoken"]
    at_once, lagged = {"overlap_scheduler": True, "decode_decision": "at_once"}, \
        {"overlap_scheduler": True, "decode_decision": "lagged"}
    assert result["order"] == {"native": at_once, "naive-evict": at_once, "vtoken": at_once,
                               "vtoken, plain order": {"overlap_scheduler": False, "decode_decision": "at_once"},
                               "vtoken, lagged": lagged}


def test_overhead_runs_every_row_and_splits_host_time(model, smollm2_tokenizer):
    from trtllm_vtoken.bench.overhead import RUNS, OverheadBenchConfig, run_overhead_bench

    result = run_overhead_bench(OverheadBenchConfig(requests=2, max_prompt_tokens=96, max_output_tokens=4, repeats=1),
                                model, smollm2_tokenizer)
    runs = {r["label"]: r for r in result["runs"]}
    assert list(runs) == [label for label, _ in RUNS]
    # Native's spread against itself covers both native rows, so neither "differs" from native.
    again = runs["native (again)"]
    assert result["native_spread_pct"] >= abs(again["overhead_pct"]) and not again["beyond_native_spread"]
    assert runs["native"]["host_seconds"]["table"] == 0  # the honest baseline runs no step
    native = runs["native"]
    for row in runs.values():  # EOS is ignored: every run serves the same tokens, at its own speed
        assert row["output_tokens"] == native["output_tokens"] > 0
        assert row["tokens_per_s"] == pytest.approx(row["output_tokens"] / row["wall_s"])
        assert row["throughput_vs_native"] == pytest.approx(row["tokens_per_s"] / native["tokens_per_s"])
    assert runs["indirection-only"]["tokens_evicted"] == runs["indirection-only + mass"]["tokens_evicted"] == 0
    assert runs["indirection-only"]["host_seconds"]["core"] > 0  # the step ran, with nothing to evict
    reclaiming = runs["vtoken dense (h2o 0.5)"]
    assert reclaiming["blocks_reclaimed"] > 0 and reclaiming["host_seconds"]["forward"] > 0
    assert {"forward", "table", "policy", "core", "copy"} <= set(reclaiming["host_seconds"])


def test_sweeps_vtoken_never_holds_more_than_naive_evict(model, smollm2_tokenizer):
    from trtllm_vtoken.bench.sweeps import SweepsBenchConfig, run_sweeps_bench

    cfg = SweepsBenchConfig(requests=2, max_prompt_tokens=96, max_output_tokens=4, tokens_per_block=(16, 32),
                            ratios=(0.5,), thresholds=(1,))
    points = run_sweeps_bench(cfg, model, smollm2_tokenizer)["points"]
    assert len(points) == len(cfg.points()) == 2 * 2 + 2 + 1 + 2
    for point in points:
        if "fewer_slots_than_naive_pct" in point:
            assert point["fewer_slots_than_naive_pct"] >= 0
        if point["variant"] == "vtoken" and point["moves"]:  # checked, except the throughput rows
            assert (point["invariant_checks"] > 0) == (point["sweep"] != "mode")


def test_sla_scan_selects_levels_from_one_run(model, smollm2_tokenizer):
    from trtllm_vtoken.bench.sla import SlaBenchConfig, run_sla_bench

    cfg = SlaBenchConfig(concurrency=(1, 2), requests_per_client=1, max_prompt_tokens=96, max_output_tokens=4,
                         num_blocks=64, repeats=2, c_ref=2)
    result = run_sla_bench(cfg, model, smollm2_tokenizer)
    scans, summary = result["scans"], result["summary"]
    assert summary["verdict"] in ("higher", "lower", "within the spread", "no verdict: a variant meets the SLA at no level")
    assert all(lv["tokens_per_s_min"] <= lv["tokens_per_s"] <= lv["tokens_per_s_max"] and
               lv["latency_p95_s_min"] <= lv["latency_p95_s"] <= lv["latency_p95_s_max"]
               for levels in scans.values() for lv in levels)
    assert [lv["clients"] for lv in scans["vtoken"]] == [1, 2]
    assert all(lv["output_tokens"] == 4 * lv["requests"] for levels in scans.values() for lv in levels)
    # The selection, recomputed from the scans by the definitions in bench/sla.py's docstring.
    fitting = [lv for lv in scans["naive-evict"] if lv["waited_steps"] == 0 and lv["preemptions"] == 0]
    reference = next(lv for lv in scans["naive-evict"] if lv["clients"] == cfg.c_ref)
    assert summary["c_ref"] == 2
    assert summary["budget_binds"] == (len(fitting) < len(scans["naive-evict"]))
    for levels in scans.values():  # fewer running at once than clients: someone waited for blocks
        assert all(lv["waited_steps"] > 0 for lv in levels if lv["max_running"] < lv["clients"])
    assert summary["sla_p95_s"] == pytest.approx(cfg.sla_factor * reference["latency_p95_s"])
    for variant, levels in scans.items():  # the feasible level with the highest throughput
        meeting = [lv for lv in levels if lv["latency_p95_s"] <= summary["sla_p95_s"]]
        best = max(meeting, key=lambda lv: lv["tokens_per_s"])["clients"] if meeting else None
        assert summary["selected"][variant] == best


def test_shift_bench_compares_shift_with_keep_on_the_same_evictions(model, smollm2_tokenizer):
    """Prefix caching is off in both modes: on in keep mode, the shared chat-template blocks' tokens
    would be kept on top of the budget, keep would evict other tokens than shift (which runs
    without caching), and the outputs would differ for that reason alone."""
    cfg = ShiftBenchConfig(requests=3, max_prompt_tokens=128, max_output_tokens=16, repeats=1)
    assert not any(cfg.engine_config(positions=p).prefix_caching for p in ("keep", "shift"))
    result = run_shift_bench(cfg, model, smollm2_tokenizer)
    runs = {r["label"]: r for r in result["runs"]}
    assert all(r["outputs_equal_keep"] for r in runs.values())
    assert runs["shift / dense"]["rerotation_passes"] > 0 and runs["keep / dense"]["rerotation_passes"] == 0
