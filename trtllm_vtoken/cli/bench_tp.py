# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench tp``: TP=1 against TP=2 on the real model, the consistency protocol's cost per
step, the collectives alone, and the projection to Llama-3.1-70B at TP=8; prints tables and
writes ``<out>/tp.json`` and ``<out>/tp.png``."""

from __future__ import annotations

import argparse
import functools
import sys

from trtllm_vtoken.cli.bench_common import Size, run_sized


def register(bench) -> None:
    tp = bench.add_parser(
        "tp", help="tensor parallelism: tokens/s at TP=1 and 2, the rank-consistency protocol's cost per step",
        description="The real model at TP=1 (one process) and TP=2 (two gloo rank processes) on one ShareGPT "
                    "workload under vToken dense + H2O, in alternating order; the mass all-reduce that keeps "
                    "the ranks' decisions identical, per step, in the run and alone; the alternative "
                    "(decide on rank 0, broadcast the victims); bytes per step projected to "
                    "Llama-3.1-70B at TP=8.")
    tp.add_argument("--requests", action=Size, type=int, default=8, help="ShareGPT requests (default 8)")
    tp.add_argument("--max-prompt-tokens", action=Size, type=int, default=128,
                    help="longest prompt in tokens (default 128)")
    tp.add_argument("--max-output-tokens", action=Size, type=int, default=32,
                    help="new tokens per request (default 32)")
    tp.add_argument("--policy", default="h2o", help="a policy that observes attention, or the protocol idles")
    tp.add_argument("--budget", default="0.5", help="live tokens per request: a count or a ratio (default 0.5)")
    tp.add_argument("--repeats", action=Size, type=int, default=3,
                    help="runs per TP size, alternating order (default 3)")
    tp.add_argument("--probe-repeats", action=Size, type=int, default=200,
                    help="calls per collective timed alone (default 200)")
    tp.add_argument("--quick", action="store_true",
                    help="4 requests, prompts <= 64, 16 tokens, one run each; a size option given explicitly wins")
    tp.add_argument("--out", default="out", help="folder for tp.json and tp.png (default ./out)")
    tp.add_argument("--threads", type=int, default=1, metavar="N",
                    help="intra-op CPU threads of TP=1 and of each rank of TP=2 (default 1: one core per rank, "
                         "as TP=N uses N devices)")
    tp.set_defaults(func=functools.partial(run_sized, run_tp),
                    quick_sizes=dict(requests=4, max_prompt_tokens=64, max_output_tokens=16, repeats=1,
                                     probe_repeats=50))


def run_tp(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.tp import TpBenchConfig, plot_tp, run_tp_bench
    from trtllm_vtoken.cli.info import machine
    from trtllm_vtoken.report import format_table, write_json
    from trtllm_vtoken.runtime.checkpoint import resolve_model
    from trtllm_vtoken.runtime.tokenizer import Tokenizer

    sizes = dict(requests=args.requests, max_prompt_tokens=args.max_prompt_tokens,
                 max_output_tokens=args.max_output_tokens, repeats=args.repeats, probe_repeats=args.probe_repeats)
    cfg = TpBenchConfig(policy=args.policy, budget=args.budget, threads=args.threads, **sizes)
    folder = resolve_model(None)
    with tqdm(total=2 * cfg.repeats, desc="bench tp", unit="run", disable=None, file=sys.stderr) as bar:
        result = run_tp_bench(cfg, folder, Tokenizer(folder), progress=bar)
    result["machine_cpus"] = machine()["cpus"]
    runs = {r["tp"]: r for r in result["runs"]}
    print(f"vtoken bench tp: {folder.name} fp32 on CPU, {cfg.requests} ShareGPT requests (prompts <= "
          f"{cfg.max_prompt_tokens}, {cfg.max_output_tokens} new tokens), vtoken dense + {cfg.policy} budget "
          f"{cfg.budget}; median of {cfg.repeats} alternating runs; outputs TP=1 == TP=2: {result['same_outputs']}")
    print(format_table(
        ["TP", "tok/s", "min", "max", "step ms", "all-reduces/step", "all-reduce ms/step", "mass reductions",
         "carried", "bytes reduced/step", "protocol us/step", "share of step %"],
        [[tp, r["tokens_per_s"], r["tokens_per_s_min"], r["tokens_per_s_max"], r["step_ms_mean"],
          r.get("all_reduces_per_step", "-"),
          " / ".join(f"{x:,.1f}" for x in r["all_reduce_ms_per_step"]) if "all_reduce_ms_per_step" in r else "-",
          r.get("reductions", "-"), r.get("carried", "-"), r.get("bytes_reduced_per_step", "-"),
          r.get("protocol_us_per_step", "-"), r.get("protocol_share_of_step_pct", "-")]
         for tp, r in sorted(runs.items())]))
    print(f"\nthe collectives alone at one decode step's shapes, back to back (median us per call over "
          f"{cfg.probe_repeats} calls; median [min-max] of {cfg.repeats} such runs):")
    keys = ["hidden_us", "hidden_plus_mass_us", "mass_alone_us", "reduce_then_broadcast_us", "digest_allgather_us"]
    print(format_table(
        ["rank", "o_proj all-reduce", "o_proj + mass (protocol)", "mass alone", "reduce + broadcast victims",
         "digest all-gather"],
        [[rank, *(f"{p[k]:,.0f} [{p[k + '_min']:,.0f}-{p[k + '_max']:,.0f}]" for k in keys)]
         for rank, p in enumerate(result["collectives"])]))
    load = result["load_average_1min"]
    print(f"machine load (1-min average, {result['machine_cpus']} CPUs): {load[0]:.1f} before, {load[1]:.1f} after")
    print("\non paper: the protocol at TP=8 (fp32 mass) against the model's own all-reduces per decode step:")
    print(format_table(
        ["model", "batch", "context", "mass MiB", "sent/rank MiB", "model all-reduce MiB", "count",
         "protocol / model bytes %", "alternative sent/rank MiB"],
        [[p["model"], p["batch"], p["context"], p["mass_bytes"] / 2**20, p["mass_bytes_sent_per_rank"] / 2**20,
          p["model_allreduce_bytes"] / 2**20, p["model_allreduces"], 100 * p["protocol_vs_model_bytes"],
          p["alternative_bytes_sent_per_rank"] / 2**20] for p in result["projection"]]))
    result["machine"] = machine()
    path = write_json(args.out, "tp", result)
    plot_tp(result, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0
