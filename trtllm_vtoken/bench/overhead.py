# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench overhead``: what vToken's step costs when it frees nothing, and where a
reclaiming run spends its host time.

Runs on the real model, one workload, a pool large enough that admission never waits, repeated in
alternating order (the median is reported, with min and max):

    native                       plain block lists: no token table, no policy, no step
    native (again)               the same run once more: native's spread against itself, the
                                 smallest difference this benchmark can claim
    indirection-only             vtoken with sliding_window at budget 1.0: the step (token table,
                                 policy, planner) runs every iteration, nothing is evicted
    indirection-only + mass      the same with H2O at budget 1.0: the forward also returns the
                                 attention mass per position, which the policy observes
    vtoken dense (h2o 0.5)       a reclaiming run: its host time split into forward and the step's
                                 parts (table, policy, core, copy)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from trtllm_vtoken.config_base import require_positive
from trtllm_vtoken.runtime.config import EngineConfig

RUNS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("native", dict(variant="native")),
    ("native (again)", dict(variant="native")),
    ("indirection-only", dict(variant="vtoken", policy="sliding_window", budget="1.0")),
    ("indirection-only + mass", dict(variant="vtoken", policy="h2o", budget="1.0")),
    ("vtoken dense (h2o 0.5)", dict(variant="vtoken", policy="h2o", budget="0.5")),
)


@dataclass(frozen=True)
class OverheadBenchConfig:
    workload: str = "sharegpt"
    requests: int = 16
    max_prompt_tokens: int = 256
    max_output_tokens: int = 64
    tokens_per_block: int = 16
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        require_positive(self, "requests", "max_prompt_tokens", "max_output_tokens", "tokens_per_block",
                         "repeats")

    def engine_config(self, **overrides: Any) -> EngineConfig:
        seq_len = self.max_prompt_tokens + self.max_output_tokens + 64  # + chat template
        per_request = -(-seq_len // self.tokens_per_block)
        values: dict[str, Any] = dict(tokens_per_block=self.tokens_per_block, num_blocks=self.requests * per_request + 8,
                                      max_batch_size=self.requests, max_seq_len=seq_len, seed=self.seed)
        values.update(overrides)
        return EngineConfig(**values)


def run_overhead_bench(cfg: OverheadBenchConfig, model, tokenizer, progress=None) -> dict[str, Any]:
    from trtllm_vtoken.bench.repeats import run_alternating
    from trtllm_vtoken.bench.variants import serve_workload
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.workloads import make_workload

    items = make_workload(cfg.workload, cfg.requests, tokenizer, seed=cfg.seed,
                          max_prompt_tokens=cfg.max_prompt_tokens, max_output_tokens=cfg.max_output_tokens)
    prompts = [tokenizer.encode(item.prompt, chat=True) for item in items]

    def run(label: str, overrides: dict[str, Any]) -> dict[str, Any]:
        result, _ = serve_workload(Engine(model, cfg.engine_config(**overrides), tokenizer), prompts, items, None)
        result.pop("blocks_per_step")
        return result

    runs = run_alternating(RUNS, cfg.repeats, run, progress)
    native = runs[0]["tokens_per_s"]
    natives = [r for r in runs if r["variant"] == "native"]
    # Native against itself: every native run's distance from the reference, in percent.
    spread = max(abs(100.0 * (1.0 - r[key] / native)) for r in natives for key in ("tokens_per_s_min", "tokens_per_s_max"))
    for row in runs:
        row["throughput_vs_native"] = row["tokens_per_s"] / native
        row["overhead_pct"] = 100.0 * (1.0 - row["throughput_vs_native"])
        row["beyond_native_spread"] = abs(row["overhead_pct"]) > spread
    return {"config": asdict(cfg), "native_spread_pct": spread, "runs": runs}


def plot_overhead(result: dict[str, Any], path) -> None:
    """Throughput relative to native, and the reclaiming run's host-time split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4))
    ax0.bar([r["label"] for r in runs], [r["throughput_vs_native"] for r in runs], color="tab:blue")
    ax0.axhline(1.0, color="gray", linestyle=":")
    ax0.set(ylabel="throughput / native", title="Hook overhead (median of repeats)")
    ax0.tick_params(axis="x", rotation=15)
    split = runs[-1]["host_seconds"]
    ax1.pie(list(split.values()), labels=list(split), autopct="%1.1f%%")
    ax1.set(title=f"Host time of {runs[-1]['label']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
