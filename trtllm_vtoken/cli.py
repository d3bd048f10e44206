# SPDX-License-Identifier: Apache-2.0
"""The ``vtoken`` command line. It only builds configs and calls the library."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence

from trtllm_vtoken import __version__


def _cmd_info(args: argparse.Namespace) -> int:
    from trtllm_vtoken.policies import POLICIES
    from trtllm_vtoken.reclaim import PLANNERS

    import numpy
    import torch

    print(f"trtllm_vtoken {__version__} (Python {platform.python_version()})")
    print("core implementation: python (numpy reference)")
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    print(f"numpy {numpy.__version__}")
    print(f"policies: {', '.join(POLICIES.names())}")
    print(f"compaction modes: {', '.join(PLANNERS.names())}")
    return 0


def _cmd_bench_core(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.core import CoreBenchConfig, run_core_bench
    from trtllm_vtoken.report import format_table, write_json

    modes = ["dense", "lazy"] if args.mode == "both" else [args.mode]
    steps = 10 if args.quick else args.steps
    results = []
    for mode in modes:
        cfg = CoreBenchConfig(
            batch=args.batch, context=args.context, tokens_per_block=args.tokens_per_block,
            steps=steps, warmup=min(5, steps), mode=mode, seed=args.seed,
        )
        with tqdm(total=cfg.warmup + cfg.steps, desc=f"bench core ({mode})", unit="step",
                  disable=None, file=sys.stderr) as bar:
            results.append(run_core_bench(cfg, progress=bar))
    headers = ["mode", "sync us", "evict us", "plan us", "apply us", "step us (p50)", "step us (p90)",
               "us/request", "metadata B/token"]
    rows = [
        [r["config"]["mode"], *(r["step_us"][s] for s in ("sync", "evict", "plan", "apply")),
         r["total_us_median"], r["total_us_p90"], r["per_request_us"], r["metadata_bytes_per_token"]]
        for r in results
    ]
    c = results[0]["config"]
    print(f"vtoken bench core: batch {c['batch']}, context {c['context']}, tokens_per_block "
          f"{c['tokens_per_block']}, one eviction per request per step, {steps} steps (median)")
    print(format_table(headers, rows))
    path = write_json(args.out, "core", {"results": results, "machine": _machine()})
    print(f"wrote {path}")
    return 0


def _machine() -> dict:
    import os

    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vtoken", description="vToken: token-level virtualization for reclaimable KV caches."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="show versions, the active implementation and registries")
    info.set_defaults(func=_cmd_info)

    bench = sub.add_parser("bench", help="run a benchmark").add_subparsers(dest="bench", required=True)
    core = bench.add_parser("core", help="host time of table updates, evictions, planning, moves per step")
    core.add_argument("--batch", type=int, default=256, help="concurrent requests (default 256)")
    core.add_argument("--context", type=int, default=4096, help="live tokens per request (default 4096)")
    core.add_argument("--tokens-per-block", type=int, default=32, help="default 32")
    core.add_argument("--steps", type=int, default=50, help="timed decode steps (default 50)")
    core.add_argument("--mode", choices=["dense", "lazy", "both"], default="both")
    core.add_argument("--seed", type=int, default=0)
    core.add_argument("--quick", action="store_true", help="10 steps: a smoke run")
    core.add_argument("--out", default="out", help="folder for core.json (default ./out)")
    core.set_defaults(func=_cmd_bench_core)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"vtoken: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
