# SPDX-License-Identifier: Apache-2.0
"""TensorRT-LLM's LLM API with vToken. Needs tensorrt_llm 1.2.1 and a GPU (the gpu Docker image):

    python examples/trtllm/run_llm.py /models/Llama-3.1-8B-Instruct --policy h2o --budget 0.5
    python examples/trtllm/run_llm.py /models/Llama-3.1-8B-Instruct --check

``vtoken_llm_args`` returns the LLM arguments with ``env_overrides`` that arm vToken in the
executor worker; the package's start-up hook installs it there before the model is built.

``--check`` verifies on the GPU what CPU tests cannot: (1) with a budget that never evicts, vToken's
greedy output equals TensorRT-LLM's own, token for token; (2) with a budget that does evict, the
run completes and vToken reports the blocks it gave back. Exit status 0 only if both hold.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PROMPTS = ["Explain paged attention in two sentences.", "Write a haiku about memory.",
           "List three uses of a KV cache and say why each one matters for serving large models."]


def generate(llm, prompts: list[str], max_tokens: int, sampling_params) -> list[list[int]]:
    params = sampling_params(max_tokens=max_tokens, temperature=0.0, top_k=1)  # greedy
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]


def hook_active() -> bool:
    """Did this interpreter start with trtllm_vtoken_startup.pth (the package installed)? The
    executor worker starts from the same site-packages."""
    return any(type(finder).__name__ == "CreatorHook" for finder in sys.meta_path)


def check(args, LLM, SamplingParams) -> int:  # noqa: N803 (TensorRT-LLM's class names)
    from trtllm_vtoken.integration.trtllm import llm_args_dict, vtoken_llm_args
    from trtllm_vtoken.integration.trtllm.stats import read_stats

    if not hook_active():
        print("error: vToken's start-up hook is not active: install the package (pip install .) so that "
              "trtllm_vtoken_startup.pth is in site-packages", file=sys.stderr)
        return 2

    plain = llm_args_dict(args.tokens_per_block)
    baseline = LLM(args.model, max_seq_len=args.max_seq_len, **plain, env_overrides={"VTOKEN_TRTLLM": "0"})
    expected = generate(baseline, args.prompts, args.max_tokens, SamplingParams)
    baseline.shutdown()
    failures = 0
    stats_file = Path(tempfile.mkdtemp(prefix="vtoken-check-")) / "stats.json"
    for label, budget in (("never evicts", args.max_seq_len), ("evicts", args.evict_budget)):
        llm = LLM(args.model, max_seq_len=args.max_seq_len,
                  **vtoken_llm_args(policy=args.policy, budget=budget, tokens_per_block=args.tokens_per_block,
                                    stats_file=str(stats_file), stats_interval_s=0.01))
        got = generate(llm, args.prompts, args.max_tokens, SamplingParams)
        llm.shutdown()
        stats = read_stats(stats_file) or {}
        if label == "never evicts":
            for prompt, want, have in zip(args.prompts, expected, got):
                same = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
                ok = want == have
                failures += not ok
                print(f"[{'ok' if ok else 'FAIL'}] budget {budget} ({label}): {same}/{len(want)} tokens equal "
                      f"TensorRT-LLM's own greedy output for {prompt[:40]!r}")
        else:
            freed = stats.get("vtoken_blocks_reclaimed", 0.0)
            ok = freed > 0 and all(len(tokens) > 0 for tokens in got)
            failures += not ok
            print(f"[{'ok' if ok else 'FAIL'}] budget {budget} ({label}): {int(freed)} blocks freed, "
                  f"{int(stats.get('vtoken_tokens_evicted', 0))} tokens evicted, "
                  f"{sum(map(len, got))} tokens generated")
    return 1 if failures else 0


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
                        help="compare with TensorRT-LLM's own greedy output (budget that never evicts) and count "
                             "blocks freed (--evict-budget); exit 1 on a mismatch")
    parser.add_argument("--evict-budget", default="16", help="the evicting budget of --check (default 16 tokens)")
    args = parser.parse_args()
    args.prompts = args.prompts or PROMPTS
    try:
        from tensorrt_llm import LLM, SamplingParams
    except ImportError:
        print("error: tensorrt_llm is not installed (use the gpu Docker target)", file=sys.stderr)
        return 2
    if args.check:
        return check(args, LLM, SamplingParams)
    from trtllm_vtoken.integration.trtllm import vtoken_llm_args

    llm = LLM(args.model, max_seq_len=args.max_seq_len,
              **vtoken_llm_args(policy=args.policy, budget=args.budget, tokens_per_block=args.tokens_per_block))
    for prompt, output in zip(args.prompts, llm.generate(args.prompts, SamplingParams(max_tokens=args.max_tokens))):
        print(f"--- {prompt}\n{output.outputs[0].text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
