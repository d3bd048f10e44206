# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench gpu``: what only a CUDA device can measure (relocation kernel, CUDA-graph
decode, the engine on CUDA); prints three tables and writes ``<out>/gpu.json``."""

from __future__ import annotations

import argparse
import sys


def register(bench) -> None:
    from trtllm_vtoken.cli.bench_common import Size, add_output_options

    gpu = bench.add_parser(
        "gpu", help="CUDA only: relocation kernel vs copies, CUDA-graph decode, the engine on CUDA",
        description="Copy bandwidth of the relocation kernel, eager vs graph-replayed decode steps, "
                    "and every variant end to end on the device (SmolLM2-135M shapes, random weights).")
    gpu.add_argument("--requests", action=Size, type=int, default=64,
                     help="requests in the end-to-end runs (default 64)")
    gpu.add_argument("--prompt-tokens", type=int, default=256, help="prompt length in tokens (default 256)")
    gpu.add_argument("--output-tokens", action=Size, type=int, default=128, help="new tokens per request (default 128)")
    gpu.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"],
                     help="KV and model dtype (default bfloat16)")
    gpu.add_argument("--repeats", action=Size, type=int, default=3,
                     help="engine runs per row, alternating order (default 3)")
    add_output_options(gpu, "16 requests, 64 new tokens", run_gpu, quick=dict(requests=16, output_tokens=64, repeats=1))


def run_gpu(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.gpu import ENGINE_RUNS, GpuBenchConfig, run_gpu_bench
    from trtllm_vtoken.report import format_table

    cfg = GpuBenchConfig(requests=args.requests, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                         dtype=args.dtype, repeats=args.repeats)
    with tqdm(total=len(ENGINE_RUNS) * cfg.repeats, desc="bench gpu (engine runs)", disable=None,
              file=sys.stderr) as bar:
        result = run_gpu_bench(cfg, progress=bar)
    print(f"vtoken bench gpu on {result['device']} (torch {result['torch']}); relocation kernel "
          f"{result['relocation_kernel']}")
    print("\nrelocation copies, Llama-3.1-8B KV shapes (bf16, 128 KiB per token), bytes read + written:")
    print(format_table(["moves", "MiB", "kernel GB/s", "torch GB/s", "d2d GB/s", "kernel/d2d"], [
        [r["moves"], r["mib"], r.get("kernel_gbs", "-"), r["torch_gbs"], r["d2d_gbs"], r.get("kernel_vs_d2d", "-")]
        for r in result["copy"]]))
    print(f"\ndecode step, {cfg.prompt_tokens} tokens of context per row:")
    print(format_table(["batch", "eager ms", "graph ms", "speedup"],
                       [[r["batch"], r["eager_ms"], r["graph_ms"], r["speedup"]] for r in result["decode"]]))
    print(f"\nengine ({cfg.repeats} runs per row, alternating order), {cfg.requests} requests x ({cfg.prompt_tokens} prompt + {cfg.output_tokens} new) tokens, "
          f"{cfg.policy} budget {cfg.budget}:")
    print(format_table(
        ["run", "tokens/s (median)", "min", "max", "vs native graphs", "peak blocks", "moves", "MiB copied",
         "exact match"],
        [[r["label"], r["tokens_per_s"], r["tokens_per_s_min"], r["tokens_per_s_max"],
          r["throughput_vs_native_graphs"], r["peak_blocks"],
          r["moves"], r["bytes_copied"] / 2**20, r.get("exact_match_vs_naive_evict", "-")] for r in result["engine"]]))
    from trtllm_vtoken.cli.bench_common import publish

    publish(args.out, "gpu", result)
    return 0
