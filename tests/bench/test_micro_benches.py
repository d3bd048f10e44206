# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench host`` and ``vtoken bench trtllm-mass`` (``bench/host_cost.py``,
``bench/trtllm_mass.py``), and ``vtoken bench variants --no-prefix-caching``'s engine setting."""

from __future__ import annotations

import json

import pytest
import torch

from trtllm_vtoken.bench.host_cost import OPERATIONS, run_host_bench, time_registration
from trtllm_vtoken.bench.trtllm_mass import TrtllmMassBenchConfig
from trtllm_vtoken.bench.variants import VariantsBenchConfig
from trtllm_vtoken.cli import main
from trtllm_vtoken.core.native import load
from trtllm_vtoken.integration.trtllm.mass_cpp import bf16_kind, prefill_kind


def test_host_bench_times_every_operation_warm_and_after_a_sleep():
    result = run_host_bench(rounds=3, warm_calls=5)
    assert [r["operation"] for r in result["rows"]] == list(OPERATIONS)
    for row in result["rows"]:
        assert row["warm_us"] > 0 and row["after_sleep_us"] > 0
        assert row["ratio"] == pytest.approx(row["after_sleep_us"] / row["warm_us"])
    with pytest.raises(ValueError, match="rounds"):
        run_host_bench(rounds=0)


def test_registration_is_timed_with_writeable_and_read_only_arrays_where_the_core_is_built():
    rows = time_registration(calls=10)
    if load() is None:
        assert rows is None
        return
    assert [r["arrays"] for r in rows] == ["writeable", "read-only"] and all(r["call_us"] > 0 for r in rows)


def test_the_cli_writes_both_micro_benches_with_the_mass_passes_against_the_attention(tmp_path, capsys):
    assert main(["bench", "host", "--rounds", "2", "--out", str(tmp_path)]) == 0
    assert main(["bench", "trtllm-mass", "--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "after 1 ms asleep" in printed and "mass pass / attention" in printed
    assert len(json.loads((tmp_path / "host.json").read_text())["rows"]) == len(OPERATIONS)
    mass = json.loads((tmp_path / "trtllm_mass.json").read_text())
    decode = mass["decode"]
    assert mass["config"]["batch"] == 8 and mass["backend"] == "torch" and decode["max_abs_difference"] < 1e-5
    assert all(len(ms) == 3 for ms in decode["ms"].values())  # alternating rounds, each way
    # the decode pass the manager takes here, and the torch pass beside it where that is another
    assert decode["pass"] == (bf16_kind() or "torch") and f"({decode['pass']} decode pass" in printed
    assert len(decode["ms"]) == (4 if decode["pass"] == "torch" else 5)
    assert (decode["torch_pass_to_contiguous_attention"] is None) == (decode["pass"] == "torch")
    for summary in [decode["mass_pass_to_attention"], decode["mass_pass_to_contiguous_attention"]] + \
            [s for s in [decode["torch_pass_to_contiguous_attention"]] if s is not None] + \
            [r["mass_pass_to_attention"] for r in mass["prefill"]]:
        assert summary["ratio_min"] <= summary["ratio"] <= summary["ratio_max"]  # the spread, and its verdict
        assert summary["verdict"] in ("<= 1x", "> 1x", "within the spread")
    assert [r["tokens"] for r in mass["prefill"]] == [256, 512]
    for row in mass["prefill"]:  # the prefill pass here, and the torch pass beside it where that is another
        assert row["pass"] == (prefill_kind(getattr(torch, row["dtype"])) or "torch")
        assert (row["torch_pass_to_attention"] is None) == (row["pass"] == "torch") == ("torch pass" not in row["ms"])
    assert decode["peak_transient_bytes"]["mass pass"] < decode["peak_transient_bytes"]["specification"]
    with pytest.raises(ValueError, match="batch"):
        TrtllmMassBenchConfig(batch=0)
    with pytest.raises(ValueError, match="prompt dtype"):
        TrtllmMassBenchConfig(prompt_dtypes=("int8",))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_mass_bench_on_cuda_without_a_device_is_a_one_line_error(tmp_path, capsys):
    assert main(["bench", "trtllm-mass", "--quick", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "vtoken: error: vtoken bench trtllm-mass --device cuda needs a CUDA device"


def test_variants_can_run_without_prefix_caching():
    assert VariantsBenchConfig().engine_config("vtoken", "dense").prefix_caching
    assert not VariantsBenchConfig(prefix_caching=False).engine_config("vtoken", "dense").prefix_caching
