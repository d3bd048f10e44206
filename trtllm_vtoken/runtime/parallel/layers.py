# SPDX-License-Identifier: Apache-2.0
"""Column- and row-parallel projections, and the sharding of a loaded model onto one rank.

    column-parallel  y_r = x @ W[rows_r]^T              each rank: its own output features
    row-parallel     y   = sum_r x_r @ W[:, cols_r]^T   each rank: its own input features, then
                                                         an all-reduce sums the partial outputs

A decoder layer on rank r (TensorParallelPlan decides the rows and columns):

    h -> q_proj, k_proj, v_proj (column) -> attention over rank r's heads and KV pool
      -> o_proj (row, all-reduce) -> + residual -> gate_proj, up_proj (column) -> down_proj
      (row, all-reduce) -> + residual

Two all-reduces per layer; everything else is local. The forward code of ``runtime/model.py`` runs
unchanged: the rank's layers carry a config with its own head counts.
"""

from __future__ import annotations

import torch
from torch import nn

from trtllm_vtoken.consistency import RankGroup
from trtllm_vtoken.runtime.model import LlamaForCausalLM
from trtllm_vtoken.runtime.parallel.partition import TensorParallelPlan


class RowParallelLinear(nn.Module):
    """A linear layer holding the input columns ``cols`` of the full weight; its output is the
    sum over ranks of the partial products (one all-reduce)."""

    def __init__(self, full: nn.Linear, cols: range, ranks: RankGroup) -> None:
        super().__init__()
        if full.bias is not None:
            raise ValueError("row-parallel layers here carry no bias (Llama has none)")
        self.weight = nn.Parameter(full.weight.detach()[:, cols.start : cols.stop].clone(), requires_grad=False)
        self.ranks = ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ranks.all_reduce_sum(nn.functional.linear(x, self.weight))


def column_parallel(full: nn.Linear, rows: range) -> nn.Linear:
    """A linear layer computing only the output features ``rows`` of ``full``."""
    if full.bias is not None:
        raise ValueError("column-parallel layers here carry no bias (Llama has none)")
    part = nn.Linear(full.in_features, len(rows), bias=False, dtype=full.weight.dtype, device=full.weight.device)
    part.weight = nn.Parameter(full.weight.detach()[rows.start : rows.stop].clone(), requires_grad=False)
    return part


def shard_model(model: LlamaForCausalLM, rank: int, ranks: RankGroup) -> LlamaForCausalLM:
    """Keeps only rank ``rank``'s share of ``model`` (in place) and returns it.

    The model must be the whole, loaded model; ``ranks`` carries the all-reduce of the row-parallel
    layers. Afterwards ``model.config`` has the rank's head counts (the KV pool is sized from it)
    and ``model.tensor_parallel`` is ``(rank, world_size)``.
    """
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError(f"model is already sharded as rank {model.tensor_parallel}")
    if not 0 <= rank < ranks.world_size:
        raise ValueError(f"rank {rank} outside [0, {ranks.world_size})")
    full_cfg = model.config
    plan = TensorParallelPlan.for_model(full_cfg, ranks.world_size)
    cfg = plan.local_config(full_cfg, rank)
    q, kv, inter = plan.q_features(rank), plan.kv_features(rank), plan.intermediate[rank]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj, attn.k_proj, attn.v_proj = (column_parallel(attn.q_proj, q), column_parallel(attn.k_proj, kv),
                                                 column_parallel(attn.v_proj, kv))
        attn.o_proj = RowParallelLinear(attn.o_proj, q, ranks)
        attn.cfg = cfg
        mlp.gate_proj, mlp.up_proj = column_parallel(mlp.gate_proj, inter), column_parallel(mlp.up_proj, inter)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, inter, ranks)
    model.config = cfg
    model.full_config = full_cfg
    model.tensor_parallel = (rank, ranks.world_size)
    return model


def check_shard(model, tensor_parallel_size: int, ranks: RankGroup) -> None:
    """ValueError unless the model, the configured size and the group agree on the split."""
    if ranks.world_size != tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} needs a group of that many ranks "
                         f"(got {ranks.world_size}); LLM(...) and `vtoken generate --tp` start one process per rank")
    if ranks.world_size == 1:
        return
    if getattr(model, "simulated", False):
        raise ValueError("the simulated-attention backend runs on one rank only")
    if getattr(model, "tensor_parallel", None) != (ranks.rank, ranks.world_size):
        raise ValueError(f"the model must be sharded for rank {ranks.rank} of {ranks.world_size} (shard_model)")
