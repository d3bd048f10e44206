# SPDX-License-Identifier: Apache-2.0
"""Content keys of full KV blocks: a hash chained over (parent key, the block's token ids).

A block's KV depends on every token before it (attention mixes them in from layer 2 on), so a
key must name the whole prefix, not only the block's own tokens. Chaining does that in O(block):

    tokens   [t0 t1 t2 t3][t4 t5 t6 t7][t8 t9 ..
    keys     k0 = H(ROOT, t0..t3)   k1 = H(k0, t4..t7)   (a partial block has no key)

Two requests share a block exactly when their prompts agree on every token up to its end.
BLAKE2b (8-byte digest) keeps keys equal across processes and ranks (Python's ``hash`` of a
string is salted per process), and 64 bits make an accidental collision negligible at any pool
size a GPU holds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_KEY = 0
"""Parent key of a request's first block."""


def chain_key(parent_key: int, token_ids: Sequence[int] | np.ndarray) -> int:
    """The key of a block holding ``token_ids`` after the prefix named by ``parent_key``."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(int(parent_key).to_bytes(8, "little", signed=False))
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little")


def block_keys(token_ids: Sequence[int] | np.ndarray, tokens_per_block: int, num_blocks: int | None = None,
               parent_key: int = ROOT_KEY) -> list[int]:
    """Keys of the first ``num_blocks`` full blocks of ``token_ids`` (all full blocks if None)."""
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
    full = len(token_ids) // tokens_per_block
    count = full if num_blocks is None else min(num_blocks, full)
    keys, key = [], parent_key
    for i in range(count):
        key = chain_key(key, token_ids[i * tokens_per_block : (i + 1) * tokens_per_block])
        keys.append(key)
    return keys
