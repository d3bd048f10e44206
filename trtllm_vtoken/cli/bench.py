# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench ...``: benchmarks print a table and write ``<out>/<name>.json``."""

from __future__ import annotations

import argparse
import sys

from trtllm_vtoken.cli.bench_common import Size, add_output_options, load_model, publish

ALL = ("variants", "capacity", "quality", "core", "step", "overhead", "sweeps", "sla", "sharing", "shift", "invariance")
"""What ``vtoken bench all`` runs, in this order; without ``--quick`` also ``ALL_FULL``."""
ALL_FULL = ("utilization", "serve")


def register(sub) -> None:
    bench = sub.add_parser("bench", help="run a benchmark").add_subparsers(dest="bench", required=True)
    core = bench.add_parser("core", help="host time of table updates, evictions, planning, moves per step")
    core.add_argument("--batch", type=int, default=256, help="concurrent requests (default 256)")
    core.add_argument("--context", type=int, default=4096, help="live tokens per request (default 4096)")
    core.add_argument("--tokens-per-block", type=int, default=32, help="default 32")
    core.add_argument("--steps", action=Size, type=int, default=50, help="timed decode steps (default 50)")
    core.add_argument("--mode", choices=["dense", "lazy", "both"], default="both",
                      help="compaction mode(s) to run (default both)")
    core.add_argument("--impl", choices=["calls", "python", "cpp", "all"], default="all",
                      help="the per-call API (engine path, per-stage split), the Python core's step_batch, "
                           "the C++ core's step_batch, or all in one run (default; cpp skipped where the "
                           "C++ core is not built)")
    core.add_argument("--seed", type=int, default=0, help="random seed of the workload (default 0)")
    core.add_argument("--repeats", action=Size, type=int, default=3,
                      help="runs per row in alternating order; the median run is reported (default 3)")
    add_output_options(core, "10 steps, one run per row: a smoke run", run_core, quick=dict(steps=10, repeats=1))

    variants = bench.add_parser(
        "variants", help="native / naive-evict / vtoken on the real model: blocks, utilization, speed",
        description="Serve one workload with every variant from the same KV block budget.")
    variants.add_argument("--model", default=None, help="Hugging Face Llama folder (default: SmolLM2-135M)")
    variants.add_argument("--workload", default="sharegpt", help="sharegpt or longdoc")
    variants.add_argument("--requests", action=Size, type=int, default=32, help="ShareGPT requests (default 32)")
    variants.add_argument("--max-prompt-tokens", action=Size, type=int, default=512,
                          help="longest prompt in tokens (default 512)")
    variants.add_argument("--max-output-tokens", action=Size, type=int, default=128,
                          help="new tokens per request at most (default 128)")
    variants.add_argument("--policy", default="h2o", help="eviction policy (default h2o)")
    variants.add_argument("--budget", default="0.5",
                          help="live tokens per request: a count (256) or a ratio (0.5, the default)")
    variants.add_argument("--tokens-per-block", type=int, default=16, help="tokens in one KV block (default 16)")
    variants.add_argument("--num-blocks", action=Size, type=int, default=160, help="KV block budget (default 160)")
    variants.add_argument("--max-batch-size", type=int, default=32,
                          help="requests running at once, at most (default 32)")
    variants.add_argument("--no-check", action="store_true", help="skip I1/I2/I4 checks per relocation")
    variants.add_argument("--no-prefix-caching", action="store_true",
                          help="turn the engine's prefix caching off (on by default): a token of a block that "
                               "another running request holds is then no longer kept on top of the budget")
    variants.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                          help="the KV pool's dtype: auto (the model's, float32) or fp8 (float8_e4m3fn codes, a "
                               "scale per layer)")
    variants.add_argument("--seed", type=int, default=0, help="random seed of the workload (default 0)")
    add_output_options(variants, "16 requests, prompts <= 256, outputs <= 48 tokens, 80 blocks", run_variants,
                       quick=dict(requests=16, max_prompt_tokens=256, max_output_tokens=48, num_blocks=80))

    every = bench.add_parser(
        "all", help="the main job's benchmarks, in turn (scripts/main.sh runs it with --quick)",
        description=f"{', '.join(ALL)} (and {' and '.join(ALL_FULL)}, unless --quick). The others "
                    "(host, trtllm-mass, tp, threads, overlap, long, spec, gpu, ...) run on their own.")
    add_output_options(every, "each benchmark's quick form (minutes on 2 CPU cores)", run_all)
    every.set_defaults(benchmarks=bench.choices)  # every benchmark's parser, the ones added below too

    util = bench.add_parser(
        "utilization", help="KV utilization and retained blocks, every policy x workload (real model)",
        description="native / naive-evict / vtoken on the real model with a pool large enough for all "
                    "requests at once, for every registered policy and both workloads.")
    util.add_argument("--requests", action=Size, type=int, default=8, help="requests per workload (default 8)")
    util.add_argument("--max-prompt-tokens", action=Size, type=int, default=512,
                      help="longest prompt in tokens (default 512)")
    util.add_argument("--max-output-tokens", action=Size, type=int, default=64,
                      help="new tokens per request at most (default 64)")
    util.add_argument("--budget", default="0.5", help="live tokens per request: a count or a ratio (default 0.5)")
    add_output_options(util, "4 requests, prompts <= 192, 16 new tokens", run_utilization,
                       quick=dict(requests=4, max_prompt_tokens=192, max_output_tokens=16))

    quality = bench.add_parser(
        "quality", help="vtoken vs naive-evict greedy outputs on real prompts: exact match, ROUGE-L; and what the "
                        "overlap scheduler's lag changes against the plain order",
        description="Greedy generations of native, naive-evict and vtoken on the same ShareGPT prompts, under the "
                    "overlap scheduler (the default), and vtoken's in the plain order.")
    quality.add_argument("--prompts", action=Size, type=int, default=144,
                         help="ShareGPT prompts compared (default 144)")
    quality.add_argument("--max-tokens", action=Size, type=int, default=64,
                         help="greedy tokens per prompt (default 64)")
    quality.add_argument("--policy", default="h2o", help="eviction policy (default h2o)")
    quality.add_argument("--budget", default="0.5", help="live tokens per request: a count or a ratio (default 0.5)")
    quality.add_argument("--model", default=None, help="Hugging Face Llama folder (default: SmolLM2-135M)")
    add_output_options(quality, "24 prompts, 32 tokens", run_quality, quick=dict(prompts=24, max_tokens=32))

    capacity = bench.add_parser(
        "capacity", help="largest concurrency fitting a fixed block budget, at paper scale (simulated)",
        description="Capacity frontier of native / naive-evict / vtoken with the simulated-attention "
                    "backend, on the paper's Llama-3.1-8B and Qwen2.5-14B settings.")
    capacity.add_argument("--scale", action=Size, type=int, default=1,
                          help="divide lengths and pools by this (default 1)")
    capacity.add_argument("--budget", type=float, default=0.5, help="H2O retention ratio (default 0.5)")
    capacity.add_argument("--seed", type=int, default=0, help="random seed of the workload (default 0)")
    add_output_options(capacity, "--scale 8 (about a minute)", run_capacity, quick=dict(scale=8))

    from trtllm_vtoken.cli import (bench_experiments, bench_gpu, bench_invariance, bench_long, bench_micro,
                                   bench_overlap, bench_serve, bench_spec, bench_step, bench_threads, bench_tp)

    bench_step.register(bench)
    bench_micro.register(bench)
    bench_experiments.register(bench)
    bench_serve.register(bench)
    bench_gpu.register(bench)
    bench_tp.register(bench)
    bench_threads.register(bench)
    bench_overlap.register(bench)
    bench_invariance.register(bench)
    bench_long.register(bench)
    bench_spec.register(bench)


def run_core(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.core import CoreBenchConfig, plot_core, run_core_bench
    from trtllm_vtoken.bench.repeats import run_alternating
    from trtllm_vtoken.core.native import load as load_native
    from trtllm_vtoken.report import format_table

    modes = ["dense", "lazy"] if args.mode == "both" else [args.mode]
    impls = ["calls", "python", "cpp"] if args.impl == "all" else [args.impl]
    if args.impl == "all" and load_native() is None:
        impls.remove("cpp")
        print("note: the C++ core is not built; timing the Python core only", file=sys.stderr)
    steps, repeats = args.steps, args.repeats
    rows = [(f"{impl} {mode}", CoreBenchConfig(
                batch=args.batch, context=args.context, tokens_per_block=args.tokens_per_block, steps=steps,
                warmup=min(5, steps), mode=mode, impl=impl, seed=args.seed))
            for mode in modes for impl in impls]
    with tqdm(total=len(rows) * repeats, desc="bench core", unit="run", disable=None, file=sys.stderr) as bar:
        results = run_alternating(rows, repeats, lambda label, cfg: run_core_bench(cfg), bar, key="total_us_median")
    base_us = {(r["config"]["impl"], r["config"]["mode"]): r["total_us_median"] for r in results}

    def speedup(r: dict, base: str) -> str:
        key = (base, r["config"]["mode"])
        return f"{base_us[key] / r['total_us_median']:.1f}x" if key in base_us else "-"

    headers = ["impl", "mode", "sync us", "evict us", "plan us", "apply us", "step us (p50)", "p50 of runs",
               "step us (p90)", "us/request", "vs calls", "vs python", "metadata B/token", "moves", "blocks freed"]
    table = [
        [r["config"]["impl"], r["config"]["mode"],
         *("-" if r["step_us"][s] is None else r["step_us"][s] for s in ("sync", "evict", "plan", "apply")),
         r["total_us_median"], f"{r['total_us_median_min']:,.0f}-{r['total_us_median_max']:,.0f}",
         r["total_us_p90"], r["per_request_us"], speedup(r, "calls"), speedup(r, "python"),
         r["metadata_bytes_per_token"], r["moves"], r["blocks_freed"]]
        for r in results
    ]
    c = results[0]["config"]
    print(f"vtoken bench core: batch {c['batch']}, context {c['context']}, tokens_per_block "
          f"{c['tokens_per_block']}, one eviction per request per step, {steps} steps; the median of {repeats} "
          f"alternating runs per row")
    print(format_table(headers, table))
    publish(args.out, "core", {"results": results}, plot_core)
    return 0


def run_variants(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.variants import VARIANT_RUNS, VariantsBenchConfig, plot_variants, run_variants_bench
    from trtllm_vtoken.report import format_table

    sizes = dict(requests=args.requests, max_prompt_tokens=args.max_prompt_tokens,
                 max_output_tokens=args.max_output_tokens, num_blocks=args.num_blocks)
    cfg = VariantsBenchConfig(
        workload=args.workload, policy=args.policy, budget=args.budget, tokens_per_block=args.tokens_per_block,
        max_batch_size=args.max_batch_size, check_invariants=not args.no_check,
        prefix_caching=not args.no_prefix_caching, kv_cache_dtype=args.kv_cache_dtype, seed=args.seed, **sizes)
    folder, model, tokenizer = load_model(args.model)
    with tqdm(total=cfg.requests * len(VARIANT_RUNS), desc="bench variants", unit="req",
              disable=None, file=sys.stderr) as bar:
        result = run_variants_bench(cfg, model, tokenizer, progress=bar)
    headers = ["variant", "mode", "tok/s", "p95 latency s", "peak blocks", "peak KV MiB", "mean blocks",
               "KV util %", "max running", "preempted", "evicted", "reclaimed", "moves", "I1/I2 checks",
               "= naive-evict"]
    rows = [[r["variant"], r["mode"], r["tokens_per_s"], r["latency_p95_s"], r["peak_blocks"],
             r["peak_kv_bytes"] / 2**20, r["mean_blocks"], 100 * r["kv_utilization"], r["max_running"], r["preemptions"],
             r["tokens_evicted"], r["blocks_reclaimed"], r["moves"], r["invariant_checks"],
             f"{100 * r['exact_match_vs_naive_evict']:.0f}%" if "exact_match_vs_naive_evict" in r else "-"]
            for r in result["runs"]]
    print(f"vtoken bench variants: {folder.name}, {cfg.workload} x {cfg.requests} requests (prompts <= "
          f"{cfg.max_prompt_tokens}, outputs <= {cfg.max_output_tokens} tokens), {cfg.policy} budget "
          f"{cfg.budget}, pool {cfg.num_blocks} blocks x {cfg.tokens_per_block} tokens, prefix caching "
          f"{'on' if cfg.prefix_caching else 'off'}, KV {cfg.kv_cache_dtype}, CPU")
    print(format_table(headers, rows))
    if any(r.get("exact_match_vs_naive_evict", 1.0) < 1.0 for r in result["runs"]):
        print("= naive-evict below 100%: vtoken and naive-evict attend to the same live keys in another physical "
              "order. In float32 that moves logits by ~1e-5 and may flip a greedy near-tie; with FP8 KV a new key "
              "or value can round to another code, and the runs drift apart from there (docs/reference_runtime.md, "
              "FP8 KV). Their eviction decisions agree up to the first differing token.")
    publish(args.out, "variants", result, plot_variants)
    return 0


def run_capacity(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.capacity import PAPER_SETTINGS, VARIANTS, plot_capacity, run_capacity_bench
    from trtllm_vtoken.report import format_table

    scale = args.scale
    if scale < 1:
        raise ValueError(f"--scale must be >= 1, got {scale}")
    settings = [s.scaled(scale) for s in (*PAPER_SETTINGS, PAPER_SETTINGS[0].with_fp8_kv())]
    with tqdm(desc="bench capacity (simulated)", unit="run", disable=None, file=sys.stderr) as bar:
        result = run_capacity_bench(settings, args.budget, args.seed, progress=bar)
    headers = ["setting (simulated)", "blocks", "full req blocks", "packed bound",
               *(f"{v} C" for v in VARIANTS), "paper C (native/naive/vtoken)"]
    rows = [[r["setting"]["name"], r["setting"]["num_blocks"], r["full_request_blocks"], r["packed_bound"],
             *(r["variants"][v]["max_concurrency"] for v in VARIANTS),
             "/".join(map(str, r["setting"]["paper"])) if r["setting"]["paper"] else "-"]
            for r in result["results"]]
    print(f"vtoken bench capacity: SIMULATED attention, H2O at {args.budget} retention, tokens_per_block 16, "
          "greedy admission; C = most requests running at once start to finish without preemption")
    print(format_table(headers, rows))
    publish(args.out, "capacity", result, plot_capacity)
    return 0


def run_all(args: argparse.Namespace) -> int:
    """Each benchmark in turn, parsed by its own parser as ``vtoken bench <name>`` would be; the
    first that fails ends the run (its error reported as ``vtoken`` reports any)."""
    names = list(ALL) + ([] if args.quick else list(ALL_FULL))
    for name in names:
        print(f"\n== vtoken bench {name}{' --quick' if args.quick else ''} ==", flush=True)
        chosen = args.benchmarks[name].parse_args(["--out", args.out] + (["--quick"] if args.quick else []))
        code = chosen.func(chosen)
        if code:
            return code
    return 0


def run_quality(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.quality import RUNS, QualityBenchConfig, plot_quality, run_quality_bench
    from trtllm_vtoken.report import format_table

    cfg = QualityBenchConfig(prompts=args.prompts, max_tokens=args.max_tokens, policy=args.policy, budget=args.budget)
    folder, model, tokenizer = load_model(args.model)
    with tqdm(total=cfg.prompts * len(RUNS), desc="bench quality", unit="req", disable=None, file=sys.stderr) as bar:
        result = run_quality_bench(cfg, model, tokenizer, progress=bar)
    rouge = result["rouge_l_vs_native"]
    print(f"vtoken bench quality: {folder.name}, {result['pairs']} ShareGPT prompts, greedy, {cfg.max_tokens} "
          f"new tokens, {cfg.policy} budget {cfg.budget}; ROUGE-L against the native (full-KV) output")
    print(format_table(
        ["pairs", "exact match %", "ROUGE-L naive-evict", "ROUGE-L vtoken", "paired diff", "length ratio"],
        [[result["pairs"], 100 * result["exact_match_rate"], f"{rouge['naive-evict']:.4f}",
          f"{rouge['vtoken']:.4f}", f"{result['mean_paired_rouge_l_difference']:+.4f}",
          f"{result['output_length_ratio']:.4f}"]]))
    plain, lagged = result["plain_order"], result["lagged"]
    print("vtoken under the overlap scheduler, deciding at once (the default, as above) and lagged, against the plain "
          "order (each decision before the next forward)\n" + format_table(
              ["overlap", "same answer as plain %", "ROUGE-L", "ROUGE-L plain order", "paired diff (- plain)"],
              [["at_once", 100 * plain["same_answer_rate"], f"{rouge['vtoken']:.4f}",
                f"{plain['rouge_l_vs_native']:.4f}", f"{plain['mean_paired_rouge_l_overlap_minus_plain']:+.4f}"],
               ["lagged", 100 * lagged["same_answer_as_plain_rate"], f"{lagged['rouge_l_vs_native']:.4f}",
                f"{plain['rouge_l_vs_native']:.4f}", f"{lagged['mean_paired_rouge_l_lagged_minus_plain']:+.4f}"]]))
    publish(args.out, "quality", result, plot_quality)
    return 0


def run_utilization(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.utilization import (VARIANTS, UtilizationBenchConfig, plot_utilization,
                                                 run_utilization_bench)
    from trtllm_vtoken.report import format_table

    sizes = dict(requests=args.requests, max_prompt_tokens=args.max_prompt_tokens,
                 max_output_tokens=args.max_output_tokens)
    cfg = UtilizationBenchConfig(budget=args.budget, **sizes)
    folder, model, tokenizer = load_model(None)
    total = len(cfg.policies) * len(cfg.workloads) * len(VARIANTS)
    with tqdm(total=total, desc="bench utilization", unit="run", disable=None, file=sys.stderr) as bar:
        result = run_utilization_bench(cfg, model, tokenizer, progress=bar)
    headers = ["workload", "policy", "util % native", "util % naive-evict", "util % vtoken", "gain pp",
               "blocks naive-evict", "blocks vtoken", "fewer blocks %"]
    rows = [[r["workload"], r["policy"], *(100 * r["runs"][v]["kv_utilization"] for v, _ in VARIANTS),
             r["utilization_gain_pp"], r["runs"]["naive-evict"]["mean_blocks"], r["runs"]["vtoken"]["mean_blocks"],
             100 * r["retained_blocks_reduction"]] for r in result["rows"]]
    print(f"vtoken bench utilization: SmolLM2-135M, {cfg.requests} requests per workload, budget {cfg.budget}, "
          f"tokens_per_block {cfg.tokens_per_block}; blocks = time-averaged blocks held")
    print(format_table(headers, rows))
    publish(args.out, "utilization", result, plot_utilization)
    return 0
