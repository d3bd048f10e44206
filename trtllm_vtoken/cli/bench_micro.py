# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench host`` and ``vtoken bench trtllm-mass``: the two measurements behind design
choices of the step's host work and of the TensorRT-LLM manager's attention mass; each prints a
table and writes ``<out>/<name>.json``."""

from __future__ import annotations

import argparse
import statistics
import sys

from trtllm_vtoken.cli.bench_common import add_output_options, publish


def register(bench) -> None:
    host = bench.add_parser(
        "host", help="what one numpy or Python operation costs the host's thread, warm and after 1 ms asleep",
        description="Each operation warm (best of 5 x 2,000 calls) and right after the thread slept 1 ms (median "
                    "over rounds, operations in alternating order), as an engine's own work between two steps "
                    "leaves the thread's caches: why the step's host work counts calls and objects. Then the "
                    "C++ core's registration call with its arrays writeable and read-only (where it is built).")
    host.add_argument("--rounds", type=int, default=400, help="timed rounds after a 1 ms sleep (default 400)")
    add_output_options(host, "40 rounds", run_host)

    mass = bench.add_parser(
        "trtllm-mass", help="the TensorRT-LLM manager's decode mass: one pass for the batch vs one per request",
        description="batch_decode_attention_mass over a batch's decode rows in one padded pass, against one call "
                    "and one copy to the host per request, on SmolLM2-135M's attention shapes (bf16 pool, "
                    "tokens_per_block 32): torch operators counted, both timed in alternating order.")
    mass.add_argument("--device", default="cpu", help="torch device of the pool and queries (default cpu)")
    mass.add_argument("--batch", type=int, default=64, help="decode rows (default 64)")
    mass.add_argument("--context", type=int, default=1024, help="tokens of context per row (default 1024)")
    mass.add_argument("--rounds", type=int, default=5, help="timed rounds, alternating (default 5)")
    add_output_options(mass, "batch 8, context 256, 2 rounds", run_trtllm_mass)


def run_host(args: argparse.Namespace) -> int:
    from trtllm_vtoken.bench.host_cost import BATCH, run_host_bench, time_registration
    from trtllm_vtoken.report import format_table

    result = run_host_bench(rounds=40 if args.quick else args.rounds)
    result["registration"] = time_registration(calls=2000 if args.quick else 20000)
    print(f"vtoken bench host: one operation at batch {BATCH}, warm (best of 5 x {result['config']['warm_calls']:,}) "
          f"and after 1 ms asleep (median of {result['config']['rounds']})")
    print(format_table(["operation", "warm us", "after 1 ms asleep us", "ratio"],
                       [[r["operation"], f"{r['warm_us']:.2f}", f"{r['after_sleep_us']:.1f}", f"{r['ratio']:.0f}x"]
                        for r in result["rows"]]))
    if result["registration"] is None:
        print("the C++ core is not built: its registration call is not timed")
    else:
        print(f"the C++ core's registration call (slots_register, {BATCH} requests, five int64 arrays), "
              "best of 5:")
        print(format_table(["arrays", "us per call"], [[r["arrays"], f"{r['call_us']:.2f}"]
                                                        for r in result["registration"]]))
    publish(args.out, "host", result)
    return 0


def run_trtllm_mass(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.trtllm_mass import TrtllmMassBenchConfig, run_trtllm_mass_bench
    from trtllm_vtoken.report import format_table

    cfg = TrtllmMassBenchConfig(batch=8 if args.quick else args.batch, context=256 if args.quick else args.context,
                                rounds=2 if args.quick else args.rounds, device=args.device)
    with tqdm(total=cfg.rounds, desc="bench trtllm-mass", unit="round", disable=None, file=sys.stderr) as bar:
        result = run_trtllm_mass_bench(cfg, progress=bar)
    ways = ("per_request", "batched")
    times = {way: [r[f"{way}_ms"] for r in result["rounds"]] for way in ways}
    print(f"vtoken bench trtllm-mass: batch {cfg.batch}, context {cfg.context}, {result['device']}, "
          f"{cfg.rounds} alternating rounds; largest difference between the two: {result['max_abs_difference']}")
    print(format_table(["way", "torch operators", "copies to the host", "ms per step (median)", "min", "max"],
                       [[way.replace("_", " "), result["operators"][way], result["copies_to_host"][way],
                         statistics.median(times[way]), min(times[way]), max(times[way])]
                        for way in ways]))
    publish(args.out, "trtllm_mass", result)
    return 0
