# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench threads``: decode tokens/s of the real model idle and with one core kept busy by
another process, for vToken's default intra-op threads and torch's; prints a table and writes
``<out>/threads.json``."""

from __future__ import annotations

import argparse
import sys


def register(bench) -> None:
    from trtllm_vtoken.cli.bench_common import Size, add_output_options

    threads = bench.add_parser(
        "threads", help="tokens/s idle and with one core busy, for the default threads and torch's",
        description="Greedy decoding of one request on the real model, each measurement in a fresh process, "
                    "idle and while another process spins on one core; for vToken's default intra-op threads "
                    "(the usable cores but one), torch's own default, and --threads N if given. Alternating "
                    "order; the median of --repeats runs.")
    threads.add_argument("--model", default=None, help="Hugging Face Llama folder (default: SmolLM2-135M)")
    threads.add_argument("--new-tokens", action=Size, type=int, default=32,
                         help="greedy tokens per measurement (default 32)")
    threads.add_argument("--repeats", action=Size, type=int, default=3, help="runs per setting and load (default 3)")
    add_output_options(threads, "8 new tokens, one run each", run_threads, quick=dict(new_tokens=8, repeats=1))


def run_threads(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.threads import ThreadsBenchConfig, run_threads_bench
    from trtllm_vtoken.cli.bench_common import publish
    from trtllm_vtoken.report import format_table
    from trtllm_vtoken.runtime.checkpoint import resolve_model
    from trtllm_vtoken.threads import usable_cores

    cfg = ThreadsBenchConfig(new_tokens=args.new_tokens, repeats=args.repeats,
                             threads=args.intra_op_threads)
    folder = resolve_model(args.model)
    total = 2 * len(cfg.settings()) * cfg.repeats
    with tqdm(total=total, desc="bench threads", unit="run", disable=None, file=sys.stderr) as bar:
        result = run_threads_bench(cfg, folder, progress=bar)
    names = {"default": "vToken default", "torch": "torch default"}
    print(f"vtoken bench threads: {folder.name} fp32 on CPU ({usable_cores()} usable cores), one request, "
          f"{cfg.new_tokens} greedy tokens; busy = another process spinning on one core; median [min-max] of "
          f"{cfg.repeats} alternating runs, each in a fresh process")
    print(format_table(
        ["setting", "threads", "idle tok/s", "busy tok/s", "busy / idle"],
        [[names.get(r["setting"], f"--threads {r['setting']}"), r["threads"],
          f"{r['idle']['tokens_per_s']:.1f} [{r['idle']['min']:.1f}-{r['idle']['max']:.1f}]",
          f"{r['busy']['tokens_per_s']:.1f} [{r['busy']['min']:.1f}-{r['busy']['max']:.1f}]",
          f"{r['busy_over_idle']:.2f}"] for r in result["rows"]]))
    publish(args.out, "threads", result)
    return 0
