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

Each run of a row pairs it with a native engine of its own, in the same process, step by step in
alternating order (native first on even steps, the row first on odd ones): a step of the row and
the native step beside it meet the same machine, so drift of the machine's speed (other tenants,
frequency) cancels in their difference. A row's added time is the median over its steps of
(row step - native step), its added % the median of (row step / native step - 1); the ``native``
row is native paired with native: how far identical code differs in this measurement (its noise
floor). Rows are repeated in alternating order; a row's values are those of its median run (by
added time), with the runs' range.

    step i (even)    native.step()   row.step()
    step i+1 (odd)   row.step()      native.step()
                     ---- paired: (row - native), (row / native - 1) per step ----

The attention mass arrives as float32 [batch, length], as attention kernels return it: as one
fixed random array per layout shape, handed over as a function of the layout (``mass="fixed"``,
the default: the host only receives a buffer, as from a GPU's attention, but the step registers
the batch on the engine's thread to give the function its layout), as one buffer [batch,
max_seq_len rounded up to blocks] handed over every step (``mass="buffer"``: a CUDA-graph host's
static output staged to one host buffer; the call on the worker registers the batch and repeats,
``step/beside.py``), as one such torch tensor per batch, a forward's output on the host, which
the engine hands to the step as a numpy view, as it hands over the real model's decode forward
(``mass="forward"``: a new array object each step, no copy; the call repeats with it), or from
the simulated attention (``mass="synthetic"``), whose per-request
numpy work runs on the host's cores; its time is subtracted, but it leaves the caches cold for
what runs after it, the paired native step included, so it narrows the difference in vToken's
favour. Each row runs with the C++ core and with the Python core (``step_impl``).

The engine begins its step before sampling the batch and finishes it after: with the C++ core a
native call runs on the step's worker thread meanwhile (``EngineConfig.step_overlap``), on the
core sampling leaves free, so the host waits only for what outlasts the sampling. "cpp-at-once"
rows run it on the engine's thread instead, before sampling: the same work, nothing beside it.
"step us" counts the step's own work wherever it ran (the worker's call as "core"); "waited us"
is the part of it the engine's thread waited for. Of "core", the C++ call's own clock says how
much went to the decision's pass ("decide", ``StepStats.core_parts``); the step alone
(``bench/step_alone.py``, "warm, timed") splits the compaction into plan and commit too, with
per-request marks the engine's rows run without.

    engine thread   forward | start: checks, registration | sampling ........ | finish: wait, copy, output
    worker                                               | decide, table step, layout |

"-overlap" rows run the engine's overlap scheduler (``docs/overlap.md``), the order of TensorRT-LLM's
overlap loop, with H2O deciding lagged (``decode_decision``): the step of iteration N starts after
forward N+1 was launched and ends before N+1 is sampled. With ``forward_us`` the simulated forward takes that much device time, as a GPU's: it is
launched and returns at once, and the engine's thread waits for it only when it samples, so the
step's host work (on the engine's thread "at once", as TensorRT-LLM's ``update_resources``, or on
the worker) runs in its shadow; their native partners run the same order and device time.

    device          | forward N+1 ...................... |
    engine thread   launch | step N (at once) | finish N | wait | sample N+1
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from trtllm_vtoken.bench.step_config import SPLIT, StepBenchConfig, judged, native_partner
from trtllm_vtoken.step.config import CORE_PARTS


def run_step_bench(cfg: StepBenchConfig, progress=None) -> dict[str, Any]:
    from trtllm_vtoken.bench.repeats import run_alternating

    results = []
    for batch in cfg.batches:
        results += run_alternating(cfg.rows(), cfg.repeats, lambda label, row: _run(cfg, batch, row), progress,
                                   key="added_us_p50",
                                   spread=("added_pct", "host_us_p50", "native_us_p50", "step_us"))
    for row in results:
        row.update(judged(row))
    return {"config": asdict(cfg), "rows": results}


def _run(cfg: StepBenchConfig, batch: int, row: dict[str, Any]) -> dict[str, Any]:
    """One paired run of a row (see the module): the row's engine and a native engine, stepped in
    alternating order; the medians of the row's and native's host microseconds per timed decode
    step and of their per-step difference and ratio."""
    engine = _prefilled(cfg, batch, row)
    native = _prefilled(cfg, batch, native_partner(row.get("overlap", False)))
    stats = engine.kv.step_stats
    host_us, native_us, evicted, moves, freed, waited, repeated = [], [], 0, 0, 0, 0.0, 0
    split, core_parts = dict.fromkeys(SPLIT, 0.0), dict.fromkeys(CORE_PARTS, 0.0)
    was_enabled = gc.isenabled()
    gc.disable()  # as timeit: a collection landing in a timed step times the collector
    try:
        for i in range(cfg.warmup + cfg.steps):
            before = (dict(stats.seconds), stats.tokens_evicted, stats.moves, stats.blocks_freed, stats.waited_seconds,
                      stats.repeated_steps, dict(stats.core_parts))
            if i % 2 == 0:
                native_step = _timed_step(native)
                row_step = _timed_step(engine)
            else:
                row_step = _timed_step(engine)
                native_step = _timed_step(native)
            if i < cfg.warmup:
                continue
            host_us.append(row_step)
            native_us.append(native_step)
            for name in SPLIT:
                split[name] += 1e6 * (stats.seconds[name] - before[0][name]) / cfg.steps
            for name in CORE_PARTS:
                core_parts[name] += 1e6 * (stats.core_parts[name] - before[6][name]) / cfg.steps
            evicted += stats.tokens_evicted - before[1]
            moves += stats.moves - before[2]
            freed += stats.blocks_freed - before[3]
            waited += 1e6 * (stats.waited_seconds - before[4]) / cfg.steps
            repeated += stats.repeated_steps - before[5]
    finally:
        if was_enabled:
            gc.enable()
    for e in (engine, native):
        if len(e.running) != batch or e.stats.preemptions:
            raise RuntimeError("a request finished or was preempted inside the timed steps")
    mine, theirs = np.array(host_us), np.array(native_us)
    return {**row, "batch": batch, "mass": cfg.mass, "host_us_p50": float(np.median(mine)),
            "native_us_p50": float(np.median(theirs)), "added_us_p50": float(np.median(mine - theirs)),
            "added_pct": float(100.0 * (np.median(mine / theirs) - 1.0)),
            "host_us_steps_min": float(np.min(mine)), "split_us": split,
            "core_parts_us": core_parts,  # of split_us["core"]: the C++ call's decide, plan, commit
            "step_us": sum(split.values()),  # the step's own time, timed inside it (not the glue around it)
            "waited_us": waited,  # of it, the engine's thread waiting for the call on the worker
            "evicted_per_step": evicted / cfg.steps, "moves_per_step": moves / cfg.steps,
            "blocks_freed_per_step": freed / cfg.steps,
            "repeated_share": repeated / cfg.steps,  # of the timed steps, those the repeated call served
            "metadata_bytes_per_token": engine.kv.step.metadata_bytes_per_token() if engine.kv.step else 0.0}


def _prefilled(cfg: StepBenchConfig, batch: int, row: dict[str, Any]):
    """An engine for the row with ``batch`` requests admitted and prefilled (not timed)."""
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams
    from trtllm_vtoken.bench.step_mass import buffer_mass, fixed_mass
    from trtllm_vtoken.runtime.simulated import MODEL_SHAPES, SimulatedModel, SyntheticAttention

    # float32 mass, as attention kernels hand it to a host
    model = SimulatedModel(MODEL_SHAPES["llama-3.1-8b"], SyntheticAttention(cfg.seed), np.float32, cfg.forward_us)
    if cfg.mass == "fixed":
        model.batch_mass = fixed_mass(cfg.seed)
    elif cfg.mass in ("buffer", "forward"):
        width = -(-cfg.max_seq_len() // cfg.tokens_per_block) * cfg.tokens_per_block
        model.batch_mass = buffer_mass(cfg.seed, width, tensor=cfg.mass == "forward")
    engine = Engine(model, cfg.engine_config(batch, row))
    params = SamplingParams(max_tokens=cfg.warmup + cfg.steps + 2, ignore_eos=True)
    for i in range(batch):  # lengths staggered by up to a block: requests cross blocks on different steps
        engine.add_request([1] * (cfg.context - i % cfg.tokens_per_block), params)
    engine.step()  # admission and prefill of every request
    if len(engine.running) != batch:
        raise RuntimeError(f"only {len(engine.running)} of {batch} requests were admitted")
    return engine


def _timed_step(engine) -> float:
    """Host microseconds of one ``engine.step()``, the simulated attention's own time subtracted."""
    stats = engine.kv.step_stats
    mass_before = stats.mass_seconds
    start = time.perf_counter()
    engine.step()
    wall = time.perf_counter() - start
    return 1e6 * (wall - (stats.mass_seconds - mass_before))


def plot_step(result: dict[str, Any], path) -> None:
    """Added host microseconds per decode step over the paired native, per row and batch (log
    scale; whiskers: range of the runs), with the targets and native-against-native's range."""
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
        added = np.array([max(r["added_us_p50"], 1.0) for r in mine])
        low = np.array([max(r["added_us_p50_min"], 1.0) for r in mine])
        high = np.array([max(r["added_us_p50_max"], 1.0) for r in mine])
        colors = [{"cpp": "tab:blue", "cpp-at-once": "tab:purple"}.get(r["impl"], "tab:orange")
                  for r in mine]
        ax.barh(labels, added, color=colors, xerr=[np.maximum(added - low, 0), np.maximum(high - added, 0)],
                capsize=3)
        target = 300 if batch <= 64 else 1000
        ax.axvline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(f"dense h2o target {target} us", (target, len(mine) - 0.5), fontsize=8, color="grey")
        floor = max(abs(native["added_us_p50_min"]), abs(native["added_us_p50_max"]), 1.0)
        ax.axvline(floor, color="tab:red", linestyle=":", linewidth=0.8)
        ax.annotate("native vs native", (floor, -0.5), fontsize=8, color="tab:red")
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set(xlabel="host us per decode step added over the paired native (median run)",
               title=f"batch {batch}: native {native['native_us_p50']:,.0f} us/step")
    c = result["config"]
    fig.suptitle(f"vtoken bench step ({c['mass']} mass): {c['context']} tokens of context, "
                 f"tokens_per_block {c['tokens_per_block']}, one eviction per request per step "
                 "(blue: C++ core beside sampling, purple: at once, orange: Python)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
