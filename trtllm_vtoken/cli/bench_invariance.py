# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench invariance``: whether a greedy answer depends on what runs beside it (prefix
reuse rules, float rounding) or on memory pressure (preemption), on the real model, and what the
batch-invariant forward costs; prints four tables and writes ``<out>/invariance.json``."""

from __future__ import annotations

import argparse
import sys


def register(bench) -> None:
    from trtllm_vtoken.cli.bench_common import Size, add_output_options

    invariance = bench.add_parser(
        "invariance", help="greedy answers alone vs in a batch (prefix reuse rules) and under preemption (real model)",
        description="Six chat prompts and ShareGPT first turns, greedy, prefix caching on. For prefix_reuse copy "
                    "(the default) and share, naive-evict and vtoken: the prompts one at a time and all at once, "
                    "how many answers and eviction traces agree. For native, naive-evict and vtoken: a roomy pool "
                    "against one small enough that greedy admission preempts, how many answers agree. For native and "
                    "vtoken with batch_invariant off and on: how many requests have bitwise the same "
                    "log-probabilities alone and together. Then the forward's time per decode step off and on, "
                    "for 1, 4 and 8 requests, in alternating rounds.")
    invariance.add_argument("--model", default=None, help="Hugging Face Llama folder (default: SmolLM2-135M)")
    invariance.add_argument("--sharegpt-requests", action=Size, type=int, default=6,
                            help="ShareGPT first turns beside the six chat prompts (default 6)")
    invariance.add_argument("--prompt-tokens", type=int, default=192, help="longest prompt, in tokens (default 192)")
    invariance.add_argument("--new-tokens", action=Size, type=int, default=24,
                            help="greedy tokens per request (default 24)")
    invariance.add_argument("--budget", type=float, default=0.5, help="H2O's retention ratio (default 0.5)")
    invariance.add_argument("--tight-fraction", type=float, default=0.4,
                            help="the small pool: this share of the blocks native needs for every request at full "
                                 "length at once (default 0.4)")
    invariance.add_argument("--rounds", action=Size, type=int, default=3,
                            help="alternating rounds of the decode-step timing, off and on (default 3)")
    add_output_options(invariance, "the six chat prompts only, 16 new tokens, 2 timing rounds", run_invariance,
                       quick=dict(sharegpt_requests=0, new_tokens=16, rounds=2))


def run_invariance(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.invariance import InvarianceBenchConfig, run_invariance_bench
    from trtllm_vtoken.cli.bench_common import load_model, publish
    from trtllm_vtoken.report import format_table

    cfg = InvarianceBenchConfig(sharegpt_requests=args.sharegpt_requests,
                                max_prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                                budget=args.budget, tight_fraction=args.tight_fraction, rounds=args.rounds)
    folder, model, tokenizer = load_model(args.model)
    with tqdm(total=18 + len(cfg.cost_batches), desc="bench invariance", unit="run", disable=None,
              file=sys.stderr) as bar:
        result = run_invariance_bench(cfg, model, tokenizer, progress=bar)
    n = len(result["prompt_tokens"])
    print(f"vtoken bench invariance: {folder.name} fp32 on CPU, {n} prompts ({min(result['prompt_tokens'])}-"
          f"{max(result['prompt_tokens'])} tokens), {cfg.new_tokens} greedy tokens, {cfg.policy} {cfg.budget}, "
          f"tokens_per_block {cfg.tokens_per_block}, prefix caching on")
    print(format_table(
        ["prefix_reuse", "variant", "same answer alone / together", "same decisions", "reused tokens alone",
         "reused together", "peak blocks together"],
        [[r["prefix_reuse"], r["variant"], f"{r['same_output']}/{r['requests']}",
          f"{r['same_decisions']}/{r['requests']}", r["cached_prompt_tokens_alone"],
          r["cached_prompt_tokens_together"], r["peak_blocks_together"]] for r in result["batch_rows"]]))
    print(f"copy: vtoken's answers together == naive-evict's: {result['copy_vtoken_equals_naive_evict']}/{n}")
    print(format_table(
        ["variant", "pool (blocks)", "preemptions", "same answer as a roomy pool"],
        [[r["variant"], r["num_blocks"], r["preemptions"], f"{r['same_output']}/{r['requests']}"]
         for r in result["preemption_rows"]]))
    print(format_table(
        ["batch_invariant", "variant", "same answer alone / together", "bitwise same logprobs",
         "largest |cumulative logprob difference|"],
        [["on" if r["batch_invariant"] else "off", r["variant"], f"{r['same_output']}/{r['requests']}",
          f"{r['same_logprobs']}/{r['requests']}", f"{r['largest_cumulative_logprob_difference']:.2e}"]
         for r in result["bitwise_rows"]]))
    print(format_table(
        ["requests", "decode ms/step off", "on", "on / off (median [range])"],
        [[r["batch"], _spread(r["decode_ms_off"]), _spread(r["decode_ms_on"]),
          f"{r['ratio_median']:.2f}x [{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}]"]
         for r in result["cost_rows"]]))
    forward = result["invariant_forward"]
    print(f"batch_invariant here: every product on a multiple of {forward['row_multiple']} rows, the forward on "
          f"{forward['threads']} intra-op thread(s) of the process's {forward['process_threads']}")
    publish(args.out, "invariance", result)
    return 0


def _spread(values: list[float]) -> str:
    ordered = sorted(values)
    return f"{ordered[len(ordered) // 2]:.1f} [{ordered[0]:.1f}-{ordered[-1]:.1f}]"
