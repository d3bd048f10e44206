# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench sweeps``: vToken's knobs one at a time on the real model (issue 4, experiment 5).

Every point serves the same requests (all arriving at once, a pool large enough that admission
never waits, so what is measured is retention, not queueing) and reports blocks held (mean over
steps and peak), KV utilization, relocations, tokens copied and throughput:

    tokens_per_block   16 / 32 / 48 / 64       vtoken dense vs naive-evict (H2O, budget 0.5)
    retention ratio    0.3 ... 0.7             vtoken dense vs naive-evict (H2O, tokens_per_block 16)
    threshold          1 / 2 / 4 / 8           vtoken lazy (blocks beyond ideal before compacting)
    mode               dense vs lazy           head to head at the defaults, invariant checks off:
                                               the throughput comparison (the checked runs of both
                                               modes at the defaults are the other sweeps' points)

Every other point checks I1/I2/I4 on every relocation; I1 hashes the KV bytes of every live
token before and after, so those points' throughput is not the modes' own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from trtllm_vtoken.runtime.config import EngineConfig


@dataclass(frozen=True)
class SweepsBenchConfig:
    workload: str = "sharegpt"
    requests: int = 8
    max_prompt_tokens: int = 256
    max_output_tokens: int = 48
    tokens_per_block: tuple[int, ...] = (16, 32, 48, 64)
    ratios: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7)
    thresholds: tuple[int, ...] = (1, 2, 4, 8)
    policy: str = "h2o"
    check_invariants: bool = True
    seed: int = 0
    defaults: dict[str, Any] = field(default_factory=lambda: {"tokens_per_block": 16, "budget": "0.5"})

    def engine_config(self, **overrides: Any) -> EngineConfig:
        values: dict[str, Any] = dict(self.defaults, policy=self.policy, check_invariants=self.check_invariants,
                                      seed=self.seed, max_batch_size=self.requests)
        values.update(overrides)
        seq_len = self.max_prompt_tokens + self.max_output_tokens + 64
        tpb = values["tokens_per_block"]
        values.setdefault("max_seq_len", seq_len)
        values.setdefault("num_blocks", self.requests * -(-seq_len // tpb) + 8)
        return EngineConfig(**values)

    def points(self) -> list[tuple[str, Any, dict[str, Any]]]:
        """(sweep, value, engine overrides) in run order."""
        out: list[tuple[str, Any, dict[str, Any]]] = []
        for tpb in self.tokens_per_block:
            for variant in ("naive-evict", "vtoken"):
                out.append(("tokens_per_block", tpb, dict(tokens_per_block=tpb, variant=variant)))
        for ratio in self.ratios:
            for variant in ("naive-evict", "vtoken"):
                out.append(("ratio", ratio, dict(budget=str(ratio), variant=variant)))
        for threshold in self.thresholds:
            out.append(("threshold", threshold, dict(variant="vtoken", mode="lazy", fragmentation_threshold=threshold)))
        for mode in ("dense", "lazy"):
            out.append(("mode", mode, dict(variant="vtoken", mode=mode, check_invariants=False)))
        return out


def run_sweeps_bench(cfg: SweepsBenchConfig, model, tokenizer, progress=None) -> dict[str, Any]:
    from trtllm_vtoken.bench.variants import serve_workload
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.workloads import make_workload

    items = make_workload(cfg.workload, cfg.requests, tokenizer, seed=cfg.seed,
                          max_prompt_tokens=cfg.max_prompt_tokens, max_output_tokens=cfg.max_output_tokens)
    prompts = [tokenizer.encode(item.prompt, chat=True) for item in items]
    points = []
    for sweep, value, overrides in cfg.points():
        result, _ = serve_workload(Engine(model, cfg.engine_config(**overrides), tokenizer), prompts, items, None)
        blocks = result.pop("blocks_per_step")
        result.update(sweep=sweep, value=value)
        result["tokens_per_block"] = overrides.get("tokens_per_block", cfg.defaults["tokens_per_block"])
        result["mean_slots"] = sum(blocks) / max(len(blocks), 1) * result["tokens_per_block"]
        points.append(result)
        if progress is not None:
            progress.update(1)
    # Retained KV relative to naive-evict at the same point (same evictions).
    for point in points:
        if point["variant"] == "vtoken" and point["sweep"] in ("tokens_per_block", "ratio"):
            naive = next(p for p in points if p["sweep"] == point["sweep"] and p["value"] == point["value"]
                         and p["variant"] == "naive-evict")
            point["fewer_slots_than_naive_pct"] = 100.0 * (1 - point["mean_slots"] / naive["mean_slots"])
    return {"config": asdict(cfg), "points": points}


def plot_sweeps(result: dict[str, Any], path) -> None:
    """Held KV slots per sweep value (naive-evict vs vtoken), and lazy copies vs threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, sweep, label in ((axes[0], "tokens_per_block", "tokens_per_block"), (axes[1], "ratio", "retention ratio")):
        for variant in ("naive-evict", "vtoken"):
            rows = [p for p in points if p["sweep"] == sweep and p["variant"] == variant]
            ax.plot([p["value"] for p in rows], [p["mean_slots"] for p in rows], marker="o", label=variant)
        ax.set(xlabel=label, ylabel="KV slots held (mean over steps)", title=f"Retention vs {label}")
        ax.legend()
    rows = [p for p in points if p["sweep"] == "threshold"]
    axes[2].plot([p["value"] for p in rows], [p["moves"] for p in rows], marker="o", label="tokens moved")
    axes[2].plot([p["value"] for p in rows], [p["mean_blocks"] for p in rows], marker="s", label="blocks held (mean)")
    axes[2].set(xlabel="fragmentation threshold", title="vtoken lazy")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
