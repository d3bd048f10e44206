# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench core``: host cost of vToken's per-step bookkeeping at serving scale.

Each request starts with ``context`` live tokens. Every step, for every request: register the
token the engine wrote (allocating a block when the last one is full), evict one live token (a
uniformly random one, as a policy might), plan the relocation, apply its moves and release the
freed tail. No KV moves (metadata only): this is the host work a decode step pays before launch.

Three implementations of the same work, seeing the same seeded evictions and freeing the same
blocks:

    calls    the per-call API as the engine drives it (TokenTable + ReclaimBackend), request by
             request, each stage timed on its own
    python   the Python core's ``step_batch``: the whole batch in one call
    cpp      the C++ core's ``step_batch``: the whole batch in one native call

``python`` and ``cpp`` time the call plus freeing the released blocks in the pool.
"""

from __future__ import annotations

import functools
import gc
import time
from dataclasses import asdict, dataclass

import numpy as np

from trtllm_vtoken.config_base import require_positive
from trtllm_vtoken.core import BlockPool, TokenTable
from trtllm_vtoken.reclaim import ReclaimBackend, ReclaimConfig
from trtllm_vtoken.reclaim.step_batch import COMPACTIONS, step_batch

STAGES = ("sync", "evict", "plan", "apply")
IMPLS = ("calls", "python", "cpp")


@dataclass(frozen=True)
class CoreBenchConfig:
    batch: int = 256
    context: int = 4096
    tokens_per_block: int = 32
    steps: int = 50
    warmup: int = 5
    mode: str = "dense"
    impl: str = "python"
    seed: int = 0

    def __post_init__(self) -> None:
        require_positive(self, "batch", "context", "tokens_per_block", "steps")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        ReclaimConfig(mode=self.mode)  # validates the mode name
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {self.impl!r}")


def run_core_bench(cfg: CoreBenchConfig, progress=None) -> dict:
    """Runs the benchmark; returns per-stage median microseconds per step and metadata bytes.

    Python's cyclic garbage collector is paused while it runs, as ``timeit`` does: a collection
    landing inside a timed step would time the collector, not vToken (the tables are arrays and
    create no cycles; a serving loop sees the same collections whichever core it uses).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return (_run_calls if cfg.impl == "calls" else _run_step_batch)(cfg, progress)
    finally:
        if was_enabled:
            gc.enable()


def _pool(cfg: CoreBenchConfig) -> BlockPool:
    """Room for every request's context plus one block per step and a spare."""
    tpb = cfg.tokens_per_block
    return BlockPool(cfg.batch * (-(-(cfg.context + cfg.steps + cfg.warmup + 1) // tpb) + 1), tpb)


def _fill(cfg: CoreBenchConfig, table, pool: BlockPool) -> None:
    """Adds the batch's requests with their contexts. Lengths are staggered by up to one block, so
    requests cross block boundaries on different steps."""
    tpb = cfg.tokens_per_block
    for req in range(cfg.batch):
        length = cfg.context - req % tpb
        table.add_request(req)
        table.sync_new_tokens(req, pool.allocate(-(-length // tpb)), length)


def _run_calls(cfg: CoreBenchConfig, progress=None) -> dict:
    tpb = cfg.tokens_per_block
    pool = _pool(cfg)
    table = TokenTable(tpb, pool.is_shared)
    backend = ReclaimBackend(table, pool, None, ReclaimConfig(mode=cfg.mode))
    rng = np.random.default_rng(cfg.seed)
    _fill(cfg, table, pool)

    samples = {stage: [] for stage in STAGES}
    totals = []
    for step in range(cfg.warmup + cfg.steps):
        spent = dict.fromkeys(STAGES, 0)
        victims = [_random_live_token(table, req, rng) for req in range(cfg.batch)]
        for req in range(cfg.batch):
            # The engine's side (not timed): it hands over its own copy of the block list, with a
            # new block when the last one is full.
            seq = table.seq(req)
            blocks = list(seq.block_ids)
            if seq.kv_len == len(blocks) * tpb:
                blocks += pool.allocate(1)
            spent_sync = time.perf_counter_ns()
            table.sync_new_tokens(req, blocks, seq.kv_len + 1)
            t1 = time.perf_counter_ns()
            table.evict_token(req, victims[req])
            t2 = time.perf_counter_ns()
            plan = backend.plan(req)
            t3 = time.perf_counter_ns()
            if plan is not None:
                backend.submit(plan)
                backend.commit_blocking(req)
            t4 = time.perf_counter_ns()
            spent["sync"] += t1 - spent_sync
            spent["evict"] += t2 - t1
            spent["plan"] += t3 - t2
            spent["apply"] += t4 - t3
        if progress is not None:
            progress.update(1)
        if step >= cfg.warmup:
            for stage in STAGES:
                samples[stage].append(spent[stage] / 1e3)
            totals.append(sum(spent.values()) / 1e3)
    table.check_integrity()
    pool.check_integrity()
    return _summary(cfg, {stage: float(np.median(v)) for stage, v in samples.items()}, totals,
                    table.metadata_bytes_per_token(), backend.stats.blocks_freed, backend.stats.moves)


def _run_step_batch(cfg: CoreBenchConfig, progress=None) -> dict:
    tpb = cfg.tokens_per_block
    pool = _pool(cfg)
    if cfg.impl == "cpp":
        from trtllm_vtoken.core.native import native_table

        table = native_table(tpb)
        batch_step = functools.partial(table.step_batch, compaction=COMPACTIONS.index(cfg.mode))
    else:
        table = TokenTable(tpb, pool.is_shared)
        batch_step = functools.partial(step_batch, table, compaction=cfg.mode)
    rng = np.random.default_rng(cfg.seed)
    _fill(cfg, table, pool)
    req_ids = np.arange(cfg.batch, dtype=np.int64)
    num_new = np.ones(cfg.batch, dtype=np.int64)
    evict_offsets = np.arange(cfg.batch + 1, dtype=np.int64)
    totals, moves, freed_total = [], 0, 0
    for step in range(cfg.warmup + cfg.steps):
        victims, new_blocks, offsets = [], [], [0]
        for req in range(cfg.batch):  # the engine's side and the policy's choice: not timed
            victims.append(_random_live_token(table, req, rng))
            if table.kv_len(req) == table.num_blocks(req) * tpb:
                new_blocks += pool.allocate(1)
            offsets.append(len(new_blocks))
        victims_arr = np.array(victims, dtype=np.int64)
        blocks_arr, offsets_arr = np.array(new_blocks, dtype=np.int64), np.array(offsets, dtype=np.int64)
        start = time.perf_counter_ns()
        result = batch_step(req_ids, num_new, offsets_arr, blocks_arr, evict_offsets, victims_arr)
        freed = result[5]
        pool.free(freed.tolist())
        elapsed = (time.perf_counter_ns() - start) / 1e3
        moves += len(result[1])
        freed_total += len(freed)
        if progress is not None:
            progress.update(1)
        if step >= cfg.warmup:
            totals.append(elapsed)
    if cfg.impl == "python":
        table.check_integrity()
    pool.check_integrity()
    # One call covers every stage: no per-stage split (None in the JSON).
    return _summary(cfg, dict.fromkeys(STAGES), totals, table.metadata_bytes_per_token(),
                    freed_total, moves)


def _summary(cfg: CoreBenchConfig, stage_us: dict, totals: list[float], metadata: float, freed: int,
             moves: int) -> dict:
    return {
        "config": asdict(cfg),
        "step_us": stage_us,
        "total_us_median": float(np.median(totals)),
        "total_us_p90": float(np.percentile(totals, 90)),
        "per_request_us": float(np.median(totals)) / cfg.batch,
        "metadata_bytes_per_token": metadata,
        "blocks_freed": freed,
        "moves": moves,
    }


def _random_live_token(table, req_id: int, rng: np.random.Generator) -> int:
    """A uniformly random live token, the same draw on the Python and the C++ table."""
    num_tokens = table.num_tokens(req_id)
    while True:
        token = int(rng.integers(num_tokens))
        if table.is_live(req_id, token):
            return token


def plot_core(result: dict, path) -> None:
    """Step time per implementation and mode (log scale; whiskers: range over the runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["results"]
    modes = list(dict.fromkeys(r["config"]["mode"] for r in runs))
    impls = list(dict.fromkeys(r["config"]["impl"] for r in runs))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        rows = [next(r for r in runs if r["config"]["impl"] == impl and r["config"]["mode"] == m) for m in modes]
        values = [r["total_us_median"] for r in rows]
        spread = [[v - r.get("total_us_median_min", v) for v, r in zip(values, rows)],
                  [r.get("total_us_median_max", v) - v for v, r in zip(values, rows)]]
        xs = [i + (k - (len(impls) - 1) / 2) * width for i in range(len(modes))]
        ax.bar(xs, values, width, yerr=spread, capsize=3, label=impl)
        for x, v in zip(xs, values):
            ax.annotate(f"{v:,.0f}", (x, v), ha="center", va="bottom", fontsize=8)
    for target, label in ((2000, "Python target (2 ms)"), (200, "C++ target (200 us)")):
        ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(label, (-0.45, target), ha="left", va="bottom", fontsize=8, color="grey")
    c = runs[0]["config"]
    ax.set_yscale("log")
    ax.set_ylim(bottom=10)
    ax.set_xticks(range(len(modes)), modes)
    ax.set(ylabel="host time per decode step (us)",
           title=f"vtoken bench core: batch {c['batch']}, {c['context']} tokens, tokens_per_block {c['tokens_per_block']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
