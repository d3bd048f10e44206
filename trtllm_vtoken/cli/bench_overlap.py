# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench overlap``: the real model's tokens/s for native, naive-evict and vtoken with and
without the engine's overlap scheduler, and where the engine's thread spent each run; prints a
table and writes ``<out>/overlap.json``."""

from __future__ import annotations

import argparse
import sys


def register(bench) -> None:
    from trtllm_vtoken.cli.bench_common import Size, add_output_options

    overlap = bench.add_parser(
        "overlap", help="tokens/s with and without the overlap scheduler (real model, CPU)",
        description="A fresh reference engine serves the same ShareGPT batch to the end, greedy, for native, "
                    "naive-evict and vtoken (H2O, dense), each with the overlap scheduler (the step of "
                    "iteration N beside forward N+1, before it where it may evict) and without, and vtoken "
                    "with its prompt or decode decisions lagged; alternating order, the median of --repeats "
                    "runs with the range.")
    overlap.add_argument("--model", default=None, help="Hugging Face Llama folder (default: SmolLM2-135M)")
    overlap.add_argument("--requests", action=Size, type=int, default=16, help="requests in the batch (default 16)")
    overlap.add_argument("--prompt-tokens", type=int, default=256, help="longest prompt, in tokens (default 256)")
    overlap.add_argument("--new-tokens", action=Size, type=int, default=64,
                         help="greedy tokens per request (default 64)")
    overlap.add_argument("--budget", type=float, default=0.5, help="H2O's retention ratio (default 0.5)")
    overlap.add_argument("--repeats", action=Size, type=int, default=3, help="runs per row (default 3)")
    add_output_options(overlap, "4 requests, 16 new tokens, one run each", run_overlap,
                       quick=dict(requests=4, new_tokens=16, repeats=1))


def run_overlap(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.overlap import OverlapBenchConfig, run_overlap_bench
    from trtllm_vtoken.cli.bench_common import load_model, publish
    from trtllm_vtoken.report import format_table

    cfg = OverlapBenchConfig(requests=args.requests, max_prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                             budget=args.budget, repeats=args.repeats)
    folder, model, tokenizer = load_model(args.model)
    with tqdm(total=len(cfg.rows()) * cfg.repeats, desc="bench overlap", unit="run", disable=None,
              file=sys.stderr) as bar:
        result = run_overlap_bench(cfg, model, tokenizer, progress=bar)
    import torch

    print(f"vtoken bench overlap: {folder.name} fp32 on CPU ({torch.get_num_threads()} intra-op threads), "
          f"{cfg.requests} ShareGPT requests (prompts up to {cfg.max_prompt_tokens} tokens), {cfg.new_tokens} greedy "
          f"tokens each, H2O {cfg.budget}; median [min-max] of {cfg.repeats} alternating runs; seconds of the "
          "engine's thread per run")
    print(format_table(
        ["variant", "overlap", "prefill decision", "decode decision", "tok/s", "forward s", "step here s",
         "waited s", "other s", "evicted"],
        [[r["variant"], "on" if r["overlap"] else "off", r["prefill_decision"] if r["overlap"] else "-",
          r["decode_decision"] if r["overlap"] else "-",
          f"{r['tokens_per_s']:.1f} [{r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f}]",
          f"{r['forward_s']:.2f}", f"{r['step_here_s']:.3f}", f"{r['waited_s']:.3f}", f"{r['other_s']:.2f}",
          r["tokens_evicted"]] for r in result["rows"]]))
    publish(args.out, "overlap", result)
    return 0
