# SPDX-License-Identifier: Apache-2.0
"""Throughput of the reference engine with and without its overlap scheduler, on the real model.

    rows       native, naive-evict and vtoken (H2O, dense), each with the overlap scheduler
               (the step of iteration N beside forward N+1, but where it may evict: before it)
               and without (each iteration's step before the next forward, its native call
               beside sampling); vtoken under overlap with its prompt decision, or its decode
               decisions, lagged (beside the next forward: one iteration late)
    one run    a fresh engine serves the same ShareGPT batch to the end (greedy, EOS ignored)
    repeats    in alternating order (``bench/repeats.py``): median and range per row

Reported per row: generated tokens/s end to end, and where the engine's thread spent the run:
in forwards (logits and mass copied to the host included), in the step on this thread (its
checks, decision, registration and copy; the native call too where it ran here), waiting for a
native call that ran on the step's worker, and the rest (scheduling, sampling, outputs).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from trtllm_vtoken.config_base import require_positive

VARIANTS = ("native", "naive-evict", "vtoken")


@dataclass(frozen=True)
class OverlapBenchConfig:
    requests: int = 16
    """Requests in the batch (all admitted at once: ``max_batch_size``)."""
    max_prompt_tokens: int = 256
    new_tokens: int = 64
    budget: float = 0.5
    """H2O's retention ratio (naive-evict and vtoken)."""
    tokens_per_block: int = 16
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        require_positive(self, "requests", "max_prompt_tokens", "new_tokens", "tokens_per_block", "repeats")
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"budget must lie in (0, 1], got {self.budget}")

    def rows(self) -> list[tuple[str, tuple[str, bool, str, str]]]:
        """(label, (variant, overlap scheduler, prefill_decision, decode_decision)): every variant
        in both orders, and vtoken's H2O decisions lagged beside the next forward: the prompt's, or
        the decode steps'."""
        rows = [(f"{variant}{' overlap' if overlap else ''}", (variant, overlap, "at_once", "at_once"))
                for variant in VARIANTS for overlap in (False, True)]
        return rows + [("vtoken overlap, prefill lagged", ("vtoken", True, "lagged", "at_once")),
                       ("vtoken overlap, decode lagged", ("vtoken", True, "at_once", "lagged"))]


def serve_once(model: Any, tokenizer: Any, prompts: list[list[int]], cfg: OverlapBenchConfig, variant: str,
               overlap: bool, prefill_decision: str = "at_once", decode_decision: str = "at_once") -> dict[str, Any]:
    """One fresh engine serves ``prompts`` to the end; its speed and its thread's time split."""
    from trtllm_vtoken.runtime.config import EngineConfig
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams

    tpb = cfg.tokens_per_block
    per_request = -(-(cfg.max_prompt_tokens + cfg.new_tokens) // tpb) + 1
    engine = Engine(model, EngineConfig(variant=variant, policy="h2o", budget=cfg.budget, tokens_per_block=tpb,
                                        num_blocks=per_request * len(prompts), max_batch_size=len(prompts),
                                        max_seq_len=cfg.max_prompt_tokens + cfg.new_tokens + tpb,
                                        overlap_scheduler=overlap, prefill_decision=prefill_decision,
                                        decode_decision=decode_decision,
                                        prefix_caching=False), tokenizer)
    params = SamplingParams(max_tokens=cfg.new_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - start
    generated = sum(len(engine.pop_finished(i).output_ids) for i in ids)
    forward = engine.stats.forward_seconds
    step = engine.kv.step_stats if engine.kv.step is not None else None
    beside = step is not None and step.overlapped_steps > 0
    step_here = 0.0 if step is None else sum(v for k, v in step.seconds.items() if not (beside and k == "core"))
    waited = 0.0 if step is None else step.waited_seconds
    return {"tokens_per_s": generated / wall, "wall_s": wall, "generated": generated, "forward_s": forward,
            "step_here_s": step_here, "waited_s": waited, "other_s": wall - forward - step_here - waited,
            "tokens_evicted": 0 if step is None else step.tokens_evicted,
            "peak_blocks": engine.kv.stats.peak_blocks_used}


def run_overlap_bench(cfg: OverlapBenchConfig, model: Any, tokenizer: Any, progress=None) -> dict[str, Any]:
    from trtllm_vtoken.bench.repeats import run_alternating
    from trtllm_vtoken.workloads import make_workload

    items = make_workload("sharegpt", cfg.requests, tokenizer, seed=cfg.seed, max_prompt_tokens=cfg.max_prompt_tokens)
    prompts = [tokenizer.encode(item.prompt, chat=True)[: cfg.max_prompt_tokens] for item in items]
    serve_once(model, tokenizer, prompts[:2], cfg, "native", True)  # warm-up: weights, allocator, threads
    rows = run_alternating(cfg.rows(), cfg.repeats,
                           lambda label, spec: serve_once(model, tokenizer, prompts, cfg, *spec), progress,
                           spread=("forward_s", "step_here_s", "waited_s"))
    for row in rows:
        variant, overlap, prefill_decision, decode_decision = dict(cfg.rows())[row["label"]]
        row.update(variant=variant, overlap=overlap, prefill_decision=prefill_decision,
                   decode_decision=decode_decision)
    return {"config": asdict(cfg), "prompt_tokens": [len(p) for p in prompts], "rows": rows}
