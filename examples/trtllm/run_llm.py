# SPDX-License-Identifier: Apache-2.0
"""TensorRT-LLM's LLM API with vToken. Needs tensorrt_llm 1.2.1 and a GPU (the gpu Docker image):

    python examples/trtllm/run_llm.py /models/Llama-3.1-8B-Instruct --policy h2o --budget 0.5
    python examples/trtllm/run_llm.py /models/Llama-3.1-8B-Instruct --check

``vtoken_llm_args`` sends vToken's settings to TensorRT-LLM's executor worker (``env_overrides``
where ``TorchLlmArgs`` has it, and this process's environment, which is why this script calls it
before importing tensorrt_llm); the package's start-up hook installs vToken there before the model
is built, and the ``LLM`` fails if its worker did not arm.

``--check`` verifies on the GPU what CPU tests cannot. It runs three LLMs, each in a process of its
own (so each worker's environment is exactly what that LLM sent, whichever route the installed
TensorRT-LLM honours): a baseline with RoPE unfused and TensorRT-LLM's own KV-cache manager
(``baseline_llm_args``), vToken with a budget that never evicts, and vToken with one that does.
It passes only if (1) the never-evicting run's greedy output equals the baseline's, token for
token -- both unfuse RoPE, so a difference is vToken's; (2) each worker's record shows it armed as
asked and that vToken's steps ran (never-evicting: no token evicted; evicting: tokens evicted and
blocks given back); exit status 0 only then.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = ["Explain paged attention in two sentences.", "Write a haiku about memory.",
           "List three uses of a KV cache and say why each one matters for serving large models."]
PHASES = ("baseline", "never evicts", "evicts")


def hook_active() -> bool:
    """Did this interpreter start with trtllm_vtoken_startup.pth (the package installed)? The
    executor worker starts from the same site-packages."""
    return any(type(finder).__name__ == "StartupHook" for finder in sys.meta_path)


def phase_args(phase: str, args: argparse.Namespace, stats_file: str) -> dict:
    """The LLM arguments of one ``--check`` phase; call it before importing tensorrt_llm."""
    from trtllm_vtoken.integration.trtllm import baseline_llm_args, vtoken_llm_args

    if phase == "baseline":
        return baseline_llm_args(args.tokens_per_block, stats_file=stats_file)
    budget = args.max_seq_len if phase == "never evicts" else args.evict_budget
    return vtoken_llm_args(policy=args.policy, budget=budget, tokens_per_block=args.tokens_per_block,
                           stats_file=stats_file, stats_interval_s=0.01)


def run_phase(args: argparse.Namespace) -> dict:
    """One phase in this process: the LLM, its greedy output, then its worker's record and counters."""
    from trtllm_vtoken.integration.trtllm.arming import read_record
    from trtllm_vtoken.integration.trtllm.stats import read_stats

    stats_file = str(Path(tempfile.mkdtemp(prefix="vtoken-check-")) / "stats.json")
    llm_args = phase_args(args.phase, args, stats_file)  # before the import: the environment route too
    from tensorrt_llm import LLM, SamplingParams

    llm = LLM(args.model, max_seq_len=args.max_seq_len, **llm_args)  # raises if the worker did not arm
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, top_k=1)  # greedy
    tokens = [list(out.outputs[0].token_ids) for out in llm.generate(args.prompts, params)]
    llm.shutdown()
    return {"tokens": tokens, "record": read_record(stats_file), "stats": read_stats(stats_file) or {}}


def verdicts(results: dict[str, dict], prompts: list[str]) -> list[tuple[bool, str]]:
    """(passed, line) for each thing ``--check`` asserts, from each phase's result."""
    lines = []
    for phase, mode in (("baseline", "rope"), ("never evicts", "vtoken"), ("evicts", "vtoken")):
        record = results[phase]["record"] or {}
        steps = record.get("steps", 0)
        ran = record.get("mode") == mode and (mode == "rope" or steps > 0)
        lines.append((ran, f"{phase}: worker {record.get('pid', '?')} armed as {record.get('mode')!r} "
                           f"(want {mode!r}), tensorrt_llm {record.get('tensorrt_llm', '?')}, "
                           f"{record.get('manager', 'TensorRT-LLM KVCacheManager')}, {steps} vToken steps"))
    never, evicts = results["never evicts"]["stats"], results["evicts"]["stats"]
    evicted = never.get("vtoken_tokens_evicted", 0.0)
    lines.append((evicted == 0, f"never evicts: {int(evicted)} tokens evicted"))
    for prompt, want, have in zip(prompts, results["baseline"]["tokens"], results["never evicts"]["tokens"]):
        same = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
        lines.append((want == have, f"never evicts: {same}/{len(want)} tokens equal the baseline's greedy output "
                                    f"for {prompt[:40]!r}"))
    freed, evicted = evicts.get("vtoken_blocks_reclaimed", 0.0), evicts.get("vtoken_tokens_evicted", 0.0)
    produced = [len(tokens) for tokens in results["evicts"]["tokens"]]
    lines.append((freed > 0 and evicted > 0 and all(produced),
                  f"evicts: {int(evicted)} tokens evicted, {int(freed)} blocks freed, {sum(produced)} tokens generated"))
    return lines


def check(args: argparse.Namespace) -> int:
    results = {}
    for phase in PHASES:
        with tempfile.TemporaryDirectory(prefix="vtoken-check-") as folder:
            out = Path(folder) / "result.json"
            command = [sys.executable, __file__, args.model, "--phase", phase, "--result", str(out),
                       "--policy", args.policy, "--evict-budget", args.evict_budget, "--max-tokens", str(args.max_tokens),
                       "--max-seq-len", str(args.max_seq_len), "--tokens-per-block", str(args.tokens_per_block)]
            for prompt in args.prompts:
                command += ["--prompt", prompt]
            print(f"--- {phase}", flush=True)
            if subprocess.run(command, env=dict(os.environ)).returncode != 0:
                print(f"[FAIL] {phase}: the run failed (its error is above)")
                return 1
            results[phase] = json.loads(out.read_text())
    lines = verdicts(results, args.prompts)
    for ok, line in lines:
        print(f"[{'ok' if ok else 'FAIL'}] {line}")
    return 0 if all(ok for ok, _ in lines) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="Hugging Face model folder or id TensorRT-LLM can load")
    parser.add_argument("--policy", default="h2o", help="eviction policy (default h2o)")
    parser.add_argument("--budget", default="0.5", help="live tokens per request: count or ratio (default 0.5)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per prompt (default 128)")
    parser.add_argument("--max-seq-len", type=int, default=2048, help="TensorRT-LLM's max_seq_len (default 2048)")
    parser.add_argument("--tokens-per-block", type=int, default=32, help="KV block size (default 32)")
    parser.add_argument("--prompt", dest="prompts", action="append", help="repeatable (default: three examples)")
    parser.add_argument("--check", action="store_true",
                        help="compare a never-evicting vToken run with a baseline that also has RoPE unfused, and "
                             "check from each worker's record that it armed and vToken ran (--evict-budget for the "
                             "evicting run); exit 1 if anything fails")
    parser.add_argument("--evict-budget", default="16", help="the evicting budget of --check (default 16 tokens)")
    parser.add_argument("--phase", choices=PHASES, help="(used by --check) run one phase in this process")
    parser.add_argument("--result", help="(used by --check) where --phase writes its result as JSON")
    args = parser.parse_args()
    args.prompts = args.prompts or PROMPTS
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is None:
        print("error: tensorrt_llm is not installed (use the gpu Docker target)", file=sys.stderr)
        return 2
    if (args.check or args.phase) and not hook_active():
        print("error: vToken's start-up hook is not active: install the package (pip install .) so that "
              "trtllm_vtoken_startup.pth is in site-packages", file=sys.stderr)
        return 2
    if args.phase:
        Path(args.result).write_text(json.dumps(run_phase(args)))
        return 0
    if args.check:
        return check(args)
    from trtllm_vtoken.integration.trtllm import vtoken_llm_args

    llm_args = vtoken_llm_args(policy=args.policy, budget=args.budget, tokens_per_block=args.tokens_per_block)
    from tensorrt_llm import LLM, SamplingParams

    llm = LLM(args.model, max_seq_len=args.max_seq_len, **llm_args)
    for prompt, output in zip(args.prompts, llm.generate(args.prompts, SamplingParams(max_tokens=args.max_tokens))):
        print(f"--- {prompt}\n{output.outputs[0].text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
