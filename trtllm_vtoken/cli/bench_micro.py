# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench host`` and ``vtoken bench trtllm-mass``: the two measurements behind design
choices of the step's host work and of the TensorRT-LLM manager's attention mass; each prints a
table and writes ``<out>/<name>.json``."""

from __future__ import annotations

import argparse
import statistics
import sys

from trtllm_vtoken.cli.bench_common import Size, add_output_options, publish


def register(bench) -> None:
    host = bench.add_parser(
        "host", help="what one numpy or Python operation costs the host's thread, warm and after 1 ms asleep",
        description="Each operation warm (best of 5 x 2,000 calls) and right after the thread slept 1 ms (median "
                    "over rounds, operations in alternating order), as an engine's own work between two steps "
                    "leaves the thread's caches: why the step's host work counts calls and objects. Then the "
                    "C++ core's registration call with its arrays writeable and read-only (where it is built).")
    host.add_argument("--rounds", action=Size, type=int, default=400,
                      help="timed rounds after a 1 ms sleep (default 400)")
    add_output_options(host, "40 rounds", run_host, quick=dict(rounds=40))

    mass = bench.add_parser(
        "trtllm-mass", help="what H2O's attention mass costs on the TensorRT-LLM path, against the attention itself",
        description="The manager's attention-mass passes (decode: a batch over a bf16 pool in TensorRT-LLM's "
                    "layout; prefill: one context row, one layer) against their torch specification and against "
                    "the attention they observe on the same tensors (torch's fused SDPA), on SmolLM2-135M's "
                    "attention shapes: alternating rounds, each ratio with its range over the rounds and a "
                    "verdict, and the peak transient bytes of each pass. VTOKEN_MAX_CPU_ISA=avx512-bf16 (or "
                    "avx512, none) limits the C++ passes, not torch's attention, so that a CPU with AMX times "
                    "its other kinds too.")
    mass.add_argument("--device", default="cpu", help="torch device of the tensors (default cpu)")
    mass.add_argument("--batch", action=Size, type=int, default=64, help="decode rows (default 64)")
    mass.add_argument("--context", action=Size, type=int, default=4096,
                      help="tokens of context per decode row (default 4096)")
    mass.add_argument("--prompts", action=Size, default="512,1024,2048,4096,8192",
                      help="prompt lengths of the prefill rows, comma-separated (default 512,1024,2048,4096,8192)")
    mass.add_argument("--prompt-dtypes", action=Size, default="float32,bfloat16",
                      help="dtypes of the prefill rows' q, k, v, comma-separated (default float32,bfloat16)")
    mass.add_argument("--rounds", type=int, default=3, help="timed rounds per section, alternating (default 3)")
    add_output_options(mass, "batch 8, context 512, prompts 256 and 512 in float32", run_trtllm_mass,
                       quick=dict(batch=8, context=512, prompts="256,512", prompt_dtypes="float32"))


def run_host(args: argparse.Namespace) -> int:
    from trtllm_vtoken.bench.host_cost import BATCH, run_host_bench, time_registration
    from trtllm_vtoken.report import format_table

    result = run_host_bench(rounds=args.rounds)
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


def _limited(ceiling: str | None) -> str:
    return "" if ceiling in (None, "amx") else f"; the C++ passes limited to {ceiling}: VTOKEN_MAX_CPU_ISA"


def run_trtllm_mass(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trtllm_vtoken.bench.trtllm_mass import TrtllmMassBenchConfig, run_trtllm_mass_bench
    from trtllm_vtoken.report import format_table

    cfg = TrtllmMassBenchConfig(batch=args.batch, context=args.context, rounds=args.rounds, device=args.device,
                                prompts=parse_list(args.prompts, int, "--prompts"),
                                prompt_dtypes=parse_list(args.prompt_dtypes, str, "--prompt-dtypes"))
    sections = 1 + len(cfg.prompts) * len(cfg.prompt_dtypes)
    with tqdm(total=sections * cfg.rounds, desc="bench trtllm-mass", unit="round", disable=None,
              file=sys.stderr) as bar:
        result = run_trtllm_mass_bench(cfg, progress=bar)
    decode = result["decode"]
    print(f"vtoken bench trtllm-mass: {result['device']} ({decode['pass']} decode pass, each prefill row's pass "
          f"named; {result['torch_threads']} torch threads{_limited(result['isa_ceiling'])}), {cfg.rounds} "
          "alternating rounds; ranges over the rounds")
    print(f"decode: batch {cfg.batch}, context {cfg.context}, 30 layers, bf16 pool (mass pass - specification: "
          f"{decode['max_abs_difference']:.2e} at most)")
    print(format_table(["way", "ms (median)", "min", "max", "peak transient MiB"],
                       [[way, statistics.median(ms), min(ms), max(ms),
                         _mib(decode["peak_transient_bytes"].get(way))] for way, ms in decode["ms"].items()]))
    print(f"mass pass / attention: {_ratio(decode['mass_pass_to_attention'])}")
    print(f"mass pass / attention over K, V laid out contiguously beforehand (what a fused paged attention "
          f"reads): {_ratio(decode['mass_pass_to_contiguous_attention'])}")
    if decode["torch_pass_to_contiguous_attention"] is not None:
        print(f"torch pass (where the manager takes another) / that attention: "
              f"{_ratio(decode['torch_pass_to_contiguous_attention'])}")
    print("prefill: one context row, one layer")
    window = next(name for name in result["prefill"][0]["ms"] if "window" in name)
    print(format_table(
        ["tokens", "dtype", "pass", "mass ms", f"{window.split(', ')[1]} ms", "attention ms", "specification ms",
         "mass / attention", f"{window.split(', ')[1]} / attention", "torch pass / attention",
         "peak MiB (mass, spec)"],
        [[row["tokens"], row["dtype"], row["pass"], statistics.median(row["ms"]["mass pass"]), statistics.median(row["ms"][window]),
          statistics.median(row["ms"]["attention"]),
          statistics.median(row["ms"]["specification"]) if "specification" in row["ms"] else "-",
          _ratio(row["mass_pass_to_attention"]), _ratio(row["windowed_to_attention"]),
          "-" if row["torch_pass_to_attention"] is None else _ratio(row["torch_pass_to_attention"]),
          f"{_mib(row['peak_transient_bytes']['mass pass'])}, {_mib(row['peak_transient_bytes'].get('specification'))}"]
         for row in result["prefill"]]))
    print(f"the passes' cap: {result['cap_bytes'] / 2**20:.0f} MiB of workspace")
    publish(args.out, "trtllm_mass", result)
    return 0


def parse_list(text: str, kind, option: str) -> tuple:
    try:
        values = tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise SystemExit(f"{option}: expected a comma-separated list, got {text!r}") from None
    if not values:
        raise SystemExit(f"{option}: expected a comma-separated list, got {text!r}")
    return values


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def _ratio(summary: dict) -> str:
    return f"{summary['ratio']:.2f}x [{summary['ratio_min']:.2f}-{summary['ratio_max']:.2f}] {summary['verdict']}"
