# SPDX-License-Identifier: Apache-2.0
"""Register tokens, evict some, compact densely, and print the table before and after.

Run: .venv/bin/python examples/01_token_table.py
"""

from __future__ import annotations

import torch

from trtllm_vtoken.core import BlockPool, TokenTable
from trtllm_vtoken.reclaim import ReclaimBackend, ReclaimConfig
from trtllm_vtoken.reclaim.copy import TorchCopyExecutor

TPB = 4


def show(table: TokenTable, req_id: int, title: str) -> None:
    print(title)
    live = set(table.live_ids(req_id).tolist())
    for block in table.block_ids(req_id):
        cells = []
        for offset in range(TPB):
            token = table.token_at_slot(req_id, block * TPB + offset)
            if token is None:
                cells.append("  _")
            else:
                cells.append(f"{token:3d}" if token in live else f"{token:2d}x")
        print(f"  block {block:2d}: [{' '.join(cells)}]")
    print(f"  kv_len {table.kv_len(req_id)}, live {table.num_live(req_id)}, "
          f"metadata {table.metadata_bytes_per_token():.1f} B/token")


def main() -> None:
    pool = BlockPool(num_blocks=8, tokens_per_block=TPB)
    table = TokenTable(TPB, pool.is_shared)
    kv = torch.randn(8, 2, 2, 1, TPB, 4)  # [blocks, layers, K/V, heads, tokens_per_block, head_dim]
    backend = ReclaimBackend(table, pool, TorchCopyExecutor([kv]), ReclaimConfig(check_invariants=True))

    table.add_request(0)
    table.sync_new_tokens(0, pool.allocate(3), total_len=11)
    table.evict_tokens(0, [1, 2, 5, 9])
    show(table, 0, "after evicting 1, 2, 5, 9 (x = dead, still occupying its slot):")
    freed = backend.reclaim([0])
    show(table, 0, f"after dense compaction ({backend.stats.moves} copies, {freed} block freed, I1/I2 checked):")
    print(f"free blocks in the pool: {pool.num_free} of {pool.num_blocks}")


if __name__ == "__main__":
    main()
