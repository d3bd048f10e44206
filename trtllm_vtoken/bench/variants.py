# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench variants``: native, naive-evict and vToken on the real model, one workload,
one KV block budget, side by side.

Every variant serves the same requests (all arriving at once) from a pool of ``num_blocks``
blocks; the engine admits what fits and batches continuously. Per variant it reports throughput,
latency, blocks held (peak and time average), KV utilization (live tokens over slots in allocated
blocks), the most requests it ran at once, reclamation work, invariant checks, and for the
evicting variants whether vToken's greedy outputs equal naive-evict's token for token.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from trtllm_vtoken.config_base import require_positive
from trtllm_vtoken.runtime.config import EngineConfig

VARIANT_RUNS = (("native", "dense"), ("naive-evict", "dense"), ("vtoken", "dense"), ("vtoken", "lazy"))


@dataclass(frozen=True)
class VariantsBenchConfig:
    workload: str = "sharegpt"
    requests: int = 32
    max_prompt_tokens: int = 512
    max_output_tokens: int = 128
    policy: str = "h2o"
    budget: str = "0.5"
    tokens_per_block: int = 16
    num_blocks: int = 160
    max_batch_size: int = 32
    check_invariants: bool = True
    prefix_caching: bool = True
    """The engine's prefix caching (its default). A token of a block that another running request
    holds is kept on top of the budget, so with it the evictions follow the schedule."""
    kv_cache_dtype: str = "auto"
    """The KV pool's dtype: "auto" (the model's, float32) or "fp8" (``EngineConfig.kv_cache_dtype``)."""
    seed: int = 0

    def __post_init__(self) -> None:
        require_positive(self, "requests", "max_prompt_tokens", "max_output_tokens", "num_blocks")

    def engine_config(self, variant: str, mode: str) -> EngineConfig:
        return EngineConfig(
            variant=variant, mode=mode, policy=self.policy, budget=self.budget,
            tokens_per_block=self.tokens_per_block, num_blocks=self.num_blocks,
            max_batch_size=self.max_batch_size,
            max_seq_len=self.max_prompt_tokens + self.max_output_tokens + 64,  # + chat template
            check_invariants=self.check_invariants, prefix_caching=self.prefix_caching, seed=self.seed,
            kv_cache_dtype=self.kv_cache_dtype,
        )


def run_variants_bench(cfg: VariantsBenchConfig, model, tokenizer, progress=None) -> dict[str, Any]:
    """Runs every variant; ``progress`` (a tqdm-like bar) advances once per finished request."""
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.workloads import make_workload

    items = make_workload(cfg.workload, cfg.requests, tokenizer, seed=cfg.seed,
                          max_prompt_tokens=cfg.max_prompt_tokens, max_output_tokens=cfg.max_output_tokens)
    prompts = [tokenizer.encode(item.prompt, chat=True) for item in items]
    runs, outputs = [], {}
    for variant, mode in VARIANT_RUNS:
        engine = Engine(model, cfg.engine_config(variant, mode), tokenizer)
        result, outputs[(variant, mode)] = serve_workload(engine, prompts, items, progress)
        runs.append(result)
    reference = outputs[("naive-evict", "dense")]
    for run, key in zip(runs, VARIANT_RUNS):
        if key[0] == "vtoken":
            same = [a == b for a, b in zip(reference, outputs[key])]
            run["exact_match_vs_naive_evict"] = sum(same) / len(same)
    return {"config": asdict(cfg), "prompt_tokens": [len(p) for p in prompts], "runs": runs}


def serve_workload(engine, prompts, items, progress) -> tuple[dict[str, Any], list[list[int]]]:
    """Serves every prompt (all arriving at once, EOS ignored) and measures the run; returns the
    measurements and each request's output ids."""
    from trtllm_vtoken.runtime.sampling import SamplingParams

    ids = [engine.add_request(p, SamplingParams(max_tokens=item.max_tokens, ignore_eos=True))
           for p, item in zip(prompts, items)]
    blocks, live, running, finished_at = [], [], [], {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished_at[out.req_id] = time.perf_counter() - start
                if progress is not None:
                    progress.update(1)
        usage = engine.kv.usage()
        blocks.append(usage.blocks_used)
        live.append(usage.live_tokens)
        running.append(len(engine.running))
    wall = time.perf_counter() - start
    engine.kv.check_integrity()
    if engine.kv.num_available != engine.kv.pool.num_blocks:  # free, or cached and free-able
        raise RuntimeError(f"{engine.kv.pool.num_blocks - engine.kv.num_available} blocks still held after every "
                           f"request finished")
    requests = [engine.pop_finished(i) for i in ids]
    cfg, kv, stats = engine.config, engine.kv, engine.stats
    step = kv.step_stats
    tokens = sum(len(r.output_ids) for r in requests)
    latency = np.array([finished_at[i] for i in ids])
    slots = np.array(blocks) * cfg.tokens_per_block
    result = {
        "variant": cfg.variant, "mode": cfg.mode if cfg.variant == "vtoken" else "-",
        "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
        "latency_p50_s": float(np.percentile(latency, 50)), "latency_p95_s": float(np.percentile(latency, 95)),
        "steps": stats.steps, "peak_blocks": kv.stats.peak_blocks_used,
        "peak_kv_bytes": kv.stats.peak_blocks_used * (kv.cache.bytes_per_block if kv.cache is not None else 0),
        "mean_blocks": float(np.mean(blocks)),
        "kv_utilization": float(np.sum(live) / max(np.sum(slots), 1)),
        "max_running": max(running), "mean_running": float(np.mean(running)),
        "preemptions": stats.preemptions, "tokens_evicted": step.tokens_evicted,
        "blocks_reclaimed": step.blocks_freed,
        "relocations": step.compactions if cfg.variant == "vtoken" else 0, "moves": step.moves,
        "bytes_copied": step.bytes_copied, "invariant_checks": step.invariant_checks,
        "host_seconds": {"forward": stats.forward_seconds, "lists": kv.stats.lists_seconds,
                         "mask": kv.stats.mask_seconds, **step.seconds},
        "blocks_per_step": blocks,
    }
    return result, [r.output_ids for r in requests]


def plot_variants(result: dict[str, Any], path) -> None:
    """Blocks held per step for each variant, and utilization / throughput bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = [r["variant"] + ("" if r["mode"] == "-" else f"/{r['mode']}") for r in runs]
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(15, 4))
    for label, run in zip(labels, runs):
        ax0.plot(run["blocks_per_step"], label=label)
    ax0.axhline(result["config"]["num_blocks"], color="gray", linestyle=":", label="pool")
    ax0.set(xlabel="engine step", ylabel="KV blocks held", title="Blocks held")
    ax0.legend()
    ax1.bar(labels, [100 * r["kv_utilization"] for r in runs], color="tab:green")
    ax1.set(ylabel="%", title="KV utilization (live tokens / slots held)")
    ax2.bar(labels, [r["tokens_per_s"] for r in runs], color="tab:blue")
    ax2.set(ylabel="output tokens / s", title="Throughput")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=20)
    c = result["config"]
    fig.suptitle(f"{c['workload']}, {c['requests']} requests, {c['policy']} budget {c['budget']}, "
                 f"{c['num_blocks']} blocks x {c['tokens_per_block']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
