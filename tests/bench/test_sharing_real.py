# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench sharing --real``'s machinery on the tiny random model (the real model only
changes the numbers): exact hit rates, no plan on a shared or cached block, every relocation
checked, vtoken's decisions and outputs equal naive-evict's, fewer blocks once prompts are shared."""

from __future__ import annotations

import pytest
import torch

from trtllm_vtoken.bench.sharing_real import RealSharingConfig, run_real_sharing_bench
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM


class ByteTokenizer:
    """Characters folded into the tiny model's 128-token vocabulary."""

    def encode(self, text: str, chat: bool = False) -> list[int]:
        return [ord(c) % 128 for c in text]


@pytest.fixture(scope="module", params=["copy", "share"])
def result(request):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny()).eval()
    # 16 decode steps: lazy mode commits a compaction a step after planning it (its copies run in
    # the background), so it needs a few more steps than dense to show its freed blocks.
    cfg = RealSharingConfig(requests=4, prefix_tokens=32, suffix_tokens=24, decode_tokens=16, tokens_per_block=4,
                            budget="0.6", degrees=(1, 2, 4), prefix_reuse=request.param)
    return cfg, run_real_sharing_bench(cfg, model, ByteTokenizer())


def test_hit_rate_is_what_sharing_allows(result):
    """Every request arrives in one iteration: sharing requests take the group's prompt blocks as
    the first one's prefill writes them; copying ones (evicting rows, "copy") would read them
    before they are written, so they prefill their whole prompt."""
    cfg, res = result
    for row in res["rows"]:
        d = row["degree"]
        shares = cfg.prefix_reuse == "share" or row["variant"] == "native"
        want = (d - 1) / d * cfg.prefix_tokens / (cfg.prefix_tokens + cfg.suffix_tokens) if shares else 0.0
        assert row["prefix_hit_rate"] == pytest.approx(want), row
        assert row["cached_prompt_tokens"] == (cfg.requests * (d - 1) // d * cfg.prefix_tokens if shares else 0)


def test_every_relocation_checked_none_on_shared_or_cached_blocks(result):
    _, res = result
    vtoken = [r for r in res["rows"] if r["variant"] == "vtoken"]
    assert all(r["relocations"] > 0 and r["invariant_checks"] == r["relocations"] for r in vtoken)
    assert all(r["plans_touching_shared_or_cached"] == 0 for r in res["rows"])
    assert all(r["same_outputs_as_naive_evict"] for r in res["rows"] if r["variant"] != "native")


def test_vtoken_retains_fewer_blocks_than_naive_evict(result):
    _, res = result
    for row in res["rows"]:
        if row["variant"] == "vtoken":
            assert row["fewer_blocks_than_naive_pct"] > 0, row
        if row["variant"] == "native" and row["degree"] > 1:
            alone = next(r for r in res["rows"] if r["variant"] == "native" and r["degree"] == 1)
            assert row["retained_blocks_end"] < alone["retained_blocks_end"]  # shared prompts held once
