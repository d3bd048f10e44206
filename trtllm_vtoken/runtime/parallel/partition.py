# SPDX-License-Identifier: Apache-2.0
"""How a Llama model splits over tensor-parallel ranks.

Attention splits by **KV-head group**: a rank owns whole KV heads and the query heads that read
them (GQA), so attention never needs another rank's keys. Groups go to ranks in contiguous runs,
the first ranks taking one more when the count does not divide -- SmolLM2-135M (9 query heads, 3
KV heads, GQA 3:1) at TP=2:

    KV heads     | 0 1 | 2 |            query heads | 0 1 2 3 4 5 | 6 7 8 |
    rank         |  0  | 1 |            rank        |      0      |   1   |

The MLP splits its intermediate dimension the same way (1536 -> 768 + 768). q/k/v and gate/up
are column-parallel (each rank computes its own output features), o_proj and down_proj
row-parallel (each rank multiplies its own input features; an all-reduce sums the partial
outputs, so an uneven split needs nothing more). Embedding, norms and lm_head are replicated:
every rank ends a step with the same hidden state and the same logits.

A rank must own at least one KV head, so ``tensor_parallel_size <= num_key_value_heads``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trtllm_vtoken.runtime.model import LlamaConfig


def split_contiguous(total: int, parts: int) -> tuple[range, ...]:
    """``total`` items in ``parts`` contiguous runs; the first ``total % parts`` runs get one more."""
    if parts <= 0 or total < parts:
        raise ValueError(f"cannot split {total} items over {parts} ranks")
    base, extra = divmod(total, parts)
    runs, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        runs.append(range(start, stop))
        start = stop
    return tuple(runs)


@dataclass(frozen=True)
class TensorParallelPlan:
    """Which heads and intermediate features each rank owns."""

    world_size: int
    kv_heads: tuple[range, ...]
    """KV heads of each rank."""
    intermediate: tuple[range, ...]
    """MLP intermediate features of each rank."""
    group: int
    """Query heads per KV head."""
    head_dim: int

    @classmethod
    def for_model(cls, cfg: LlamaConfig, world_size: int) -> TensorParallelPlan:
        if world_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
        if world_size > cfg.num_key_value_heads:
            raise ValueError(f"tensor_parallel_size {world_size} exceeds the model's {cfg.num_key_value_heads} "
                             "KV heads: ranks split attention by whole KV heads")
        return cls(world_size, split_contiguous(cfg.num_key_value_heads, world_size),
                   split_contiguous(cfg.intermediate_size, world_size),
                   cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim)

    def q_heads(self, rank: int) -> range:
        kv = self.kv_heads[rank]
        return range(kv.start * self.group, kv.stop * self.group)

    def q_features(self, rank: int) -> range:
        """Rows of q_proj (and columns of o_proj) of this rank."""
        heads = self.q_heads(rank)
        return range(heads.start * self.head_dim, heads.stop * self.head_dim)

    def kv_features(self, rank: int) -> range:
        """Rows of k_proj and v_proj of this rank."""
        heads = self.kv_heads[rank]
        return range(heads.start * self.head_dim, heads.stop * self.head_dim)

    def local_config(self, cfg: LlamaConfig, rank: int) -> LlamaConfig:
        """The model config a rank's layers see: its own head and intermediate counts."""
        return dataclasses.replace(cfg, num_attention_heads=len(self.q_heads(rank)),
                                   num_key_value_heads=len(self.kv_heads[rank]),
                                   intermediate_size=len(self.intermediate[rank]))
