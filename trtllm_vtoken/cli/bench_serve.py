# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench serve``: throughput and latency through a real Triton server vs the engine called
directly, at several concurrencies, in one run; prints a table and writes ``<out>/serve.json``."""

from __future__ import annotations

import argparse
import sys


def register(bench) -> None:
    from trtllm_vtoken.cli.bench_common import Size, add_output_options

    serve = bench.add_parser(
        "serve", help="throughput and latency through Triton vs the engine called directly",
        description="Starts tritonserver on triton_model_repo, then runs closed-loop clients at each "
                    "concurrency against the in-process engine and against Triton's generate endpoint.")
    serve.add_argument("--concurrency", action=Size, default="1,8,32", help="comma-separated levels (default 1,8,32)")
    serve.add_argument("--requests-per-client", action=Size, type=int, default=2,
                       help="requests each client sends (default 2)")
    serve.add_argument("--max-tokens", action=Size, type=int, default=32, help="new tokens per request (default 32)")
    serve.add_argument("--num-blocks", type=int, default=512, help="KV blocks of the served engine (default 512)")
    serve.add_argument("--policy", default="h2o", help="eviction policy (default h2o)")
    serve.add_argument("--budget", default="0.5", help="live tokens per request: a count or a ratio (default 0.5)")
    add_output_options(serve, "concurrency 1,8, one request per client, 16 tokens", run_serve,
                       quick=dict(concurrency="1,8", requests_per_client=1, max_tokens=16))


def run_serve(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from tqdm import tqdm

    from trtllm_vtoken.bench.serving import ServeBenchConfig, run_serve_bench
    from trtllm_vtoken.report import format_table
    from trtllm_vtoken.runtime.checkpoint import ensure_default_model
    from trtllm_vtoken.serving.settings import ServingSettings
    from trtllm_vtoken.serving.triton import (
        TritonServer,
        default_repository,
        free_ports,
        prepare_repository,
        repository_parameters,
    )

    try:
        levels = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    cfg = ServeBenchConfig(concurrency=levels, requests_per_client=args.requests_per_client,
                           max_tokens=args.max_tokens)
    max_batch = max(cfg.concurrency)
    overrides = {"policy": args.policy, "budget": args.budget, "num_blocks": str(args.num_blocks),
                 "max_batch_size": str(max_batch), "threads": str(args.intra_op_threads or 0)}
    ensure_default_model()
    scratch = Path(tempfile.mkdtemp(prefix="vtoken-bench-serve-"))
    repository = prepare_repository(default_repository(), scratch / "repo", overrides)
    settings = ServingSettings.from_parameters(repository_parameters(repository))
    with TritonServer(repository, scratch, *free_ports(3)) as server, \
            tqdm(total=2 * len(cfg.concurrency), desc="bench serve", unit="run", disable=None, file=sys.stderr) as bar:
        result = run_serve_bench(cfg, settings, server, progress=bar)
    headers = ["concurrency", "direct tok/s", "triton tok/s", "overhead %", "direct p50 s", "triton p50 s",
               "direct p95 s", "triton p95 s"]
    rows = [[r["concurrency"], r["direct"]["tokens_per_s"], r["triton"]["tokens_per_s"],
             100 * r["triton_overhead"], r["direct"]["latency_p50_s"], r["triton"]["latency_p50_s"],
             r["direct"]["latency_p95_s"], r["triton"]["latency_p95_s"]] for r in result["rows"]]
    print(f"vtoken bench serve: SmolLM2-135M on CPU, {settings.engine.policy} budget {settings.engine.budget}, "
          f"{cfg.requests_per_client} requests per client, {cfg.max_tokens} new tokens, ShareGPT prompts")
    print(format_table(headers, rows))
    from trtllm_vtoken.cli.bench_common import publish

    publish(args.out, "serve", result)
    return 0
