# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench step``: vToken's one step, on the engine with the simulated backend, against
native; prints a table and writes ``<out>/step.json`` (a list of rows) and ``step.png``; then the step
alone, caches warm and flushed (``step_alone.json``), and H2O's native pass alone (``step_pass.json``)."""

from __future__ import annotations

import argparse
import sys

from trtllm_vtoken.cli.bench_common import add_output_options, publish


def register(bench) -> None:
    step = bench.add_parser(
        "step", help="host time per decode step: native vs vToken's step (simulated attention, C++ and Python)",
        description="The engine with the simulated-attention backend at 4k tokens of context: native (plain "
                    "block lists), indirection-only (the step, nothing evicted), vtoken dense and lazy for H2O "
                    "and StreamingLLM (one eviction per request per step, the budget mid-block), each with the C++ "
                    "and the Python core, and dense H2O with the budget at a block boundary (every request "
                    "allocates and releases a block per step). The simulated attention is not counted. After the "
                    "table: the step alone (no engine), caches warm and flushed, and H2O's native pass alone.")
    step.add_argument("--batches", default="64,256", help="comma-separated batch sizes (default 64,256)")
    step.add_argument("--context", type=int, default=4096, help="tokens of context per request (default 4096)")
    step.add_argument("--tokens-per-block", type=int, default=32, help="default 32")
    step.add_argument("--steps", type=int, default=20, help="timed decode steps per run (default 20)")
    step.add_argument("--repeats", type=int, default=3,
                      help="runs per row in alternating order, each paired step by step with a native engine of "
                           "its own; the median run (by added time) is reported with the runs' range (default 3)")
    step.add_argument("--impl", default="both",
                      help="comma-separated cores among cpp, python, cpp-at-once (the C++ core's native call on "
                           "the engine's thread before sampling, not on the step's worker beside it), cpp-overlap "
                           "and cpp-at-once-overlap (the same under the engine's overlap scheduler: the step of "
                           "iteration N after forward N+1's launch), or both (= cpp,python; the default; cpp is "
                           "skipped where it is not built)")
    step.add_argument("--mass", choices=["fixed", "buffer", "forward", "synthetic"], default="fixed",
                      help="the attention mass: one fixed random array per layout shape, from a function of the "
                           "layout (the host only receives a buffer, as from a GPU; the default), one array per "
                           "batch handed over every step (a CUDA-graph host's staging buffer: the call on the "
                           "step's worker registers the batch and repeats), one forward's host tensor per batch that "
                           "the engine hands to the step as a new array each step, as the real model's decode "
                           "forward (no copy; the call repeats with it), or the simulated attention (its "
                           "per-request numpy work runs on these cores, not counted, and leaves their caches cold "
                           "for what runs after it, the paired native step included)")
    step.add_argument("--threads", type=int, default=0,
                      help="threads the C++ core's H2O pass may split a batch over (EngineConfig.step_threads; 0: "
                           "automatic, the process's cores up to 4, the default)")
    step.add_argument("--forward-us", type=float, default=0.0,
                      help="device time of the simulated forward, in microseconds: launched, it returns at once and "
                           "the engine waits for it when it samples, as for a GPU's (default 0: none)")
    add_output_options(step, "20 timed steps, 3 alternating runs per row (each target judged outside the spread)",
                       run_step, threads=False)


def run_step(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.step import plot_step, run_step_bench
    from trtllm_vtoken.bench.step_config import IMPLS, StepBenchConfig
    from trtllm_vtoken.cli.info import machine
    from trtllm_vtoken.core.native import load as load_native
    from trtllm_vtoken.report import format_table

    try:
        batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        raise ValueError(f"--batches must be comma-separated integers, got {args.batches!r}") from None
    impls = ["cpp", "python"] if args.impl == "both" else args.impl.split(",")
    if set(impls) - set(IMPLS):
        raise ValueError(f"--impl must list cores among {', '.join(IMPLS)} or be both, got {args.impl!r}")
    native = [i for i in impls if i != "python"]
    if native and load_native() is None:
        if args.impl != "both":
            raise ValueError(f"--impl {args.impl}: the C++ core is not built")
        impls = ["python"]
        print("note: the C++ core is not built; timing the Python core only", file=sys.stderr)
    cfg = StepBenchConfig(batches=batches, context=args.context, tokens_per_block=args.tokens_per_block,
                          steps=args.steps, warmup=2 if args.quick else 3,
                          repeats=args.repeats, impls=tuple(impls), mass=args.mass,
                          threads=args.threads, forward_us=args.forward_us)
    total = len(cfg.batches) * len(cfg.rows()) * cfg.repeats
    with tqdm(total=total, desc="bench step", unit="run", disable=None, file=sys.stderr) as bar:
        result = run_step_bench(cfg, progress=bar)
    source = {"synthetic": "simulated attention (not counted)", "fixed": "a fixed mass array per layout",
              "buffer": "one mass buffer per batch, the same every step",
              "forward": "one forward's mass tensor per batch, a new array each step"}[cfg.mass]
    print(f"vtoken bench step: engine + {source}, {cfg.context} tokens of context, "
          f"tokens_per_block {cfg.tokens_per_block}, one eviction per request per step; {cfg.steps} timed "
          f"steps per run, each paired step by step with a native engine; the median of {cfg.repeats} "
          f"alternating runs per row; H2O pass threads: {cfg.threads or 'automatic'}"
          + (f"; each forward {cfg.forward_us:g} us of simulated device time" if cfg.forward_us else ""))
    headers = ["batch", "row", "impl", "host us/step", "native us/step", "added us", "added runs min-max",
               "added %", "added % runs", "step us", "step runs min-max", "waited us", "table us", "policy us",
               "core us", "of core: decide us", "copy us", "evicted/step", "moves/step", "freed/step", "repeated",
               "target", "verdict"]
    rows = [[r["batch"], r["label"].removesuffix(f" {r['impl']}"), r["impl"], r["host_us_p50"], r["native_us_p50"],
             r["added_us_p50"], f"{r['added_us_p50_min']:,.0f} to {r['added_us_p50_max']:,.0f}", r["added_pct"],
             f"{r['added_pct_min']:.1f} to {r['added_pct_max']:.1f}",
             r["step_us"], f"{r['step_us_min']:,.0f}-{r['step_us_max']:,.0f}", r["waited_us"],
             *(r["split_us"][k] for k in ("table", "policy", "core")), core_parts(r, ("decide",)), r["split_us"]["copy"],
             r["evicted_per_step"], r["moves_per_step"], r["blocks_freed_per_step"], f"{r['repeated_share']:.0%}",
             r["target"] or "-", r["verdict"] or "-"]
            for r in result["rows"]]
    print(format_table(headers, rows))
    print("native us/step: the paired native engine's step in the same run; added: the median over the steps of "
          "(row step - native step), added %: of (row / native - 1); the native row is native paired with "
          "native (what identical code differs by here). step: the step's own time per decode step, timed "
          "inside it (the sum of the split; the engine's glue around it is not in it); waited: of it, what the "
          "engine's thread waited for the call on the step's worker beside its sampling; table: the step's batch "
          "layout outside the call; policy: mass, observe, select made before the call (vectorised); core: the "
          "step's one call (decision where the C++ core makes it, append, evict, plan, commit, the layout); of "
          "core: the C++ call's decision pass (its own clock; '-' for the Python core; the step alone below "
          "splits the rest); copy: the one copy of all "
          "moves (metadata only here); "
          "repeated: the timed steps the call on the worker repeated with the last one's bound arguments")
    where = machine()
    listed = [dict(r, context=cfg.context, tokens_per_block=cfg.tokens_per_block, steps=cfg.steps,
                   repeats=cfg.repeats, machine=where) for r in result["rows"]]
    publish(args.out, "step", listed, lambda rows, path: plot_step({"config": result["config"], "rows": rows}, path))
    print_step_alone(cfg, where, args.out)
    if native:
        print_pass_alone(args, cfg, where)
    return 0


def core_parts(row: dict, names: tuple[str, ...] = ("decide", "plan", "commit")) -> str:
    """A row's "of core" cell: the C++ core's call's parts (``StepStats.core_parts``), microseconds
    per step, joined by " / ", or "-" where none ran (the Python core)."""
    parts = row["core_parts_us"]
    if not any(parts.values()):
        return "-"
    return " / ".join(f"{parts[name]:,.0f}" for name in names)


def print_step_alone(cfg, where: dict, out) -> None:
    """The step alone (no engine), caches warm and flushed, at each batch (step_alone.json)."""
    from trtllm_vtoken.bench.step_alone import time_step_alone
    from trtllm_vtoken.report import format_table

    impls = [i for i in cfg.impls if i in ("cpp", "python")]  # run() makes its call at once, in no engine
    if not impls:
        return
    rows = [r for batch in cfg.batches for impl in impls for r in time_step_alone(cfg, batch, impl)]
    print(f"vToken's step alone (no engine): DecodeStep.run at the rows' settings, one token per request per "
          f"step; median of {cfg.steps} steps, caches as the last step left them (warm) or after 64 MB were "
          "written (flushed, as the engine's own work leaves them); 'warm, timed': warm, with the C++ core "
          "timing each compaction's plan and commit (core.native.compaction_timed; the marks slow it)")
    print(format_table(["batch", "row", "impl", "caches", "step us", "min us", "table us", "policy us", "core us",
                        "of core: decide / plan / commit us", "copy us", "evicted/step"],
                       [[r["batch"], r["label"], r["impl"], r["caches"], r["step_us_p50"], r["step_us_min"],
                         *(r["split_us"][k] for k in ("table", "policy", "core")), core_parts(r),
                         r["split_us"]["copy"], r["evicted_per_step"]]
                        for r in rows]))
    publish(out, "step_alone", [dict(r, context=cfg.context, tokens_per_block=cfg.tokens_per_block, machine=where)
                                for r in rows])


def print_pass_alone(args: argparse.Namespace, cfg, where: dict) -> None:
    """H2O's native pass alone at each batch's shape: the floor of host-side H2O (step_pass.json)."""
    from trtllm_vtoken.bench.h2o_pass import time_pass
    from trtllm_vtoken.report import format_table

    rows = [r for batch in cfg.batches
            for r in time_pass(batch, cfg.context, cfg.tokens_per_block, repeats=3 if args.quick else 15)]
    print(f"H2O's native pass alone (no engine): {cfg.context} live tokens per request, each request's blocks "
          "contiguous (a fresh pool, as in the engine above) or scattered over the pool, one victim per request; "
          "median of the calls, caches warm or flushed (64 MB written before each call)")
    print(format_table(["batch", "blocks", "caches", "threads", "pass us", "min us"],
                       [[r["batch"], r["placement"], r["caches"], r["threads"], r["pass_us_p50"], r["pass_us_min"]]
                        for r in rows]))
    publish(args.out, "step_pass", [dict(r, machine=where) for r in rows])
