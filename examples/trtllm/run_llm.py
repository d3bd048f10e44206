# SPDX-License-Identifier: Apache-2.0
"""TensorRT-LLM's LLM API with vToken (the "Python runner"). Needs tensorrt_llm 1.2.1 and a GPU:

    python examples/trtllm/run_llm.py /models/Llama-3.1-8B-Instruct --policy h2o --budget 0.5

The worker TensorRT-LLM spawns imports trtllm_vtoken.integration.trtllm.connector (named in the
returned connector_config), which installs VTokenKVCacheManager, the physical-kv_lens metadata,
unfused RoPE and query recording before the KV cache is built.
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="Hugging Face model folder or id TensorRT-LLM can load")
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--budget", default="0.5", help="live tokens per request: count or ratio")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt", action="append", help="repeatable (default: two examples)")
    args = parser.parse_args()
    try:
        from tensorrt_llm import LLM, SamplingParams
    except ImportError:
        print("error: tensorrt_llm is not installed (use the gpu Docker target)", file=sys.stderr)
        return 2
    from trtllm_vtoken.integration.trtllm import vtoken_llm_args

    prompts = args.prompt or ["Explain paged attention in two sentences.", "Write a haiku about memory."]
    llm = LLM(args.model, **vtoken_llm_args(policy=args.policy, budget=args.budget))
    for prompt, output in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens))):
        print(f"--- {prompt}\n{output.outputs[0].text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
