# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench capacity``: how many concurrent requests fit a fixed KV block budget (simulated).

For each setting and variant, the largest C such that C identical requests (prompt + output
tokens, H2O at a 0.5 retention ratio) all run at once, start to finish, without the pool running
dry. The engine runs with greedy admission (everything whose prompt fits is admitted) and the
simulated-attention backend, so every block the variant holds is counted exactly; a run is
infeasible as soon as a request waits at the start or is preempted.

Paper settings (block counts from the paper; prompt lengths inferred from its full-request sizes,
tokens_per_block 16): Llama-3.1-8B, 12,288 output tokens, 4,032-token prompt (1,020 blocks per
full request), pools of 5,427 and 11,519 blocks; Qwen2.5-14B, 8,192 output tokens, 8,000-token
prompt, 3,261 blocks. ``scale`` divides lengths and pools alike, for quick runs. FP8 KV: the
first setting's bytes hold twice its bf16 blocks (``CapacitySetting.with_fp8_kv``), so vToken and
FP8 KV combine: each alone, and both.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class CapacitySetting:
    name: str
    model: str
    num_blocks: int
    prompt_len: int
    output_len: int
    paper: tuple[int, int, int] | None
    """The paper's largest feasible C for native, naive-evict, vtoken (None: not in the paper)."""
    tokens_per_block: int = 16
    kv_cache_dtype: str = "bf16"
    """The KV dtype the block count is for: the paper's bf16, or "fp8" (``with_fp8_kv``)."""

    def with_fp8_kv(self) -> CapacitySetting:
        """The same KV bytes as FP8 (one byte a value against bf16's two): twice the blocks."""
        return replace(self, name=f"{self.name} as FP8 KV", num_blocks=2 * self.num_blocks, paper=None,
                       kv_cache_dtype="fp8")

    def scaled(self, factor: int) -> CapacitySetting:
        if factor == 1:
            return self
        return replace(self, name=f"{self.name} (1/{factor} scale)", num_blocks=self.num_blocks // factor,
                       prompt_len=self.prompt_len // factor, output_len=self.output_len // factor)

    def full_request_blocks(self) -> int:
        return -(-(self.prompt_len + self.output_len) // self.tokens_per_block)


PAPER_SETTINGS = (
    CapacitySetting("llama-3.1-8b, 5,427 blocks", "llama-3.1-8b", 5427, 4032, 12288, (5, 5, 8)),
    CapacitySetting("llama-3.1-8b, 11,519 blocks", "llama-3.1-8b", 11519, 4032, 12288, (11, 11, 22)),
    CapacitySetting("qwen2.5-14b, 3,261 blocks", "qwen2.5-14b", 3261, 8000, 8192, (3, 3, 6)),
)
VARIANTS = ("native", "naive-evict", "vtoken")


def run_once(setting: CapacitySetting, variant: str, concurrency: int, budget: float = 0.5,
             seed: int = 0) -> dict[str, Any]:
    """Serves ``concurrency`` identical requests; feasible iff all ran at once without preemption."""
    from trtllm_vtoken.runtime.config import EngineConfig
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams
    from trtllm_vtoken.runtime.simulated import MODEL_SHAPES, SimulatedModel, SyntheticAttention

    config = EngineConfig(
        variant=variant, mode="dense", policy="h2o", budget=budget, tokens_per_block=setting.tokens_per_block,
        num_blocks=setting.num_blocks, max_batch_size=concurrency,
        max_seq_len=setting.prompt_len + setting.output_len, admission="greedy", seed=seed,
        prefix_caching=False)  # the placeholder prompts are identical: they must not share blocks
    engine = Engine(SimulatedModel(MODEL_SHAPES[setting.model], SyntheticAttention(seed)), config)
    for _ in range(concurrency):
        engine.add_request([1] * setting.prompt_len, SamplingParams(max_tokens=setting.output_len, ignore_eos=True))
    start, feasible, steps = time.perf_counter(), True, 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if engine.stats.preemptions or (steps == 1 and engine.waiting):
            feasible = False
            break
    stats = engine.kv.step_stats
    return {"variant": variant, "concurrency": concurrency, "feasible": feasible, "steps": steps,
            "peak_blocks": engine.kv.stats.peak_blocks_used, "wall_s": time.perf_counter() - start,
            "bytes_copied": stats.bytes_copied, "relocations": stats.compactions if variant == "vtoken" else 0}


def analytic_bound(setting: CapacitySetting, variant: str, budget: float) -> int:
    """Where the search starts: full requests for native/naive-evict, packed ones for vtoken."""
    if variant != "vtoken":
        return max(1, setting.num_blocks // setting.full_request_blocks())
    live = int(budget * (setting.prompt_len + setting.output_len)) + 1
    return max(1, setting.num_blocks // -(-live // setting.tokens_per_block))


def frontier(setting: CapacitySetting, variant: str, budget: float = 0.5, seed: int = 0,
             on_run=None) -> dict[str, Any]:
    """Largest feasible C, searched from the analytic bound (runs at C and C + 1 suffice when
    the bound is right)."""
    runs = []

    def probe(c: int) -> bool:
        result = run_once(setting, variant, c, budget, seed)
        runs.append(result)
        if on_run is not None:
            on_run(result)
        return result["feasible"]

    c = analytic_bound(setting, variant, budget)
    if probe(c):
        while probe(c + 1):
            c += 1
    else:
        while c > 1 and not probe(c - 1):
            c -= 1
        c = c - 1 if runs[-1]["feasible"] else 0
    return {"variant": variant, "max_concurrency": c, "runs": runs}


def run_capacity_bench(settings, budget: float = 0.5, seed: int = 0, progress=None) -> dict[str, Any]:
    results = []
    for setting in settings:
        row = {"setting": asdict(setting), "full_request_blocks": setting.full_request_blocks(),
               "packed_bound": analytic_bound(setting, "vtoken", budget), "variants": {}}
        for variant in VARIANTS:
            if progress is not None:
                progress.set_postfix_str(f"{setting.name}: {variant}")
            row["variants"][variant] = frontier(setting, variant, budget, seed,
                                                on_run=(lambda r: progress.update(1)) if progress is not None else None)
        results.append(row)
    return {"label": "simulated", "budget": budget, "policy": "h2o", "results": results}


def plot_capacity(result: dict[str, Any], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = result["results"]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, variant in enumerate(VARIANTS):
        ours = [r["variants"][variant]["max_concurrency"] for r in rows]
        ax.bar(x + (i - 1) * 0.27, ours, 0.27, label=f"{variant} (simulated)")
        papers = [(j, r["setting"]["paper"][i]) for j, r in enumerate(rows) if r["setting"]["paper"]]
        ax.scatter([x[j] + (i - 1) * 0.27 for j, _ in papers], [c for _, c in papers], marker="_", s=400,
                   color="black", label="paper" if i == 0 else None, zorder=3)
    ax.set_xticks(x, [r["setting"]["name"] for r in rows], fontsize=8)
    ax.set_ylabel("max concurrent requests")
    ax.set_title("Capacity frontier, H2O at 0.5 retention (simulated-attention backend)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
