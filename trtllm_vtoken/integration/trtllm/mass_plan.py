# SPDX-License-Identifier: Apache-2.0
"""How the attention-mass passes tile their work so that their transient memory stays under a cap.

The passes run beside TensorRT-LLM's forward (prefill, inside the attention hook) and in
``update_resources`` (decode), next to a KV pool sized to fill the device. Whatever they allocate
is taken from that pool's headroom, and the prefill hook also runs inside ``KvCacheCreator``'s
estimation forward, whose peak decides how large the pool may be. So each pass computes its plan
first, from the shapes and the cap, and allocates only what the plan names:

    prefill, per KV head:   keys     [num_keys, head_dim] float32           (when they fit a quarter of the cap)
                            scores   [query_tile * group, num_keys] float32 (one exact softmax per query row)
    decode, per layer:      scores   [rows, num_heads, num_keys] float32    (one exact softmax per head)
                            keys     [rows, key_blocks, num_kv_heads, tokens_per_block, head_dim]
                                     in the pool's dtype (the gather), then float32 (the product)

``workspace_bytes`` is the largest sum of those the pass holds at once; the suite measures the
allocations of the code path (on the meta device, at 70B shapes) against it and against the cap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trtllm_vtoken.config_base import require_positive_ints

DEFAULT_CAP_BYTES = 64 << 20
"""vToken's transient memory per mass pass unless the settings say otherwise (``mass_workspace_mib``)."""

LONGEST_QUERY_TILE = 64
"""Queries per tile when the cap allows more: the measured sweet spot of the CPU pass (larger
tiles leave the cache without making the matrix product faster)."""


@dataclass(frozen=True)
class PrefillMassPlan:
    """Tiles of one context row's mass pass (``prefill_mass``)."""

    query_tile: int
    """Queries whose scores are held at once, per KV head."""
    keys_float32: bool
    """True: a KV head's keys are converted to float32 once; False: per query tile, in key tiles."""
    key_tile: int
    """Keys converted at once when ``keys_float32`` is False (else all of them)."""
    workspace_bytes: int

    @classmethod
    def of(cls, num_keys: int, num_heads: int, num_kv_heads: int, head_dim: int,
           cap_bytes: int = DEFAULT_CAP_BYTES) -> PrefillMassPlan:
        """ValueError when one query row's scores alone exceed the cap (a prompt longer than
        ``cap / (4 * group)`` tokens: 2M tokens at 64 MiB and 8 query heads per KV head)."""
        require_positive_ints(num_keys=num_keys, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, cap_bytes=cap_bytes)
        group = num_heads // num_kv_heads
        row_bytes = group * num_keys * 4  # one query's scores, all heads of its group
        keys_bytes = num_keys * head_dim * 4
        keys_float32 = keys_bytes <= cap_bytes // 4
        key_tile = num_keys if keys_float32 else max(1, (cap_bytes // 4) // (head_dim * 4))
        held = keys_bytes if keys_float32 else key_tile * head_dim * 4
        per_query = row_bytes if keys_float32 else row_bytes + group * key_tile * 4  # + a key tile's product
        if held + per_query > cap_bytes:
            raise ValueError(f"one query's scores over {num_keys} keys take {row_bytes} bytes: with its keys, "
                             f"more than the mass pass's cap of {cap_bytes} bytes")
        # beside them: each query's float32 copy (scaled) and row statistics, the tile's causal
        # mask, and the column sums [num_keys] with their sum into the mass
        per_query += group * (2 * head_dim + 2) * 4 + LONGEST_QUERY_TILE
        held += 2 * num_keys * 4
        query_tile = min(LONGEST_QUERY_TILE, (cap_bytes - held) // per_query)
        if query_tile < 1:
            raise ValueError(f"one query's scores over {num_keys} keys take {row_bytes} bytes: with its keys, "
                             f"more than the mass pass's cap of {cap_bytes} bytes")
        return cls(query_tile, keys_float32, key_tile, held + query_tile * per_query)


@dataclass(frozen=True)
class DecodeMassPlan:
    """Chunks of a batch's decode mass pass (``decode_mass``), one layer at a time: ``rows`` rows
    hold their scores over every key; their keys arrive ``key_blocks`` blocks at a time."""

    rows: int
    key_blocks: int
    workspace_bytes: int

    @classmethod
    def of(cls, num_rows: int, num_blocks: int, tokens_per_block: int, num_heads: int, num_kv_heads: int,
           head_dim: int, pool_itemsize: int, cap_bytes: int = DEFAULT_CAP_BYTES) -> DecodeMassPlan:
        """``num_blocks``: the padded block table's width. ValueError when one row's scores and
        one block of its keys exceed the cap (a context over ``cap / (8 * num_heads)`` tokens:
        128k at 64 MiB and 64 query heads)."""
        require_positive_ints(num_rows=num_rows, num_blocks=num_blocks, tokens_per_block=tokens_per_block,
                              num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              pool_itemsize=pool_itemsize, cap_bytes=cap_bytes)
        scores_bytes = num_heads * num_blocks * tokens_per_block * 4  # one row, float32, every key
        # one block of one row's keys: gathered in the pool's dtype, converted, scored
        block_bytes = tokens_per_block * (num_kv_heads * head_dim * (pool_itemsize + 4) + num_heads * 4)
        if scores_bytes + block_bytes > cap_bytes:
            raise ValueError(f"one decode row's scores over {num_blocks} blocks take {scores_bytes} bytes: "
                             f"with a block of its keys, more than the mass pass's cap of {cap_bytes} bytes")
        key_blocks = min(num_blocks, max(1, (cap_bytes // 2) // block_bytes), (cap_bytes - scores_bytes) // block_bytes)
        rows = min(num_rows, cap_bytes // (scores_bytes + key_blocks * block_bytes))
        return cls(rows, key_blocks, rows * (scores_bytes + key_blocks * block_bytes))


def padded_block_table(block_lists: Sequence[Sequence[int]], kv_lens: Sequence[int], tokens_per_block: int,
                       num_rows: int) -> np.ndarray:
    """The rows' block lists as one table [num_rows, max blocks needed] int64, padded with block 0
    (whose scores every pass masks out). ValueError for a row that attends to nothing or whose
    list is shorter than its length needs."""
    if len(block_lists) != num_rows or len(kv_lens) != num_rows:
        raise ValueError(f"{num_rows} rows of queries, {len(block_lists)} block lists, {len(kv_lens)} lengths")
    needed = [-(-n // tokens_per_block) for n in kv_lens]
    for i, (blocks, n) in enumerate(zip(block_lists, needed)):
        if kv_lens[i] < 1:
            raise ValueError(f"row {i}: kv_len {kv_lens[i]}: a decode row attends to its own token at least")
        if n > len(blocks):
            raise ValueError(f"row {i}: kv_len {kv_lens[i]} needs {n} blocks, the list has {len(blocks)}")
    table = np.zeros((num_rows, max(needed, default=0)), dtype=np.int64)
    for i, (blocks, n) in enumerate(zip(block_lists, needed)):
        table[i, :n] = blocks[:n]
    return table
