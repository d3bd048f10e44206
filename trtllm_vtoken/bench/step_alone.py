# SPDX-License-Identifier: Apache-2.0
"""vToken's step alone (no engine): ``DecodeStep.run`` driven directly at ``vtoken bench step``'s
shapes and settings (the step an engine of that row builds, ``runtime/engine_step.py``), each
request decoding one token per step, timed with the caches as the previous step left them
("warm") and after a buffer larger than the last-level cache was written ("flushed").

In the engine the step runs between the engine's own work (scheduling, sampling, the paired
native engine), which leaves the step's data and code out of the caches; the two columns say what
the step costs by itself and what cold caches add to it:

    warm      step  step  step  ...            the step's own work, its state in the caches
    flushed   [64 MB] step  [64 MB] step  ...  the same work, everything fetched from memory
    warm, timed                                warm, the compaction's plan and commit timed
                                               (the C++ call's split of "core")
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np

from trtllm_vtoken.bench.h2o_pass import FLUSH_BYTES
from trtllm_vtoken.bench.step_config import SPLIT, StepBenchConfig
from trtllm_vtoken.core.native import compaction_timed
from trtllm_vtoken.step.config import CORE_PARTS

ROWS = (("indirection-only", dict(variant="indirection-only", mode="dense", policy="streaming_llm")),
        ("vtoken dense h2o", dict(variant="vtoken", mode="dense", policy="h2o")),
        ("vtoken lazy h2o", dict(variant="vtoken", mode="lazy", policy="h2o")),
        ("vtoken dense streaming_llm", dict(variant="vtoken", mode="dense", policy="streaming_llm")))
CACHES = ("warm", "flushed", "warm, timed")
"""Warm, flushed, and warm again with the C++ core timing each compaction's plan and commit
(``core.native.compaction_timed``: the split of "core"; its marks slow the loop)."""


def time_step_alone(cfg: StepBenchConfig, batch: int, impl: str) -> list[dict[str, Any]]:
    """One row per (row of ``ROWS``, caches): the median and minimum microseconds of ``run``
    over ``cfg.steps`` decode steps (after ``cfg.warmup``), and the step's split."""
    out = []
    flush = np.zeros(FLUSH_BYTES, dtype=np.uint8)
    for label, settings in ROWS:
        row = {**settings, "impl": impl}
        step, pool, mass = _prefilled(cfg, batch, row)
        for caches in CACHES:
            samples, split, parts, evicted = [], dict.fromkeys(SPLIT, 0.0), dict.fromkeys(CORE_PARTS, 0.0), 0
            with compaction_timed() if caches.endswith("timed") else contextlib.nullcontext():
                for i in range(cfg.warmup + cfg.steps):
                    inp = _decode_input(step, pool, batch, mass)
                    if caches == "flushed":
                        flush += 1
                    before, parts_before = dict(step.stats.seconds), dict(step.stats.core_parts)
                    start = time.perf_counter()
                    done = step.run(inp)
                    elapsed = time.perf_counter() - start
                    pool.free(done.table.freed.tolist())
                    if i < cfg.warmup:
                        continue
                    samples.append(1e6 * elapsed)
                    evicted += done.num_evicted
                    for name in SPLIT:
                        split[name] += 1e6 * (step.stats.seconds[name] - before[name]) / cfg.steps
                    for name in CORE_PARTS:
                        parts[name] += 1e6 * (step.stats.core_parts[name] - parts_before[name]) / cfg.steps
            out.append(dict(batch=batch, label=label, impl=impl, caches=caches, **settings,
                            step_us_p50=float(np.median(samples)), step_us_min=float(np.min(samples)),
                            split_us=split, core_parts_us=parts, evicted_per_step=evicted / cfg.steps,
                            steps=cfg.steps))
    return out


def _prefilled(cfg: StepBenchConfig, batch: int, row: dict[str, Any]):
    """The row's step with ``batch`` requests of ``context`` tokens, less up to a block each (as in
    the bench's engine), registered in one prefill step; its pool, with room for every pass of
    ``CACHES`` (a request that evicts nothing grows by one token a step); a fixed float32 mass."""
    from trtllm_vtoken.core import BlockPool
    from trtllm_vtoken.reclaim.copy import AccountingCopyExecutor
    from trtllm_vtoken.runtime.engine_step import make_step

    config = cfg.engine_config(batch, row)
    tpb = config.tokens_per_block
    grown = len(CACHES) * (cfg.warmup + cfg.steps)  # tokens each request decodes over every pass
    num_blocks = config.num_blocks + batch * -(-grown // tpb)  # the engine's pool holds one pass
    pool = BlockPool(num_blocks, tpb)
    step = make_step(config, num_blocks, pool, AccountingCopyExecutor(1))
    lengths = [cfg.context - i % tpb for i in range(batch)]
    blocks = [pool.allocate(-(-n // tpb)) for n in lengths]
    for req_id in range(batch):
        step.add_request(req_id)
    width = cfg.context + grown + 1
    mass = np.random.default_rng(cfg.seed).random((batch, width), dtype=np.float32)
    step.run(_input(range(batch), lengths, blocks, mass if step.observes_attention() else None))
    return step, pool, mass


def _decode_input(step, pool, batch: int, mass: np.ndarray):
    """One token per request, a fresh block where its blocks are full."""
    tpb = step.tokens_per_block
    blocks = [pool.allocate(1) if step.kv_len(r) == step.num_blocks(r) * tpb else [] for r in range(batch)]
    return _input(range(batch), [1] * batch, blocks, mass if step.observes_attention() else None)


def _input(req_ids, num_new: list[int], blocks: list[list[int]], mass: np.ndarray):
    from trtllm_vtoken.step import StepInput

    return StepInput.of_lists(list(req_ids), num_new, blocks, mass=mass)
