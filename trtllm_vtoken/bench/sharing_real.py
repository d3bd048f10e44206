# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench sharing --real``: prefix caching and eviction together on the real model.

The paper's §6 experiment, scaled to SmolLM2-135M on a CPU: groups of ``degree`` requests share
a system prompt of ``prefix_tokens`` tokens (the paper: 8K), each request adds a private suffix
and decodes. Every request arrives at once; the engine's automatic prefix caching makes the
members of a group share the system prompt's blocks, which no policy may evict and no relocation
may touch. Rows, all with prefix caching on, from one pool and the same prompts:

    native + cache        full retention
    naive-evict + cache   the policy's dead tokens masked, only fully dead blocks freed
    vtoken dense + cache  dead slots refilled every step, tail blocks released
    vtoken lazy + cache   emptiest blocks compacted when one can be freed

Columns: prefix hit rate (prompt tokens found cached), retained blocks (blocks requests hold,
each shared block once, after the last decode step all requests take part in, and their mean
over the decode), decode throughput, KV utilization (live tokens, shared ones once, over slots
held), relocations with their invariant checks (I1/I2/I4 on every one) and plans that touched a
shared or cached block (must be 0). Text: slices of the Python standard library's sources
(present wherever Python is), fed as raw tokens.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from trtllm_vtoken.runtime.config import EngineConfig

ROWS = (("native", "dense"), ("naive-evict", "dense"), ("vtoken", "dense"), ("vtoken", "lazy"))


@dataclass(frozen=True)
class RealSharingConfig:
    requests: int = 8
    prefix_tokens: int = 1024
    suffix_tokens: int = 1024
    """The paper's workload has as many private tokens as shared ones (8K + 8K)."""
    decode_tokens: int = 32
    tokens_per_block: int = 16
    policy: str = "h2o"
    budget: str = "0.5"
    """Per request, of its tokens outside shared blocks (the protected shared prefix is kept on top)."""
    policy_options: dict[str, Any] = field(default_factory=lambda: {"recent_ratio": 0.1})
    degrees: tuple[int, ...] = (1, 2, 4, 8)
    check_invariants: bool = True
    seed: int = 0
    prefix_reuse: str = "copy"
    """``EngineConfig.prefix_reuse`` of the evicting rows: "copy" (each request's blocks its own,
    its output independent of the batch) or "share" (held in common, protected while shared)."""

    def __post_init__(self) -> None:
        if self.prefix_reuse not in ("copy", "share"):
            raise ValueError(f"prefix_reuse must be 'copy' or 'share', got {self.prefix_reuse!r}")
        if any(d <= 0 or self.requests % d for d in self.degrees):
            raise ValueError(f"every degree must divide requests ({self.requests}), got {self.degrees}")
        for name in ("prefix_tokens", "suffix_tokens", "decode_tokens", "tokens_per_block"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def engine_config(self, variant: str, mode: str) -> EngineConfig:
        length = self.prefix_tokens + self.suffix_tokens + self.decode_tokens
        blocks = self.requests * -(-length // self.tokens_per_block) + self.requests
        return EngineConfig(variant=variant, mode=mode, policy=self.policy, budget=self.budget,
                            policy_options=dict(self.policy_options), tokens_per_block=self.tokens_per_block,
                            num_blocks=blocks, max_batch_size=self.requests, max_seq_len=length + 1,
                            admission="greedy",  # the pool holds every request at full length
                            check_invariants=self.check_invariants, seed=self.seed, prefix_reuse=self.prefix_reuse)


def sharing_prompts(cfg: RealSharingConfig, degree: int, tokenizer) -> list[list[int]]:
    """``requests`` token lists: group g's members share system prompt g, each a private suffix.
    Prompts never share a first block across groups (distinct source files)."""
    from trtllm_vtoken.workloads.longdoc import stdlib_files

    need = cfg.prefix_tokens + cfg.suffix_tokens * cfg.requests
    texts = []
    for path in stdlib_files():
        try:
            ids = tokenizer.encode(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if len(ids) >= need:
            texts.append(ids)
        if len(texts) == cfg.requests:
            break
    if len(texts) < cfg.requests:
        raise ValueError(f"only {len(texts)} stdlib files have {need} tokens")
    prompts = []
    for r in range(cfg.requests):
        group, member = divmod(r, degree)
        system = texts[group][: cfg.prefix_tokens]
        start = cfg.prefix_tokens + member * cfg.suffix_tokens
        prompts.append(system + texts[group][start : start + cfg.suffix_tokens])
    return prompts


def run_one(cfg: RealSharingConfig, model, prompts: list[list[int]], variant: str, mode: str) -> dict[str, Any]:
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams

    engine = Engine(model, cfg.engine_config(variant, mode))
    kv, cache = engine.kv, engine.kv.prefix.cache
    touched_pinned = 0
    if kv.step is not None:  # every step: its moves and releases, and the plans it leaves in flight
        finish_step = kv.finish_step

        def checked_finish():
            nonlocal touched_pinned
            out = finish_step()
            if out is not None:
                touched = out.touched_blocks(cfg.tokens_per_block) | kv.step.relocating_blocks()
                touched_pinned += any(cache.is_shared(b) or cache.is_cached(b) for b in touched)
            return out

        kv.finish_step = checked_finish
    ids = [engine.add_request(p, SamplingParams(max_tokens=cfg.decode_tokens, ignore_eos=True)) for p in prompts]
    blocks, live, slots = [], [], []
    start = time.perf_counter()
    engine.step()  # every prefill (all requests fit at once)
    prefill_s = time.perf_counter() - start
    if len(engine.running) != len(ids):
        raise RuntimeError(f"only {len(engine.running)} of {len(ids)} requests were admitted at once")
    decode_start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        if len(engine.running) == len(ids):  # every request still decoding
            usage = kv.usage()
            blocks.append(usage.blocks_used)
            live.append(usage.live_tokens)
            slots.append(usage.slots_held)
    decode_s = time.perf_counter() - decode_start
    kv.check_integrity()
    requests = [engine.pop_finished(i) for i in ids]
    step = kv.step_stats if kv.config.variant == "vtoken" else None
    decoded = sum(len(r.output_ids) for r in requests) - len(requests)  # the first token is the prefill's
    return {
        "variant": variant, "mode": mode if variant == "vtoken" else "-",
        "prefix_hit_rate": cache.stats.hit_rate,
        "cached_prompt_tokens": engine.stats.cached_prompt_tokens, "prefill_tokens": engine.stats.prefill_tokens,
        "retained_blocks_end": blocks[-1], "retained_blocks_mean": float(np.mean(blocks)),
        "shared_blocks_end": len(cache.shared) if blocks else 0,
        "kv_utilization": float(np.sum(live) / max(np.sum(slots), 1)),
        "prefill_s": prefill_s, "decode_s": decode_s, "decode_tokens_per_s": decoded / decode_s,
        "tokens_evicted": kv.stats.tokens_evicted,
        "relocations": step.compactions if step else 0, "moves": step.moves if step else 0,
        "invariant_checks": step.invariant_checks if step else 0,
        "plans_touching_shared_or_cached": touched_pinned,
        "outputs": [r.output_ids for r in requests],
    }


def run_real_sharing_bench(cfg: RealSharingConfig, model, tokenizer, progress=None) -> dict[str, Any]:
    rows = []
    for degree in cfg.degrees:
        prompts = sharing_prompts(cfg, degree, tokenizer)
        for variant, mode in ROWS:
            row = run_one(cfg, model, prompts, variant, mode)
            row["degree"] = degree
            rows.append(row)
            if progress is not None:
                progress.update(1)
    for row in rows:
        naive = next(r for r in rows if r["degree"] == row["degree"] and r["variant"] == "naive-evict")
        row["fewer_blocks_than_naive_pct"] = 100.0 * (1 - row["retained_blocks_end"] / naive["retained_blocks_end"])
        evicting = row["variant"] != "native"
        row["same_outputs_as_naive_evict"] = row["outputs"] == naive["outputs"] if evicting else None
    for row in rows:
        del row["outputs"]
    return {"config": asdict(cfg), "rows": rows, "simulated": False}


def plot_real_sharing(result: dict[str, Any], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    degrees = sorted({r["degree"] for r in rows})
    labels = [v + ("" if m == "dense" and v != "vtoken" else f"/{m}") for v, m in ROWS]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(ROWS)
    for k, (variant, mode) in enumerate(ROWS):
        values = [next(r["retained_blocks_end"] for r in rows if r["degree"] == d and r["variant"] == variant
                       and r["mode"] in (mode, "-")) for d in degrees]
        ax.bar([i + (k - (len(ROWS) - 1) / 2) * width for i in range(len(degrees))], values, width,
               label=labels[k] + " + cache")
    ax.set_xticks(range(len(degrees)), [str(d) for d in degrees])
    c = result["config"]
    ax.set(xlabel="sharing degree", ylabel="retained blocks",
           title=f"Prefix caching + {c['policy']} {c['budget']}: {c['prefix_tokens']}-token shared prompt, "
                 f"{c['suffix_tokens']}-token suffixes (SmolLM2-135M)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
