# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench step``: what vToken's one step adds to an engine's host time per decode step.

The engine runs with the simulated-attention backend (no model: it isolates host work): every
request starts with ``context`` tokens, less up to a block so that requests cross block
boundaries on different steps (prefilled, not timed), and decodes one token per step; the
evicting rows hold a budget of ``context - 3/2 tokens_per_block`` live tokens, so from the first
decode step on every request evicts one token per step. Timed per decode step: the whole
``Engine.step()`` (scheduling, reservation, sampling, the step), minus the simulated attention
(it stands in for the GPU's forward; the step times it apart).

Where the budget ends within a block decides what dense compaction does besides the move. With
one count budget every evicting request settles at the same length (the budget), so either none
or all of them sit at a block boundary:

    mid-block (the rows)   the new token fits the tail block; the eviction's hole takes it: one
                           move, no block allocated or released
    at a block boundary    the new token needs a fresh block, which the move empties again: every
                           request allocates and releases one block per step (the extra row
                           "at a block boundary", budget ``context - tokens_per_block``)

In a workload of many lengths and budgets a request is at a boundary on about one step in
``tokens_per_block``; the two rows bracket that.

    native              plain block lists, no token table, no policy (the baseline)
    indirection-only    vToken's step with nothing evicted (StreamingLLM at a 1.0 ratio)
    vtoken              dense and lazy, H2O and StreamingLLM; dense H2O also at a block boundary

The attention mass arrives as float32 [batch, length], as attention kernels return it: from the
simulated attention (``mass="synthetic"``), whose per-request numpy work runs on the host's cores
and leaves their caches cold for the step after it, or as one fixed random array per layout shape
(``mass="fixed"``: the host only receives a buffer, as from a GPU's attention). Each row
runs with the C++ core and with the Python core (``step_impl``); "cpp-general" rows run the C++
core with its fused decode call off (``step_fused``), for comparing the two paths. Rows are repeated in
alternating order; a row's value is the median step of its median run, with the runs' range.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from trtllm_vtoken.config_base import require_positive
from trtllm_vtoken.runtime.config import EngineConfig

SPLIT = ("table", "policy", "core", "copy")
IMPLS = ("cpp", "python", "cpp-general")
"""The step's core: C++ (its fused call where a batch allows), Python, C++ on the general path only."""
MASSES = ("synthetic", "fixed")


@dataclass(frozen=True)
class StepBenchConfig:
    batches: tuple[int, ...] = (64, 256)
    context: int = 4096
    tokens_per_block: int = 32
    steps: int = 20
    warmup: int = 3
    repeats: int = 3
    impls: tuple[str, ...] = ("cpp", "python")
    """Among ``IMPLS``."""
    mass: str = "synthetic"
    """Where the attention mass comes from: "synthetic" (the simulated attention) or "fixed"."""
    seed: int = 0

    def __post_init__(self) -> None:
        require_positive(self, "context", "tokens_per_block", "steps", "repeats")
        if self.context <= 2 * self.tokens_per_block:
            raise ValueError(f"context ({self.context}) must exceed two blocks of {self.tokens_per_block} tokens")
        if not self.batches or min(self.batches) <= 0:
            raise ValueError(f"batches must be positive, got {self.batches}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not self.impls or set(self.impls) - set(IMPLS):
            raise ValueError(f"impls must be among {', '.join(IMPLS)}, got {self.impls}")
        if self.mass not in MASSES:
            raise ValueError(f"mass must be one of {MASSES}, got {self.mass!r}")

    def rows(self) -> list[tuple[str, dict[str, Any]]]:
        """(label, the row's settings) for one batch size, in run order."""
        rows: list[tuple[str, dict[str, Any]]] = [("native", dict(variant="native", mode="-", policy="-", impl="-"))]
        for impl in self.impls:
            rows.append((f"indirection-only {impl}", dict(variant="indirection-only", mode="dense",
                                                          policy="streaming_llm", impl=impl)))
            for policy in ("h2o", "streaming_llm"):
                for mode in ("dense", "lazy"):
                    rows.append((f"vtoken {mode} {policy} {impl}",
                                 dict(variant="vtoken", mode=mode, policy=policy, impl=impl)))
            if impl == self.impls[0]:  # the bracket's other end, once
                rows.append((f"vtoken dense h2o at a block boundary {impl}",
                             dict(variant="vtoken", mode="dense", policy="h2o", impl=impl, boundary=True)))
        return rows

    def budget(self, row: dict[str, Any]) -> int:
        """Live tokens an evicting row keeps: mid-block, or at a block boundary (see the module)."""
        tpb = self.tokens_per_block
        return self.context - tpb - (0 if row.get("boundary") else tpb // 2)

    def engine_config(self, batch: int, row: dict[str, Any]) -> EngineConfig:
        tpb, length = self.tokens_per_block, self.context + self.warmup + self.steps + 4
        values: dict[str, Any] = dict(
            tokens_per_block=tpb, num_blocks=batch * (-(-length // tpb) + 1) + 8, max_batch_size=batch,
            max_seq_len=length, seed=self.seed, admission="greedy",  # the pool holds every request
            prefix_caching=False,  # identical placeholder prompts must not share blocks
            variant="native" if row["variant"] == "native" else "vtoken")
        if row["variant"] != "native":
            values.update(mode=row["mode"], policy=row["policy"], step_impl=row["impl"].removesuffix("-general"),
                          step_fused=row["impl"] != "cpp-general",
                          budget="1.0" if row["variant"] == "indirection-only" else self.budget(row))
        return EngineConfig(**values)


def run_step_bench(cfg: StepBenchConfig, progress=None) -> dict[str, Any]:
    from trtllm_vtoken.bench.repeats import run_alternating

    results = []
    for batch in cfg.batches:
        runs = run_alternating(cfg.rows(), cfg.repeats, lambda label, row: _run(cfg, batch, row), progress,
                               key="host_us_p50", spread=("step_us",))
        native = next(r for r in runs if r["variant"] == "native")
        for r in runs:
            r["added_us_p50"] = r["host_us_p50"] - native["host_us_p50"]
            r["added_pct"] = 100.0 * r["added_us_p50"] / native["host_us_p50"]
        results += runs
    return {"config": asdict(cfg), "rows": results}


def _run(cfg: StepBenchConfig, batch: int, row: dict[str, Any]) -> dict[str, Any]:
    """One engine run of a row; the median host microseconds per timed decode step."""
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams
    from trtllm_vtoken.runtime.simulated import MODEL_SHAPES, SimulatedModel, SyntheticAttention

    # float32 mass, as attention kernels hand it to a host
    model = SimulatedModel(MODEL_SHAPES["llama-3.1-8b"], SyntheticAttention(cfg.seed), np.float32)
    if cfg.mass == "fixed":
        model.batch_mass = fixed_mass(cfg.seed)
    engine = Engine(model, cfg.engine_config(batch, row))
    params = SamplingParams(max_tokens=cfg.warmup + cfg.steps + 2, ignore_eos=True)
    for i in range(batch):  # lengths staggered by up to a block: requests cross blocks on different steps
        engine.add_request([1] * (cfg.context - i % cfg.tokens_per_block), params)
    engine.step()  # admission and prefill of every request
    if len(engine.running) != batch:
        raise RuntimeError(f"only {len(engine.running)} of {batch} requests were admitted")
    stats = engine.kv.step_stats
    host_us, evicted, moves, freed = [], 0, 0, 0
    split = dict.fromkeys(SPLIT, 0.0)
    was_enabled = gc.isenabled()
    gc.disable()  # as timeit: a collection landing in a timed step times the collector
    try:
        for i in range(cfg.warmup + cfg.steps):
            before = (stats.mass_seconds, dict(stats.seconds), stats.tokens_evicted, stats.moves, stats.blocks_freed)
            start = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - start
            if i < cfg.warmup:
                continue
            host_us.append(1e6 * (wall - (stats.mass_seconds - before[0])))
            for name in SPLIT:
                split[name] += 1e6 * (stats.seconds[name] - before[1][name]) / cfg.steps
            evicted += stats.tokens_evicted - before[2]
            moves += stats.moves - before[3]
            freed += stats.blocks_freed - before[4]
    finally:
        if was_enabled:
            gc.enable()
    if len(engine.running) != batch or engine.stats.preemptions:
        raise RuntimeError("a request finished or was preempted inside the timed steps")
    return {**row, "batch": batch, "mass": cfg.mass, "host_us_p50": float(np.median(host_us)),
            "host_us_steps_min": float(np.min(host_us)), "split_us": split,
            "step_us": sum(split.values()),  # the step's own time, timed inside it (not the glue around it)
            "evicted_per_step": evicted / cfg.steps, "moves_per_step": moves / cfg.steps,
            "blocks_freed_per_step": freed / cfg.steps,
            "metadata_bytes_per_token": engine.kv.step.metadata_bytes_per_token() if engine.kv.step else 0.0}


def fixed_mass(seed: int):
    """A ``batch_mass`` (``SimulatedModel``'s signature) whose function returns one fixed random
    float32 array per layout shape [B, L]: nothing runs on the host's cores to make it."""
    arrays: dict[tuple[int, ...], np.ndarray] = {}

    def batch_mass(req_ids: list[int], num_queries: list[int]):
        def mass(tokens: np.ndarray) -> np.ndarray:
            if tokens.shape not in arrays:
                arrays[tokens.shape] = np.random.default_rng(seed).random(tokens.shape, dtype=np.float32)
            return arrays[tokens.shape]

        return mass

    return batch_mass


def plot_step(result: dict[str, Any], path) -> None:
    """Added host microseconds per decode step over native, per row and batch (log scale;
    whiskers: range of the runs), with the targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["variant"] != "native"]
    batches = list(dict.fromkeys(r["batch"] for r in rows))
    fig, axes = plt.subplots(1, len(batches), figsize=(7 * len(batches), 5), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        mine = [r for r in rows if r["batch"] == batch]
        native = next(r for r in result["rows"] if r["variant"] == "native" and r["batch"] == batch)
        labels = [r["label"] for r in mine]
        added = [max(r["added_us_p50"], 1.0) for r in mine]
        low = [max(r["host_us_p50_min"] - native["host_us_p50"], 1.0) for r in mine]
        high = [max(r["host_us_p50_max"] - native["host_us_p50"], 1.0) for r in mine]
        colors = [{"cpp": "tab:blue", "cpp-general": "tab:green"}.get(r["impl"], "tab:orange") for r in mine]
        ax.barh(labels, added, color=colors, xerr=[np.maximum(np.subtract(added, low), 0),
                                                  np.maximum(np.subtract(high, added), 0)], capsize=3)
        target = 300 if batch <= 64 else 1000
        ax.axvline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(f"dense h2o target {target} us", (target, len(mine) - 0.5), fontsize=8, color="grey")
        spread = native["host_us_p50_max"] - native["host_us_p50_min"]
        ax.axvline(max(spread, 1.0), color="tab:red", linestyle=":", linewidth=0.8)
        ax.annotate("native's own spread", (max(spread, 1.0), -0.5), fontsize=8, color="tab:red")
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set(xlabel="host us per decode step added over native (median run)",
               title=f"batch {batch}: native {native['host_us_p50']:,.0f} us/step")
    c = result["config"]
    fig.suptitle(f"vtoken bench step (simulated attention, not counted): {c['context']} tokens of context, "
                 f"tokens_per_block {c['tokens_per_block']}, one eviction per request per step "
                 "(blue: C++ core, green: C++ general path only, orange: Python)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
