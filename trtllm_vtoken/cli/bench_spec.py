# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench spec``: speculative decoding with n-gram drafts, native and vtoken, with and
without drafting (real model); prints a table and writes ``<out>/spec.json``."""

from __future__ import annotations

import argparse
import sys


def register(bench) -> None:
    from trtllm_vtoken.cli.bench_common import Size, add_output_options

    spec = bench.add_parser(
        "spec", help="speculative decoding with n-gram drafts: acceptance, tokens/s, outputs (real model)",
        description="Requests that repeat a standard-library source from their prompt, all at once: native, "
                    "vtoken dense (H2O) and naive-evict, with and without n-gram drafts verified in one forward; "
                    "tokens/s over alternating runs, steps, acceptance, and whether drafting changed any output.")
    spec.add_argument("--requests", action=Size, type=int, default=4, help="requests at once (default 4)")
    spec.add_argument("--new-tokens", action=Size, type=int, default=96, help="greedy tokens per request (default 96)")
    spec.add_argument("--max-draft-len", type=int, default=4, help="draft tokens per step at most (default 4)")
    spec.add_argument("--repeats", type=int, default=3, help="runs per row, alternating (default 3)")
    add_output_options(spec, "2 requests, 32 new tokens", run_spec, quick=dict(requests=2, new_tokens=32))


def run_spec(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.spec import SpecBenchConfig, run_spec_bench
    from trtllm_vtoken.cli.bench_common import load_model, publish
    from trtllm_vtoken.report import format_table

    cfg = SpecBenchConfig(requests=args.requests, max_output_tokens=args.new_tokens,
                          max_draft_len=args.max_draft_len, repeats=args.repeats)
    _, model, tokenizer = load_model(None)
    with tqdm(total=5 * cfg.repeats, desc="bench spec", unit="run", disable=None, file=sys.stderr) as bar:
        result = run_spec_bench(cfg, model, tokenizer, progress=bar)
    print(f"vtoken bench spec: {cfg.requests} requests repeating a source from their prompt, {cfg.max_output_tokens} "
          f"greedy tokens, n-gram drafts of up to {cfg.max_draft_len}, H2O {cfg.budget}, plain order; the median of "
          f"{cfg.repeats} alternating runs")
    print(format_table(["run", "tok/s [range]", "steps", "drafted", "accepted", "acceptance"],
                       [[r["label"], f"{r['tokens_per_s']:.2f} [{r['tokens_per_s_min']:.2f}-{r['tokens_per_s_max']:.2f}]",
                         r["steps"], r["drafted"], r["accepted"],
                         "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"]
                        for r in result["rows"]]))
    same, n = result["same_outputs_with_drafts"], result["requests"]
    print(f"outputs with drafts = without: native {same['native']}/{n}, vtoken {same['vtoken']}/{n} (a step takes "
          f"1 + accepted tokens at once: H2O may decide at other steps); vtoken = naive-evict with drafts: "
          f"{same['vtoken_vs_naive_evict']}/{n} (decisions and tokens)")
    publish(args.out, "spec", result)
    return 0
