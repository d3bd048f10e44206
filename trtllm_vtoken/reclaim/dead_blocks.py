# SPDX-License-Identifier: Apache-2.0
"""What a paged runtime can free without vToken: blocks in which every token is dead.

This is the naive-evict baseline's only reclamation. A block with one live token among
``tokens_per_block - 1`` dead ones stays allocated: that trapped memory is what vToken returns.
"""

from __future__ import annotations

from trtllm_vtoken.core.block_pool import BlockPool
from trtllm_vtoken.core.token_table import TokenTable


def fully_dead_blocks(table: TokenTable, req_id: int) -> list[int]:
    """Unshared blocks of the request that hold tokens, none of them live, in list order."""
    seq, tpb = table.seq(req_id), table.tokens_per_block
    counts = table.live_counts_per_block(req_id)
    return [
        b for i, b in enumerate(seq.block_ids)
        if counts[i] == 0 and i * tpb < seq.kv_len and not table.is_shared(b)
    ]


def release_dead_blocks(table: TokenTable, pool: BlockPool, req_id: int) -> int:
    """Drops the request's fully dead blocks from its list and frees them; returns how many."""
    blocks = fully_dead_blocks(table, req_id)
    if blocks:
        table.release_blocks(req_id, blocks)
        pool.free(blocks)
    return len(blocks)
