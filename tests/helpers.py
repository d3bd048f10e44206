# SPDX-License-Identifier: Apache-2.0
"""Small factories shared by the tests."""

from __future__ import annotations

import numpy as np
import torch

from trtllm_vtoken.core import BlockPool, TokenTable
from trtllm_vtoken.reclaim import ReclaimBackend, ReclaimConfig
from trtllm_vtoken.reclaim.copy import TorchCopyExecutor


def make_table(num_blocks: int = 16, tokens_per_block: int = 4) -> tuple[BlockPool, TokenTable]:
    pool = BlockPool(num_blocks, tokens_per_block)
    return pool, TokenTable(tokens_per_block, pool.is_shared)


def add_sequence(pool: BlockPool, table: TokenTable, req_id: int, num_tokens: int) -> list[int]:
    """Registers a request holding ``num_tokens`` tokens in freshly allocated blocks."""
    table.add_request(req_id)
    blocks = pool.allocate(-(-num_tokens // pool.tokens_per_block))
    assert blocks is not None
    table.sync_new_tokens(req_id, blocks, num_tokens)
    return blocks


def make_kv(pool: BlockPool, num_layers: int = 2, num_kv_heads: int = 2, head_dim: int = 8,
            seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A random KV pool [num_blocks, layers, 2, heads, tokens_per_block, head_dim]."""
    gen = torch.Generator().manual_seed(seed)
    shape = (pool.num_blocks, num_layers, 2, num_kv_heads, pool.tokens_per_block, head_dim)
    return torch.randn(shape, generator=gen).to(dtype)


def make_backend(pool: BlockPool, table: TokenTable, kv: torch.Tensor | None = None,
                 mode: str = "dense", threshold: int = 1) -> ReclaimBackend:
    executor = TorchCopyExecutor([kv]) if kv is not None else None
    config = ReclaimConfig(mode=mode, fragmentation_threshold=threshold, check_invariants=True)
    return ReclaimBackend(table, pool, executor, config)


def table_fingerprint(table: TokenTable) -> tuple:
    """Everything observable about the table, to assert that a failed call changed nothing."""
    out = []
    for r in sorted(table.request_ids()):
        s = table.seq(r)
        out.append((r, tuple(s.block_ids), s.kv_len, s.num_tokens, s.num_live, s.version,
                    s.slot_of[: s.num_tokens].tobytes(), s.live[: s.num_tokens].tobytes(),
                    s.token_at.tobytes(), s.live_per_block.tobytes()))
    return tuple(out)


def kv_of(table: TokenTable, kv: torch.Tensor, req_id: int, token_id: int) -> torch.Tensor:
    block, offset = table.lookup(req_id, token_id)
    return kv[block, :, :, :, offset].clone()


def ideal_blocks(num_live: int, tokens_per_block: int) -> int:
    return int(np.ceil(num_live / tokens_per_block))
