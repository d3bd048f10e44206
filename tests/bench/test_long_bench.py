# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench long`` (``bench/long.py``) on the tiny model with a byte-level stand-in for the
tokenizer: its three parts run, vtoken holds the budget and a chunk where native and naive-evict
hold the prompt, its decisions equal naive-evict's, and its admission takes a longer prompt."""

from __future__ import annotations

import pytest
import torch

from trtllm_vtoken.bench.long import LongBenchConfig, documents, run_long_bench, steps
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM


class Bytes:
    """Token ids from UTF-8 bytes, folded into the tiny model's vocabulary."""

    def encode(self, text: str, chat: bool = False) -> list[int]:
        return [b % 128 for b in text.encode("utf-8")]


def test_long_bench_runs_its_three_parts_on_the_tiny_model():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny()).eval()
    cfg = LongBenchConfig(prompt_tokens=96, budgets=(16, 24), chunk=16, max_output_tokens=4, tokens_per_block=4,
                          pool_blocks=24, batch_prompts=3, batch_prompt_tokens=48, max_seq_len=160,
                          check_invariants=True, repeats=2)
    ticks = []
    result = run_long_bench(cfg, model, Bytes(), progress=type("P", (), {"update": lambda self, n: ticks.append(n)})())
    assert len(ticks) == steps(cfg)
    for row in result["single"]:
        runs = row["runs"]
        assert row["vtoken_equals_naive_evict"]
        assert runs["vtoken"]["peak_blocks"] <= row["peak_bound_blocks"] < runs["native"]["peak_blocks"]
        assert runs["vtoken"]["tokens_evicted"] == runs["naive-evict"]["tokens_evicted"] > 0
        for run in runs.values():  # the median of 2 alternating runs, with both timings' range
            assert run["ttft_s_min"] <= run["ttft_s"] <= run["ttft_s_max"]
            assert run["decode_tokens_per_s_min"] <= run["decode_tokens_per_s"] <= run["decode_tokens_per_s_max"]
    longest = result["longest"]
    assert longest["native"]["prompt_tokens"] < 24 * 4 < longest["vtoken"]["prompt_tokens"]
    assert longest["vtoken"]["served"]["peak_blocks"] <= 24
    assert result["batch"]["vtoken"]["most_running"] > result["batch"]["native"]["most_running"]
    assert all(len(p) == 48 for p in documents(Bytes(), 3, 48))
    with pytest.raises(ValueError, match="whole blocks"):
        LongBenchConfig(chunk=100)
    with pytest.raises(ValueError, match="repeats"):
        LongBenchConfig(repeats=0)
