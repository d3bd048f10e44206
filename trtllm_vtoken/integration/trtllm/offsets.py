# SPDX-License-Identifier: Apache-2.0
"""TensorRT-LLM's block-offset encoding (``kernels::KVCacheIndex``), shared by the adapter and
its CPU tests.

``kv_cache_block_offsets`` is int32 ``[num_pools, max_num_sequences, 2 (K, V), max_blocks_per_seq]``.
For a block of the primary (GPU) pool, ``WindowBlockManager::setOffsets`` writes

    entry = block * layers_in_pool * kv_factor + field        field: 0 = K, 1 = V (0 for K-only)

i.e. the index of the block's K (V) half in units of one layer's half-block; the attention op adds
the layer's own offset inside the pool. The top bits of an entry name the pool tier: bit 31 alone
in releases up to 1.1 (``kSecondaryPoolFlag``); two bits (primary 0, secondary 1, tertiary 2) in
later ones. vToken only ever writes primary-pool blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

POOL_BITS = 2
"""Top bits of a ``KVCacheIndex`` that carry the pool tier (1.2 and later)."""
INDEX_MASK = (1 << (31 - POOL_BITS + 1)) - 1
"""Bits of an entry that carry the index itself (the low 30)."""


def encode(block_ids: Sequence[int] | np.ndarray, layers_in_pool: int, kv_factor: int = 2) -> np.ndarray:
    """Offsets of primary-pool blocks. Returns int32 ``[2, n]`` (row 1 equals row 0 when K-only).

    Raises ValueError for a negative block id, a bad ``kv_factor`` or an index that overflows the
    30 index bits.
    """
    if kv_factor not in (1, 2):
        raise ValueError(f"kv_factor must be 1 (K only) or 2, got {kv_factor}")
    if layers_in_pool <= 0:
        raise ValueError(f"layers_in_pool must be positive, got {layers_in_pool}")
    blocks = np.asarray(block_ids, dtype=np.int64)
    if blocks.size and blocks.min() < 0:
        raise ValueError("block ids must not be negative")
    base = blocks * layers_in_pool * kv_factor
    fields = np.array([0, 1 if kv_factor == 2 else 0], dtype=np.int64)
    out = base[None, :] + fields[:, None]
    if out.size and out.max() > INDEX_MASK:
        raise ValueError(f"block {int(blocks.max())} overflows the {31 - POOL_BITS + 1}-bit KV cache index")
    return out.astype(np.int32)


def decode(entries: Sequence[int] | np.ndarray, layers_in_pool: int, kv_factor: int = 2) -> np.ndarray:
    """Block ids of K entries (the inverse of ``encode(...)[0]``). ValueError for a non-primary entry."""
    values = np.asarray(entries, dtype=np.int64) & 0xFFFFFFFF
    if np.any(values > INDEX_MASK):
        raise ValueError("entries outside the primary pool (pool-tier bits set)")
    return values // (layers_in_pool * kv_factor)


def write_row(offsets, pool_index: int, row: int, block_ids: Sequence[int], layers_in_pool: int,
              kv_factor: int = 2) -> None:
    """Writes one sequence's blocks into ``offsets[pool_index, row, :, :n]`` in place (a torch or
    numpy array). Columns past ``n`` keep what they hold: kernels read only ``ceil(kv_len / tpb)``."""
    encoded = encode(block_ids, layers_in_pool, kv_factor)
    n = encoded.shape[1]
    if n > offsets.shape[-1]:
        raise ValueError(f"{n} blocks exceed max_blocks_per_seq {offsets.shape[-1]}")
    if isinstance(offsets, np.ndarray):  # (numpy >= 2.1 arrays have a .device too)
        offsets[pool_index, row, :, :n] = encoded
    else:  # torch: one host-to-device copy, no reallocation
        import torch

        offsets[pool_index, row, :, :n].copy_(torch.from_numpy(encoded), non_blocking=True)
