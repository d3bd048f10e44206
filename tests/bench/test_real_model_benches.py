# SPDX-License-Identifier: Apache-2.0
"""The real-model experiments at toy size: they run, and their headline relations hold."""

from __future__ import annotations

import pytest

from trtllm_vtoken.bench.quality import QualityBenchConfig, run_quality_bench
from trtllm_vtoken.bench.utilization import UtilizationBenchConfig, run_utilization_bench

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(smollm2_folder):
    from trtllm_vtoken.runtime.model import load_llama

    return load_llama(smollm2_folder)


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


def test_quality_pairs_are_identical_on_a_few_prompts(model, smollm2_tokenizer):
    result = run_quality_bench(QualityBenchConfig(prompts=4, max_tokens=8, max_prompt_tokens=160),
                               model, smollm2_tokenizer)
    assert result["pairs"] == 4 and result["exact_match_rate"] == 1.0
    assert result["mean_paired_rouge_l_difference"] == 0.0 and result["output_length_ratio"] == 1.0
