# SPDX-License-Identifier: Apache-2.0
"""A trtllm-build engine run by TensorRT-LLM's Python runner with vToken. Needs a TensorRT-LLM 1.2.x
install and a GPU (the 1.2 line and the 1.3.0rc pre-releases up to the removal still ship the
TensorRT-engine path; see the README).

Build the engine from a Hugging Face Llama checkpoint with TensorRT-LLM 1.2's own tools (paged KV
cache, GPT attention plugin and packed inputs are the defaults of trtllm-build). The recommended
build for vToken keeps the KV cache in float16, not quantized, and without --streamingllm:

    python TensorRT-LLM/examples/models/core/llama/convert_checkpoint.py \\
        --model_dir /models/Llama-3.1-8B-Instruct --output_dir /tmp/llama-ckpt --dtype float16
    trtllm-build --checkpoint_dir /tmp/llama-ckpt --output_dir /tmp/llama-engine --gemm_plugin auto \\
        --max_batch_size 8 --max_input_len 2048 --max_seq_len 4096

Why: the GPT attention plugin rotates each new token by its physical position, so vToken turns
the surviving keys back whenever a sequence loses tokens (a block's worth at a time), and every
turn rounds to the cache dtype. Recovered re-rotation keeps a key within about 2 roundings of its
exact value over 512 steps, and a float16 rounding is 8x finer than a bfloat16 one
(tests/integration/test_engine_drift.py). A quantized KV cache (int8/fp8 codes) and a StreamingLLM
engine (keys cached unrotated, rotated by cache slot when read) are refused.

Then generate with a bounded KV cache (score-free policies only: streaming_llm, sliding_window,
random), or check the path (--check):

    python examples/trtllm/run_engine.py /tmp/llama-engine --tokenizer /models/Llama-3.1-8B-Instruct \\
        --policy streaming_llm --budget 256 --max-tokens 512
    python examples/trtllm/run_engine.py /tmp/llama-engine --tokenizer /models/Llama-3.1-8B-Instruct --check

--check runs TensorRT-LLM's own runner greedily, then vToken with a budget that never evicts: the
tokens must be identical (exit status 1 otherwise); then vToken with the given budget, reporting
blocks freed, keys re-rotated and the KV blocks each run allocated.
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine_dir", help="output folder of trtllm-build")
    parser.add_argument("--tokenizer", required=True, help="Hugging Face folder with the tokenizer")
    parser.add_argument("--policy", default="streaming_llm", help="streaming_llm, sliding_window or random")
    parser.add_argument("--budget", default="256", help="live tokens per sequence: a count or a ratio")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--prompt", action="append", help="repeatable (default: two examples)")
    parser.add_argument("--check", action="store_true", help="compare with TensorRT-LLM's own greedy output")
    args = parser.parse_args()
    try:
        import torch
        from tensorrt_llm.runtime import ModelRunner
        from transformers import AutoTokenizer
    except ImportError as exc:
        print(f"error: {exc} (needs tensorrt_llm 1.2.x, e.g. the gpu Docker target)", file=sys.stderr)
        return 2
    from trtllm_vtoken.integration.trtllm.engine_config import engine_rope
    from trtllm_vtoken.integration.trtllm.engine_runner import VTokenEngineRunner
    from trtllm_vtoken.integration.trtllm.settings import VTokenSettings

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    prompts = args.prompt or ["Explain paged attention in two sentences.", "Write a haiku about memory."]
    batch = [torch.tensor(tokenizer.encode(p), dtype=torch.int32) for p in prompts]
    end_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_id
    common = dict(max_new_tokens=args.max_tokens, end_id=end_id, pad_id=pad_id)

    def new_tokens(output) -> list[list[int]]:
        rows = []
        for ids, out in zip(batch, output[:, 0].tolist()):
            row = out[len(ids):]
            rows.append(row[: row.index(end_id)] if end_id in row else row)
        return rows

    try:
        rope = engine_rope(args.engine_dir)  # ValueError for an engine vToken refuses, and why
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = ModelRunner.from_dir(args.engine_dir)  # one engine: vToken wraps this runner's session

    def vtoken(budget) -> VTokenEngineRunner:
        return VTokenEngineRunner(engine, VTokenSettings(policy=args.policy, budget=budget, positions="shift"), rope)

    status = 0
    if args.check:
        want = new_tokens(engine.generate(batch, **common))
        got = new_tokens(vtoken(10**9).generate(batch, **common))
        same = got == want
        print(f"never-evicting budget reproduces TensorRT-LLM's greedy output: {'PASS' if same else 'FAIL'}")
        status = 0 if same else 1
    runner = vtoken(args.budget)
    output = new_tokens(runner.generate(batch, **common))
    for prompt, row in zip(prompts, output):
        print(f"--- {prompt}\n{tokenizer.decode(row)}")
    stats = runner.stats()
    print(f"vToken ({args.policy}, budget {args.budget}): {stats['tokens_evicted']} tokens evicted, "
          f"{stats['blocks_freed']} blocks freed ({stats['blocks_trimmed']} more trimmed from the longest prompt's), "
          f"{stats['keys_rerotated']} keys re-rotated in "
          f"{stats['rerotation_passes']} passes, peak {stats['peak_blocks']} blocks")
    return status


if __name__ == "__main__":
    sys.exit(main())
