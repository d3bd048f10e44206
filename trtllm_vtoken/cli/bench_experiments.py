# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench overhead | sweeps | sla | sharing | shift``: the ablation, sweep, SLA-frontier,
prefix-sharing and position-shift experiments (each prints a table and writes
``<out>/<name>.json`` and a PNG)."""

from __future__ import annotations

import argparse
import sys


def register(bench) -> None:
    from trtllm_vtoken.cli.bench_common import Size, add_output_options

    overhead = bench.add_parser(
        "overhead", help="hooks-on/no-eviction cost vs native, and the host-time split (real model)",
        description="native vs indirection-only (vtoken hooks, budget 1.0) in one run, repeated in "
                    "alternating order; plus where a reclaiming run spends its host time.")
    overhead.add_argument("--requests", action=Size, type=int, default=16,
                          help="ShareGPT requests served at once (default 16)")
    overhead.add_argument("--max-output-tokens", action=Size, type=int, default=64,
                          help="new tokens per request (default 64)")
    overhead.add_argument("--repeats", type=int, default=3, help="runs per row, in alternating order (default 3)")
    add_output_options(overhead, "8 requests, 24 new tokens, 3 repeats", run_overhead,
                       quick=dict(requests=8, max_output_tokens=24))

    sweeps = bench.add_parser(
        "sweeps", help="tokens_per_block, retention ratio, lazy threshold, dense vs lazy (real model)",
        description="One knob at a time: retained KV, copies and throughput of vtoken (and naive-evict).")
    sweeps.add_argument("--requests", action=Size, type=int, default=8, help="ShareGPT requests per point (default 8)")
    sweeps.add_argument("--max-output-tokens", action=Size, type=int, default=48,
                        help="new tokens per request (default 48)")
    add_output_options(sweeps, "4 requests, prompts <= 128, 16 new tokens", run_sweeps,
                       quick=dict(requests=4, max_output_tokens=16))

    sla = bench.add_parser(
        "sla", help="throughput under a p95-latency SLA, closed loop (real model)",
        description="Closed-loop concurrency scan of naive-evict and vtoken from one KV budget; "
                    "SLA = 1.05 x naive-evict p95 at C_ref; throughput at each variant's C_sel.")
    sla.add_argument("--concurrency", action=Size, default="1,2,4,8,12,16",
                     help="ascending levels (default 1,2,4,8,12,16)")
    sla.add_argument("--requests-per-client", action=Size, type=int, default=3,
                     help="requests each closed-loop client sends (default 3)")
    sla.add_argument("--num-blocks", type=int, default=None,
                     help="KV block budget (default 96; --quick: 40, where naive-evict must wait at C = 8)")
    sla.add_argument("--repeats", type=int, default=3, help="runs per (variant, C), alternating (default 3)")
    sla.add_argument("--c-ref", type=int, default=8,
                     help="the reference concurrency: the SLA is 1.05 x naive-evict's p95 there (default 8, the paper's)")
    add_output_options(sla, "levels 2,4,8, two requests per client, 24 new tokens, 40 blocks", run_sla,
                       quick=dict(concurrency="2,4,8", requests_per_client=2))

    sharing = bench.add_parser(
        "sharing", help="prefix sharing at degree 1/2/4/8: retained blocks, no shared block moved "
                        "(simulated, or --real: the real model with prefix caching)",
        description="Shared prompt prefixes with private suffixes, H2O decoding. Simulated (default): "
                    "reference-counted blocks, naive-evict vs vtoken dense. --real: SmolLM2-135M with the "
                    "engine's automatic prefix caching, native / naive-evict / vtoken dense and lazy.")
    sharing.add_argument("--decode-tokens", type=int, default=None,
                         help="decode steps (default 256 simulated, 32 with --real)")
    sharing.add_argument("--real", action="store_true", help="run the real model with prefix caching")
    sharing.add_argument("--requests", action=Size, type=int, default=8, help="--real: requests per degree (default 8)")
    sharing.add_argument("--prefix-tokens", action=Size, type=int, default=1024,
                         help="--real: shared system prompt length (default 1024)")
    sharing.add_argument("--suffix-tokens", action=Size, type=int, default=1024,
                         help="--real: private suffix per request (default 1024: the paper's 8K + 8K, scaled)")
    sharing.add_argument("--budget", default="0.5",
                         help="--real: H2O budget per request, a ratio of its tokens outside shared blocks or a "
                              "count (default 0.5)")
    sharing.add_argument("--recent-ratio", type=float, default=0.1,
                         help="--real: share of the budget H2O keeps for the newest tokens (default 0.1)")
    sharing.add_argument("--no-check", action="store_true", help="--real: skip I1/I2/I4 on every relocation")
    sharing.add_argument("--prefix-reuse", choices=("copy", "share"), default="copy",
                         help="--real: how evicting requests reuse a cached prefix: copy (default: blocks of their "
                              "own, outputs independent of the batch) or share (held in common, protected while "
                              "shared: fewer blocks, outputs depend on the batch)")
    add_output_options(sharing, "64 decode steps (--real: 4 requests, 256 + 128 tokens, degrees 1, 2, 4)", run_sharing,
                       quick=dict(requests=4, prefix_tokens=256, suffix_tokens=128))

    shift = bench.add_parser(
        "shift", help="position-shift vs keep: tokens/s and the extra KV bytes re-rotation touches (real model)",
        description="keep and shift positions, dense and lazy compaction, one workload, repeated in "
                    "alternating order (median with min and max).")
    shift.add_argument("--requests", action=Size, type=int, default=8,
                       help="ShareGPT requests served at once (default 8)")
    shift.add_argument("--max-output-tokens", action=Size, type=int, default=64,
                       help="new tokens per request (default 64)")
    shift.add_argument("--policy", default="streaming_llm", help="eviction policy (default streaming_llm)")
    shift.add_argument("--budget", default="64", help="live tokens per request: count or ratio (default 64)")
    shift.add_argument("--repeats", action=Size, type=int, default=3,
                       help="runs per row, in alternating order (default 3)")
    shift.add_argument("--exactness", action="store_true",
                       help="instead: every policy, keep vs shift logits over 64 tokens on one prompt, with "
                            "and without attention sinks, next to keep mode's own float32 noise floor")
    add_output_options(shift, "4 requests, 24 new tokens, 2 repeats", run_shift,
                       quick=dict(requests=4, max_output_tokens=24, repeats=2))


def run_overhead(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.overhead import (
        RUNS,
        OverheadBenchConfig,
        plot_overhead,
        run_overhead_bench,
    )
    from trtllm_vtoken.cli.bench_common import load_model, publish
    from trtllm_vtoken.report import format_table

    cfg = OverheadBenchConfig(requests=args.requests, max_output_tokens=args.max_output_tokens, repeats=args.repeats)
    _, model, tokenizer = load_model(None)
    with tqdm(total=len(RUNS) * cfg.repeats, desc="bench overhead", unit="run", disable=None, file=sys.stderr) as bar:
        result = run_overhead_bench(cfg, model, tokenizer, progress=bar)
    print(f"vtoken bench overhead: {cfg.requests} ShareGPT requests, <= {cfg.max_output_tokens} new tokens, "
          f"{cfg.repeats} runs per row in alternating order (median)")
    spread = result["native_spread_pct"]
    print(format_table(["run", "tokens/s", "min", "max", "vs native", "overhead %", "beyond native's spread",
                        "blocks reclaimed"],
                       [[r["label"], r["tokens_per_s"], r["tokens_per_s_min"], r["tokens_per_s_max"],
                         r["throughput_vs_native"], r["overhead_pct"], "yes" if r["beyond_native_spread"] else "no",
                         r["blocks_reclaimed"]] for r in result["runs"]]))
    print(f"native against itself: +-{spread:.1f}% (every native run's distance from the reference median); "
          "a smaller overhead is not a measured difference")
    split = result["runs"][-1]["host_seconds"]
    wall = result["runs"][-1]["wall_s"]
    print(f"\nhost time of {result['runs'][-1]['label']} (wall {wall:.2f} s):")
    print(format_table(["stage", "seconds", "% of wall"], [[k, v, 100 * v / wall] for k, v in split.items()]))
    publish(args.out, "overhead", result, plot_overhead)
    return 0


def run_sweeps(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.sweeps import SweepsBenchConfig, plot_sweeps, run_sweeps_bench
    from trtllm_vtoken.cli.bench_common import load_model, publish
    from trtllm_vtoken.report import format_table

    cfg = SweepsBenchConfig(requests=args.requests, max_output_tokens=args.max_output_tokens,
                            **({"max_prompt_tokens": 128} if args.quick else {}))
    _, model, tokenizer = load_model(None)
    with tqdm(total=len(cfg.points()), desc="bench sweeps", unit="run", disable=None, file=sys.stderr) as bar:
        result = run_sweeps_bench(cfg, model, tokenizer, progress=bar)
    print(f"vtoken bench sweeps: {cfg.requests} ShareGPT requests, <= {cfg.max_output_tokens} new tokens, "
          f"{cfg.policy}; I1/I2/I4 checked on every relocation")
    print(format_table(
        ["sweep", "value", "variant", "mode", "mean blocks", "peak blocks", "KV slots (mean)", "fewer than naive %",
         "util %", "moves", "tokens/s", "checks"],
        [[p["sweep"], p["value"], p["variant"], p["mode"], p["mean_blocks"], p["peak_blocks"], p["mean_slots"],
          p.get("fewer_slots_than_naive_pct", "-"), 100 * p["kv_utilization"], p["moves"], p["tokens_per_s"],
          p["invariant_checks"]] for p in result["points"]]))
    publish(args.out, "sweeps", result, plot_sweeps)
    return 0


def run_sla(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.sla import VARIANTS, SlaBenchConfig, plot_sla, run_sla_bench
    from trtllm_vtoken.cli.bench_common import load_model, publish
    from trtllm_vtoken.report import format_table

    try:
        levels = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    blocks = args.num_blocks if args.num_blocks is not None else 40 if args.quick else 96
    cfg = SlaBenchConfig(concurrency=levels, requests_per_client=args.requests_per_client,
                         num_blocks=blocks, max_output_tokens=24 if args.quick else 48, repeats=args.repeats,
                         c_ref=args.c_ref)
    _, model, tokenizer = load_model(None)
    with tqdm(total=len(levels) * len(VARIANTS) * cfg.repeats, desc="bench sla", unit="run", disable=None,
              file=sys.stderr) as bar:
        result = run_sla_bench(cfg, model, tokenizer, progress=bar)
    print(f"vtoken bench sla: closed loop, {cfg.num_blocks} blocks x {cfg.tokens_per_block} tokens, "
          f"{cfg.policy} budget {cfg.budget}; per point the run with the median p95 of {cfg.repeats} alternating "
          "runs, tokens/s with its range")
    print(format_table(["variant", "C", "tokens/s [min-max]", "p50 s", "p95 s [min-max]", "most running",
                        "steps waited", "preemptions"],
                       [[v, lv["clients"], f"{lv['tokens_per_s']:.2f} [{lv['tokens_per_s_min']:.2f}-"
                         f"{lv['tokens_per_s_max']:.2f}]", lv["latency_p50_s"],
                         f"{lv['latency_p95_s']:.2f} [{lv['latency_p95_s_min']:.2f}-{lv['latency_p95_s_max']:.2f}]",
                         lv["max_running"], lv["waited_steps"], lv["preemptions"]]
                        for v, levels_ in result["scans"].items() for lv in levels_]))
    s = result["summary"]
    print(f"\nC_ref {s['c_ref']}, SLA p95 <= {s['sla_p95_s']:.2f} s; C_sel: {s['selected']}"
          + (f"; vtoken throughput at C_sel = {s['throughput_ratio']:.3f}x naive-evict's "
             f"[{s['throughput_ratio_min']:.3f}-{s['throughput_ratio_max']:.3f}]" if "throughput_ratio" in s else "")
          + f"; verdict: {s['verdict']}")
    if not s["budget_binds"]:
        print(f"naive-evict ran every request as it came at every level: {cfg.num_blocks} blocks do not limit it here, "
              "so C_sel compares equal concurrency, not capacity (raise --concurrency or lower --num-blocks)")
    publish(args.out, "sla", result, plot_sla)
    return 0


def run_sharing(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.sharing import (
        VARIANTS,
        SharingBenchConfig,
        plot_sharing,
        run_sharing_bench,
    )
    from trtllm_vtoken.cli.bench_common import publish
    from trtllm_vtoken.report import format_table

    if args.real:
        return run_sharing_real(args)
    cfg = SharingBenchConfig(decode_tokens=args.decode_tokens or (64 if args.quick else 256))
    total = len(cfg.degrees) * len(VARIANTS) * cfg.decode_tokens
    with tqdm(total=total, desc="bench sharing", unit="step", disable=None, file=sys.stderr) as bar:
        result = run_sharing_bench(cfg, progress=bar)
    print(f"vtoken bench sharing (simulated): {cfg.requests} requests, {cfg.prefix_tokens}-token shared prefix, "
          f"{cfg.suffix_tokens}-token private suffix, {cfg.decode_tokens} decode steps, H2O {cfg.budget}")
    print(format_table(
        ["degree", "variant", "blocks (end)", "blocks (mean)", "ideal", "shared blocks", "fewer than naive %",
         "relocations", "plans touching shared", "invariant checks"],
        [[r["degree"], r["variant"], r["blocks_end"], r["blocks_mean"], r["ideal_blocks_end"], r["shared_blocks"],
          r.get("fewer_blocks_than_naive_pct", "-"), r["relocations"], r["plans_touching_shared"],
          r["invariant_checks"]] for r in result["rows"]]))
    for row in result["rows"]:
        row.pop("blocks_per_step")
    publish(args.out, "sharing", result, plot_sharing)
    return 0


def run_shift(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.shift import RUNS, ShiftBenchConfig, plot_shift, run_shift_bench
    from trtllm_vtoken.cli.bench_common import load_model, publish
    from trtllm_vtoken.report import format_table

    if args.exactness:
        return run_shift_exactness(args)
    cfg = ShiftBenchConfig(requests=args.requests, policy=args.policy, budget=args.budget,
                           max_output_tokens=args.max_output_tokens, repeats=args.repeats)
    _, model, tokenizer = load_model(None)
    with tqdm(total=len(RUNS) * cfg.repeats, desc="bench shift", unit="run", disable=None, file=sys.stderr) as bar:
        result = run_shift_bench(cfg, model, tokenizer, progress=bar)
    print(f"vtoken bench shift: {cfg.requests} ShareGPT requests, <= {cfg.max_output_tokens} new tokens, "
          f"{cfg.policy} budget {cfg.budget}, {cfg.repeats} runs per row in alternating order (median)")
    print(format_table(
        ["run", "tokens/s", "min", "max", "vs keep", "reloc KB/step", "rerotate KB/step", "passes", "keys turned",
         "same output"],
        [[r["label"], r["tokens_per_s"], r["tokens_per_s_min"], r["tokens_per_s_max"], r["throughput_vs_keep"],
          r["relocation_bytes_per_step"] / 1e3, r["rerotation_bytes_per_step"] / 1e3, r["rerotation_passes"],
          r["keys_rerotated"], r["outputs_equal_keep"]] for r in result["runs"]]))
    publish(args.out, "shift", result, plot_shift)
    return 0


def run_shift_exactness(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.shift import run_exactness
    from trtllm_vtoken.cli.bench_common import load_model, publish
    from trtllm_vtoken.policies import POLICIES
    from trtllm_vtoken.report import format_table

    _, model, tokenizer = load_model(None)
    tokens = 16 if args.quick else 64
    with tqdm(total=8 * len(POLICIES.names()), desc="bench shift --exactness", unit="run", disable=None,
              file=sys.stderr) as bar:
        result = run_exactness(model, tokenizer, tokens=tokens, progress=bar)
    print(f"vtoken bench shift --exactness: {tokens} greedy tokens, budget 24, float32; max |logit difference|")
    print(format_table(["policy", "sinks", "shift vs keep (dense)", "shift vs keep (lazy)", "keep: dense vs lazy",
                        "same tokens"],
                       [[r["policy"], r["n_sink"], f"{r['shift_vs_keep_dense']:.1e}", f"{r['shift_vs_keep_lazy']:.1e}",
                         f"{r['keep_dense_vs_keep_lazy']:.1e}", r["same_greedy_tokens"]] for r in result["rows"]]))
    publish(args.out, "shift_exactness", result)
    return 0


def run_sharing_real(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.sharing_real import (
        ROWS,
        RealSharingConfig,
        plot_real_sharing,
        run_real_sharing_bench,
    )
    from trtllm_vtoken.cli.bench_common import publish
    from trtllm_vtoken.report import format_table
    from trtllm_vtoken.runtime.checkpoint import ensure_default_model
    from trtllm_vtoken.runtime.model import load_llama
    from trtllm_vtoken.runtime.tokenizer import Tokenizer

    options = dict(budget=args.budget, policy_options={"recent_ratio": args.recent_ratio},
                   check_invariants=not args.no_check, prefix_reuse=args.prefix_reuse)
    cfg = RealSharingConfig(requests=args.requests, prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens,
                            decode_tokens=args.decode_tokens or (16 if args.quick else 32),
                            **({"degrees": (1, 2, 4)} if args.quick else {}), **options)
    folder = ensure_default_model()
    model, tokenizer = load_llama(folder), Tokenizer(folder)
    with tqdm(total=len(cfg.degrees) * len(ROWS), desc="bench sharing --real", unit="run", disable=None,
              file=sys.stderr) as bar:
        result = run_real_sharing_bench(cfg, model, tokenizer, progress=bar)
    print(f"vtoken bench sharing --real: SmolLM2-135M, {cfg.requests} requests, {cfg.prefix_tokens}-token shared "
          f"system prompts, {cfg.suffix_tokens}-token private suffixes, {cfg.decode_tokens} decode steps, "
          f"{cfg.policy} budget {cfg.budget} {cfg.policy_options}, prefix caching on in every row, "
          f"prefix_reuse={cfg.prefix_reuse}")
    print(format_table(
        ["degree", "row", "prefix hit %", "retained blocks", "mean", "fewer than naive %", "KV util %",
         "decode tok/s", "relocations", "checked", "touching shared/cached", "outputs = naive"],
        [[r["degree"], f"{r['variant']}{'' if r['mode'] == '-' else '/' + r['mode']} + cache",
          100 * r["prefix_hit_rate"], r["retained_blocks_end"], r["retained_blocks_mean"],
          r["fewer_blocks_than_naive_pct"], 100 * r["kv_utilization"], r["decode_tokens_per_s"],
          r["relocations"], r["invariant_checks"], r["plans_touching_shared_or_cached"],
          r["same_outputs_as_naive_evict"]] for r in result["rows"]]))
    publish(args.out, "sharing_real", result, plot_real_sharing)
    return 0
