# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench invariance``'s machinery on the tiny random model (the real model only changes
the numbers): with the default ``prefix_reuse="copy"`` every answer and eviction trace is the same
alone and in the batch, and vtoken's answers are naive-evict's; the preemption rows preempt; with
``batch_invariant`` on every log-probability is bitwise the same; the cost rows time both."""

from __future__ import annotations

import torch

from trtllm_vtoken.bench.invariance import InvarianceBenchConfig, run_invariance_bench
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM


class ByteTokenizer:
    """Characters folded into the tiny model's 128-token vocabulary, behind a fixed template."""

    def encode(self, text: str, chat: bool = False) -> list[int]:
        return [ord(c) % 128 for c in ("<system>You are helpful.</system>" if chat else "") + text]


def test_copy_rows_are_invariant_and_the_small_pool_preempts():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny()).eval()
    cfg = InvarianceBenchConfig(sharegpt_requests=0, new_tokens=10, tokens_per_block=8, tight_fraction=0.3,
                                cost_batches=(1, 3), rounds=1)
    result = run_invariance_bench(cfg, model, ByteTokenizer())
    n = len(result["prompt_tokens"])
    copy = [r for r in result["batch_rows"] if r["prefix_reuse"] == "copy"]
    assert len(copy) == 2 and all(r["same_output"] == r["same_decisions"] == n for r in copy)
    assert all(r["cached_prompt_tokens_alone"] > 0 for r in result["batch_rows"])
    assert result["copy_vtoken_equals_naive_evict"] == n
    assert {r["variant"] for r in result["preemption_rows"]} == {"native", "naive-evict", "vtoken"}
    assert any(r["preemptions"] > 0 for r in result["preemption_rows"])
    on = [r for r in result["bitwise_rows"] if r["batch_invariant"]]
    assert len(on) == 2 and all(r["same_logprobs"] == r["same_output"] == n for r in on)
    assert all(r["largest_cumulative_logprob_difference"] == 0.0 for r in on)
    assert [r["batch"] for r in result["cost_rows"]] == [1, 3]
    assert all(len(r["decode_ms_off"]) == len(r["decode_ms_on"]) == 1 and r["ratio_median"] > 0
               for r in result["cost_rows"])
