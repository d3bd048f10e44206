# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench long``: prompts longer than the KV budget, prefilled in chunks with eviction
between them (``EngineConfig.enable_chunked_prefill``), on the real model.

    one document   one long document (standard-library sources) at each budget, chunks of
                   ``chunk`` tokens: peak blocks the request held, time to first token, decode
                   tokens/s; native, naive-evict and vtoken dense under the same chunks, and
                   whether vtoken's decisions and tokens equal naive-evict's. Every row runs
                   ``repeats`` times in alternating order (``bench/repeats.py``): the median run
                   by time to first token, with the range of both timings
    longest        the longest prompt each variant's admission takes in a pool of
                   ``pool_blocks`` blocks at the smallest budget; that prompt is then served in
                   that pool to show it completes
    batch          ``batch_prompts`` long prompts sent at once to that pool: how many ran at
                   once, preemptions, time to the last token

Native and naive-evict hold every token they computed (naive-evict masks evicted ones in place),
so their peak is the whole prompt; vtoken's is the budget and one chunk (and a block).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from trtllm_vtoken.config_base import require_positive

VARIANTS = ("native", "naive-evict", "vtoken")
TASK = "Summarize what the following Python source does.\n\n"


@dataclass(frozen=True)
class LongBenchConfig:
    prompt_tokens: int = 4096
    budgets: tuple[int, ...] = (256, 512, 1024)
    chunk: int = 256
    max_output_tokens: int = 32
    tokens_per_block: int = 16
    policy: str = "h2o"
    pool_blocks: int = 96
    batch_prompts: int = 6
    batch_prompt_tokens: int = 1024
    max_seq_len: int = 8192
    check_invariants: bool = False
    """I1/I2/I4 after every relocation: they read the KV, which would dominate the timings."""
    repeats: int = 3
    """Runs of each one-document row, alternating."""

    def __post_init__(self) -> None:
        require_positive(self, "prompt_tokens", "chunk", "max_output_tokens", "tokens_per_block", "pool_blocks",
                         "batch_prompts", "batch_prompt_tokens", "max_seq_len", "repeats")
        if not self.budgets or min(self.budgets) < 1:
            raise ValueError(f"budgets must be positive token counts, got {self.budgets}")
        if self.chunk % self.tokens_per_block:
            raise ValueError(f"chunk ({self.chunk}) must be whole blocks of {self.tokens_per_block} tokens")

    def engine_config(self, variant: str, budget: int, num_blocks: int, max_batch_size: int = 1):
        from trtllm_vtoken.runtime.config import EngineConfig

        return EngineConfig(variant=variant, policy=self.policy, budget=budget, tokens_per_block=self.tokens_per_block,
                            num_blocks=num_blocks, max_batch_size=max_batch_size, max_seq_len=self.max_seq_len,
                            enable_chunked_prefill=True, max_num_tokens=self.chunk + max_batch_size,
                            prefix_caching=False, check_invariants=self.check_invariants)


def documents(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """``count`` prompts of exactly ``tokens`` tokens: a task, then standard-library sources."""
    from trtllm_vtoken.workloads.longdoc import stdlib_files

    task = tokenizer.encode(TASK)
    prompts, source = [], iter(stdlib_files())
    while len(prompts) < count:
        ids = list(task)
        while len(ids) < tokens:
            path = next(source, None)
            if path is None:
                raise ValueError(f"the standard library holds fewer than {count} documents of {tokens} tokens")
            try:
                ids += tokenizer.encode(path.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
        prompts.append(ids[:tokens])
    return prompts


def serve(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """All prompts at once (EOS ignored); the run's measurements and each request's trace."""
    from trtllm_vtoken.runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    start, running = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        running = max(running, len(engine.running))
    wall = time.perf_counter() - start
    engine.kv.check_integrity()
    requests = [engine.pop_finished(i) for i in ids]
    first = [r.first_token_time - start for r in requests]
    decoded = sum(len(r.output_ids) - 1 for r in requests)
    return {"wall_s": wall, "peak_blocks": engine.kv.stats.peak_blocks_used, "ttft_s": max(first),
            "decode_tokens_per_s": decoded / max(wall - min(first), 1e-9), "most_running": running,
            "preemptions": engine.stats.preemptions, "tokens_evicted": engine.kv.step_stats.tokens_evicted,
            "outputs": [r.output_ids for r in requests], "evictions": [r.evictions for r in requests]}


def longest_admitted(cfg: LongBenchConfig, model, variant: str, budget: int) -> int:
    """The longest prompt admission takes alone in the fixed pool (its check, binary search)."""
    from trtllm_vtoken.runtime.engine import Engine

    engine = Engine(model, cfg.engine_config(variant, budget, cfg.pool_blocks))
    spec = engine.kv.resolve(None)
    low, high = 0, cfg.max_seq_len - cfg.max_output_tokens
    while low < high:
        mid = (low + high + 1) // 2
        try:
            engine.kv.check_fits_alone(mid, cfg.max_output_tokens, spec)
            low = mid
        except ValueError:
            high = mid - 1
    return low


def run_long_bench(cfg: LongBenchConfig, model, tokenizer, progress=None) -> dict[str, Any]:
    from trtllm_vtoken.bench.repeats import run_alternating
    from trtllm_vtoken.runtime.engine import Engine

    def tick() -> None:
        if progress is not None:
            progress.update(1)

    document = documents(tokenizer, 1, cfg.prompt_tokens)
    roomy = -(-(cfg.prompt_tokens + cfg.max_output_tokens) // cfg.tokens_per_block) + 2

    def one(label: str, point: tuple[str, int]) -> dict[str, Any]:
        variant, budget = point
        return serve(Engine(model, cfg.engine_config(variant, budget, roomy)), document, cfg.max_output_tokens)

    points = [("native", ("native", cfg.budgets[0]))] + \
        [(f"{variant} {budget}", (variant, budget)) for budget in cfg.budgets for variant in VARIANTS[1:]]
    measured = dict(zip([label for label, _ in points],
                        run_alternating(points, cfg.repeats, one, progress, key="ttft_s",
                                        spread=("decode_tokens_per_s",))))
    single = []
    for budget in cfg.budgets:
        runs = {"native": measured["native"], **{v: measured[f"{v} {budget}"] for v in VARIANTS[1:]}}
        same = runs["vtoken"]["outputs"] == runs["naive-evict"]["outputs"] and \
            runs["vtoken"]["evictions"] == runs["naive-evict"]["evictions"]
        bound = -(-(budget + cfg.chunk) // cfg.tokens_per_block) + 1
        single.append({"budget": budget, "peak_bound_blocks": bound, "vtoken_equals_naive_evict": same,
                       "runs": {v: {k: r[k] for k in r if k not in ("outputs", "evictions")} for v, r in runs.items()}})
    budget = cfg.budgets[0]
    longest = {}
    for variant in VARIANTS:
        tokens = longest_admitted(cfg, model, variant, budget)
        run = serve(Engine(model, cfg.engine_config(variant, budget, cfg.pool_blocks)),
                    documents(tokenizer, 1, tokens), cfg.max_output_tokens) if tokens else None
        longest[variant] = {"prompt_tokens": tokens,
                            "served": None if run is None else {k: run[k] for k in ("wall_s", "peak_blocks")}}
        tick()
    batch_prompts = documents(tokenizer, cfg.batch_prompts, cfg.batch_prompt_tokens)
    batch = {}
    for variant in VARIANTS:
        run = serve(Engine(model, cfg.engine_config(variant, budget, cfg.pool_blocks, cfg.batch_prompts)),
                    batch_prompts, cfg.max_output_tokens)
        batch[variant] = {k: run[k] for k in ("wall_s", "peak_blocks", "most_running", "preemptions", "ttft_s")}
        tick()
    return {"config": asdict(cfg), "single": single, "longest": longest, "batch": batch}


def steps(cfg: LongBenchConfig) -> int:
    """Progress units of ``run_long_bench``."""
    return cfg.repeats * (1 + 2 * len(cfg.budgets)) + 2 * len(VARIANTS)


def plot_long(result: dict[str, Any], path) -> None:
    """Peak blocks of the one document per budget, per variant, with vtoken's bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["single"]
    budgets = [r["budget"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant, color in zip(VARIANTS, ("tab:blue", "tab:orange", "tab:green")):
        ax.plot(budgets, [r["runs"][variant]["peak_blocks"] for r in rows], "o-", color=color, label=variant)
    ax.plot(budgets, [r["peak_bound_blocks"] for r in rows], "k--", label="budget + chunk + 1 block")
    ax.set_xlabel("budget (tokens)")
    ax.set_ylabel("peak KV blocks of the request")
    ax.set_title(f"{result['config']['prompt_tokens']}-token prompt, chunks of {result['config']['chunk']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
