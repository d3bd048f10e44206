# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench long``: prompts longer than the KV budget, prefilled in chunks with eviction
between them (real model); prints three tables and writes ``<out>/long.json`` and ``long.png``."""

from __future__ import annotations

import argparse
import sys


def register(bench) -> None:
    from trtllm_vtoken.cli.bench_common import Size, add_output_options

    long = bench.add_parser(
        "long", help="prompts longer than the KV budget: chunked prefill with eviction between chunks (real model)",
        description="One long document (standard-library sources) at each budget, chunks of --chunk tokens: peak "
                    "blocks, time to first token and decode tokens/s of native, naive-evict and vtoken dense, and "
                    "whether vtoken's decisions and tokens equal naive-evict's; the longest prompt each variant "
                    "serves in a pool of --pool-blocks blocks; and --batch-prompts long prompts sent at once to "
                    "that pool: how many ran at once.")
    long.add_argument("--prompt-tokens", action=Size, type=int, default=4096,
                      help="the long document's tokens (default 4096)")
    long.add_argument("--budgets", action=Size, default="256,512,1024",
                      help="H2O budgets in tokens (default 256,512,1024)")
    long.add_argument("--chunk", action=Size, type=int, default=256,
                      help="prefill chunk in tokens, whole blocks (default 256)")
    long.add_argument("--new-tokens", action=Size, type=int, default=32, help="greedy tokens per request (default 32)")
    long.add_argument("--pool-blocks", action=Size, type=int, default=96,
                      help="the fixed pool of the longest-prompt and batch parts, in 16-token blocks (default 96)")
    long.add_argument("--batch-prompts", action=Size, type=int, default=6, help="long prompts sent at once (default 6)")
    long.add_argument("--batch-prompt-tokens", action=Size, type=int, default=1024,
                      help="tokens of each (default 1024)")
    long.add_argument("--repeats", type=int, default=3,
                      help="runs of each one-document row, alternating; the median run by time to first token and "
                           "both timings' range (default 3)")
    long.add_argument("--check", action="store_true",
                      help="check I1/I2/I4 after every relocation (they read the KV: slower, timings not comparable)")
    add_output_options(long, "a 1,024-token document, budgets 128 and 256, chunks of 128, a 48-block pool, "
                             "4 prompts of 512 tokens, 8 new tokens", run_long,
                       quick=dict(prompt_tokens=1024, budgets="128,256", chunk=128, new_tokens=8, pool_blocks=48,
                                  batch_prompts=4, batch_prompt_tokens=512))


def run_long(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.long import LongBenchConfig, plot_long, run_long_bench, steps
    from trtllm_vtoken.cli.bench_common import load_model, publish
    from trtllm_vtoken.cli.bench_micro import parse_list
    from trtllm_vtoken.report import format_table

    cfg = LongBenchConfig(prompt_tokens=args.prompt_tokens, budgets=parse_list(args.budgets, int, "--budgets"),
                          chunk=args.chunk, max_output_tokens=args.new_tokens, pool_blocks=args.pool_blocks,
                          batch_prompts=args.batch_prompts, batch_prompt_tokens=args.batch_prompt_tokens,
                          check_invariants=args.check, repeats=args.repeats)
    _, model, tokenizer = load_model(None)
    with tqdm(total=steps(cfg), desc="bench long", unit="run", disable=None, file=sys.stderr) as bar:
        result = run_long_bench(cfg, model, tokenizer, progress=bar)
    print(f"vtoken bench long: {cfg.policy}, chunks of {cfg.chunk} tokens, blocks of {cfg.tokens_per_block}, "
          f"{cfg.max_output_tokens} new tokens")
    print(f"one {cfg.prompt_tokens}-token document ({cfg.repeats} alternating runs per row: the median by first "
          "token, each timing's range):")
    print(format_table(
        ["budget", "variant", "peak blocks", "bound (budget + chunk + 1 block)", "first token s [min-max]",
         "decode tok/s [min-max]", "tokens evicted", "vtoken == naive-evict"],
        [[row["budget"], variant, run["peak_blocks"], row["peak_bound_blocks"] if variant == "vtoken" else "-",
          f"{run['ttft_s']:.2f} [{run['ttft_s_min']:.2f}-{run['ttft_s_max']:.2f}]",
          f"{run['decode_tokens_per_s']:.2f} [{run['decode_tokens_per_s_min']:.2f}-"
          f"{run['decode_tokens_per_s_max']:.2f}]", run["tokens_evicted"],
          row["vtoken_equals_naive_evict"] if variant == "vtoken" else "-"]
         for row in result["single"] for variant, run in row["runs"].items()]))
    print(f"the longest prompt served in {cfg.pool_blocks} blocks ({cfg.pool_blocks * cfg.tokens_per_block} tokens), "
          f"budget {cfg.budgets[0]}:")
    print(format_table(["variant", "prompt tokens", "peak blocks", "s"],
                       [[v, r["prompt_tokens"], r["served"]["peak_blocks"] if r["served"] else "-",
                         r["served"]["wall_s"] if r["served"] else "-"] for v, r in result["longest"].items()]))
    print(f"{cfg.batch_prompts} prompts of {cfg.batch_prompt_tokens} tokens at once, the same pool (one run; "
          "the counts are deterministic):")
    print(format_table(["variant", "most running", "peak blocks", "preemptions", "last first token s", "s"],
                       [[v, r["most_running"], r["peak_blocks"], r["preemptions"], r["ttft_s"], r["wall_s"]]
                        for v, r in result["batch"].items()]))
    publish(args.out, "long", result, plot_long)
    return 0
