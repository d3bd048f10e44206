# SPDX-License-Identifier: Apache-2.0
"""H2O's native pass alone (``cpp/core/select.h`` select_lowest), outside any engine: the floor of
host-side H2O at a batch's shape, next to ``vtoken bench step``'s rows.

The layout is the bench's: ``batch`` requests of ``context`` live tokens in blocks of
``tokens_per_block``, one float32 mass row per request, one victim per request; each request's
blocks "contiguous" (as a fresh pool hands them out, the bench's engine included) or "scattered"
over the pool (as they lie once requests have come and gone). Timed per call (the median of
``repeats``), with the caches as the previous call left them ("warm") and after writing a buffer
larger than the last-level cache ("flushed", as after a forward and the engine's own work), on
each thread count asked for.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

FLUSH_BYTES = 64 << 20
"""Written between flushed calls: more than the machine's last-level cache."""


PLACEMENTS = ("contiguous", "scattered")


def pass_layout(batch: int, context: int, tokens_per_block: int, placement: str,
                seed: int = 0) -> dict[str, np.ndarray]:
    """select_lowest's arguments for ``batch`` rows of ``context`` live ids, their blocks placed
    as ``placement`` says."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    rng = np.random.default_rng(seed)
    per_row = -(-context // tokens_per_block)
    num_blocks = batch * per_row + 1
    order = np.arange(num_blocks) if placement == "contiguous" else rng.permutation(num_blocks)
    block_table = order[: batch * per_row].astype(np.int32).reshape(batch, per_row)
    tokens = np.full(num_blocks * tokens_per_block, -1, dtype=np.int32)
    offsets = np.arange(context)
    for row in range(batch):
        slots = block_table[row, offsets // tokens_per_block].astype(np.int64) * tokens_per_block
        tokens[slots + offsets % tokens_per_block] = offsets
    kv_len = np.full(batch, context, dtype=np.int64)
    return dict(tokens=tokens, block_table=block_table, rows=np.arange(batch, dtype=np.int64), kv_len=kv_len,
                lo=np.full(batch, 4, dtype=np.int64), hi=kv_len - 64, excess=np.ones(batch, dtype=np.int64),
                stat=np.zeros(len(tokens), dtype=np.float32), mass=rng.random((batch, context), dtype=np.float32))


def time_pass(batch: int, context: int, tokens_per_block: int, threads: tuple[int, ...] = (1, 2),
              repeats: int = 15) -> list[dict[str, Any]]:
    """One row per (placement, caches, threads): the median microseconds of one pass."""
    from trtllm_vtoken.core.native import load

    native = load()
    if native is None:
        raise RuntimeError("the H2O pass alone needs the C++ core")
    flush = np.zeros(FLUSH_BYTES, dtype=np.uint8)
    rows = []
    for placement in PLACEMENTS:
        a = pass_layout(batch, context, tokens_per_block, placement)
        for caches in ("warm", "flushed"):
            for n in threads:
                samples = []
                for _ in range(repeats + 1):  # the first call warms up
                    if caches == "flushed":
                        flush += 1
                    start = time.perf_counter()
                    native.select_lowest(a["tokens"], a["block_table"], tokens_per_block, a["rows"], a["kv_len"],
                                         a["lo"], a["hi"], a["excess"], a["stat"], a["mass"], None, n)
                    samples.append(time.perf_counter() - start)
                rows.append(dict(batch=batch, context=context, tokens_per_block=tokens_per_block,
                                 placement=placement, threads=n, caches=caches,
                                 pass_us_p50=1e6 * float(np.median(samples[1:])),
                                 pass_us_min=1e6 * float(np.min(samples[1:])), repeats=repeats))
    return rows
