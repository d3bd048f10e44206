# SPDX-License-Identifier: Apache-2.0
"""``vtoken generate``: text generation on the reference runtime, streamed for one prompt."""

from __future__ import annotations

import argparse
import sys
import time

from trtllm_vtoken.cli.engine_args import (
    add_engine_args,
    add_request_eviction_args,
    engine_settings,
    request_evictions,
)


def register(sub) -> None:
    parser = sub.add_parser(
        "generate", help="generate text on the reference runtime",
        description="Generate with native, naive-evict or vToken KV management. One prompt is "
                    "streamed as it is generated; several run batched and print in order.",
    )
    parser.add_argument("prompts", nargs="+", help="prompt text(s)")
    add_engine_args(parser)
    s = parser.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt at most (default 128)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the smallest set of tokens whose probability reaches this (default 1.0: off)")
    s.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: off)")
    s.add_argument("--seed", type=int, default=None, help="sampling seed (default: the engine's)")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--no-chat", action="store_true", help="send the text as is, without the chat template")
    add_request_eviction_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trtllm_vtoken.runtime.config import EngineConfig
    from trtllm_vtoken.runtime.llm import LLM
    from trtllm_vtoken.runtime.sampling import SamplingParams

    config = EngineConfig(**engine_settings(args))
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                             top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), eviction=eviction)
              for eviction in request_evictions(args, len(args.prompts))]
    llm = LLM(args.model, config, threads=args.intra_op_threads)
    start = time.perf_counter()
    if len(args.prompts) == 1:
        for snapshot in llm.stream(args.prompts[0], params[0], chat=not args.no_chat):
            print(snapshot.outputs[0].text_diff, end="", flush=True)
        print(flush=True)
    else:
        results = llm.generate(args.prompts, params, use_tqdm=True, chat=not args.no_chat)
        for i, result in enumerate(results):
            out = result.outputs[0]
            print(f"--- [{i}] ({out.finish_reason}, {len(out.token_ids)} tokens)\n{out.text}")
    elapsed = time.perf_counter() - start
    llm.close()
    if llm.engine is not None:
        engine, kv = llm.engine, llm.engine.kv
        decode, peak = engine.stats.decode_tokens, kv.stats.peak_blocks_used
        evicted, freed = kv.step_stats.tokens_evicted, kv.step_stats.blocks_freed
    else:  # every rank holds the same blocks: rank 0 speaks for all
        lead = llm.last_reports[0]
        decode, peak, evicted, freed = lead.decode_tokens, lead.peak_blocks_used, lead.tokens_evicted, lead.blocks_freed
    tokens = decode + len(args.prompts)
    print(f"[{config.variant}{'/' + config.mode if config.variant == 'vtoken' else ''}, "
          f"{config.policy if config.variant != 'native' else 'no eviction'}"
          f"{f', tp={config.tensor_parallel_size}' if config.tensor_parallel_size > 1 else ''}] {tokens} tokens in "
          f"{elapsed:.1f} s ({tokens / elapsed:.1f} tok/s); peak {peak} blocks of "
          f"{config.tokens_per_block} tokens; {evicted} tokens evicted, {freed} blocks reclaimed", file=sys.stderr)
    return 0
