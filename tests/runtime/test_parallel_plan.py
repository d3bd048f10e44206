# SPDX-License-Identifier: Apache-2.0
"""How the model splits over tensor-parallel ranks, and what an engine refuses (no processes)."""

from __future__ import annotations

import pytest
import torch

from trtllm_vtoken.cli import build_parser
from trtllm_vtoken.cli.engine_args import engine_settings
from trtllm_vtoken.consistency import SingleRank
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM
from trtllm_vtoken.runtime.parallel.layers import shard_model
from trtllm_vtoken.runtime.parallel.partition import TensorParallelPlan, split_contiguous

SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def test_split_gives_the_remainder_to_the_first_ranks():
    assert split_contiguous(3, 2) == (range(0, 2), range(2, 3))
    assert split_contiguous(1536, 2) == (range(0, 768), range(768, 1536))
    assert split_contiguous(7, 3) == (range(0, 3), range(3, 5), range(5, 7))
    with pytest.raises(ValueError):
        split_contiguous(2, 3)


def test_smollm2_at_tp2_splits_by_kv_head_group_two_and_one():
    plan = TensorParallelPlan.for_model(SMOLLM2, 2)
    assert [list(plan.q_heads(r)) for r in range(2)] == [[0, 1, 2, 3, 4, 5], [6, 7, 8]]
    assert [plan.kv_features(r) for r in range(2)] == [range(0, 128), range(128, 192)]
    assert [plan.q_features(r) for r in range(2)] == [range(0, 384), range(384, 576)]
    local = [plan.local_config(SMOLLM2, r) for r in range(2)]
    assert [(c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) for c in local] == [
        (6, 2, 768), (3, 1, 768)]
    assert all(c.hidden_size == 576 and c.head_dim == 64 for c in local)


def test_smollm2_at_tp3_is_even_and_tp4_is_refused():
    plan = TensorParallelPlan.for_model(SMOLLM2, 3)
    assert [len(plan.q_heads(r)) for r in range(3)] == [3, 3, 3]
    with pytest.raises(ValueError, match="exceeds the model's 3 KV heads"):
        TensorParallelPlan.for_model(SMOLLM2, 4)


class TwoRanks(SingleRank):
    """Rank 0 of two, for checks that never communicate."""

    world_size = 2


def test_shard_keeps_the_rank_s_rows_and_columns():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny())  # 4 query heads, 2 KV heads, head_dim 16
    full = model.model.layers[0]
    q, o, down = (full.self_attn.q_proj.weight.clone(), full.self_attn.o_proj.weight.clone(),
                  full.mlp.down_proj.weight.clone())
    shard_model(model, 0, TwoRanks())
    layer = model.model.layers[0]
    assert torch.equal(layer.self_attn.q_proj.weight, q[:32]) and torch.equal(layer.self_attn.o_proj.weight, o[:, :32])
    assert torch.equal(layer.mlp.down_proj.weight, down[:, :64])
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (2, 1)
    assert model.tensor_parallel == (0, 2)
    with pytest.raises(ValueError, match="already sharded"):
        shard_model(model, 1, TwoRanks())


def test_engine_refuses_a_size_its_group_or_model_does_not_have():
    model = LlamaForCausalLM(LlamaConfig.tiny())
    with pytest.raises(ValueError, match="needs a group of that many ranks"):
        Engine(model, EngineConfig(tensor_parallel_size=2, num_blocks=8))
    with pytest.raises(ValueError, match="must be sharded for rank 0 of 2"):
        Engine(model, EngineConfig(tensor_parallel_size=2, num_blocks=8), ranks=TwoRanks())
    with pytest.raises(ValueError, match="tensor_parallel_size must be positive"):
        EngineConfig(tensor_parallel_size=0)


def test_cli_tp_flag_reaches_the_config():
    args = build_parser().parse_args(["generate", "--tp", "2", "hi"])
    assert EngineConfig(**engine_settings(args)).tensor_parallel_size == 2
