# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench sla``: throughput under a latency SLA, closed loop, real model (issue 4,
experiment 3).

At each concurrency C, C clients each keep one request in flight (a new one as soon as the last
finished) from one fixed KV block budget, until ``requests_per_client * C`` requests completed.
Latency is submit-to-finish (queueing for blocks included); throughput is output tokens over
wall time. Then, from the same run, as the paper defines them:

    C_ref   a reference concurrency of the scan (``c_ref``, the paper's 8)
    SLA     1.05 x naive-evict's p95 latency at C_ref
    C_sel   per variant, the level with the highest throughput among those whose p95 latency
            meets the SLA (not necessarily the largest C that meets it)

and reports throughput and p95 at C_sel for naive-evict and vtoken, and their ratio. The summary
also says whether the budget binds at all (some level where naive-evict's requests wait for
blocks or are preempted); when it never does, C_sel compares speed at equal concurrency, not
capacity.

Every (variant, C) point runs ``repeats`` times in alternating order (``bench/repeats.py``): the
run with the median p95 is the point's, and its throughput and p95 carry the range over the
runs. The ratio carries its range (vtoken's slowest over naive-evict's fastest, and the reverse),
and the verdict says "higher" or "lower" only when the ranges do not overlap, "within the
spread" otherwise.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from trtllm_vtoken.runtime.config import EngineConfig

VARIANTS = ("naive-evict", "vtoken")


@dataclass(frozen=True)
class SlaBenchConfig:
    workload: str = "sharegpt"
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 12, 16)
    requests_per_client: int = 3
    max_prompt_tokens: int = 256
    max_output_tokens: int = 48
    num_blocks: int = 96
    tokens_per_block: int = 16
    policy: str = "h2o"
    budget: str = "0.5"
    sla_factor: float = 1.05
    c_ref: int = 8
    seed: int = 0
    repeats: int = 3

    def __post_init__(self) -> None:
        if self.repeats <= 0:
            raise ValueError(f"repeats must be positive, got {self.repeats}")
        if not self.concurrency or min(self.concurrency) <= 0 or list(self.concurrency) != sorted(self.concurrency):
            raise ValueError(f"concurrency must be ascending positive levels, got {self.concurrency}")
        if self.sla_factor < 1.0:
            raise ValueError(f"sla_factor must be >= 1, got {self.sla_factor}")
        if self.c_ref not in self.concurrency:
            raise ValueError(f"c_ref ({self.c_ref}) must be one of the concurrency levels {self.concurrency}")

    def engine_config(self, variant: str) -> EngineConfig:
        return EngineConfig(variant=variant, policy=self.policy, budget=self.budget,
                            tokens_per_block=self.tokens_per_block, num_blocks=self.num_blocks,
                            max_batch_size=max(self.concurrency),
                            max_seq_len=self.max_prompt_tokens + self.max_output_tokens + 64, seed=self.seed)


def closed_loop(engine, prompts: list[list[int]], max_tokens: list[int], clients: int, total: int) -> dict[str, Any]:
    """Keeps ``clients`` requests in flight until ``total`` finished; measures each one."""
    from trtllm_vtoken.runtime.sampling import SamplingParams

    submitted_at: dict[int, float] = {}
    latencies: list[float] = []
    tokens, max_running, submitted, waited_steps = 0, 0, 0, 0
    started = time.perf_counter()

    def submit() -> None:
        nonlocal submitted
        i = submitted % len(prompts)
        req = engine.add_request(prompts[i], SamplingParams(max_tokens=max_tokens[i], ignore_eos=True))
        submitted_at[req] = time.perf_counter()
        submitted += 1

    for _ in range(min(clients, total)):
        submit()
    while engine.has_unfinished():
        outputs = engine.step()
        # Still waiting after the step's admission (the batch has room for every client): a
        # request waited for blocks.
        waited_steps += bool(engine.waiting)
        for out in outputs:
            if out.finished:
                latencies.append(time.perf_counter() - submitted_at.pop(out.req_id))
                tokens += len(engine.pop_finished(out.req_id).output_ids)
                if submitted < total:
                    submit()
        max_running = max(max_running, len(engine.running))
    wall = time.perf_counter() - started
    return {"clients": clients, "requests": total, "output_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "latency_p50_s": float(np.percentile(latencies, 50)),
            "latency_p95_s": float(np.percentile(latencies, 95)), "max_running": max_running,
            "waited_steps": waited_steps, "preemptions": engine.stats.preemptions}


def select(levels: list[dict[str, Any]], sla_s: float) -> dict[str, Any] | None:
    """The level with the highest throughput among those meeting the SLA (on a tie the lower C;
    None if none meets it)."""
    meeting = [lv for lv in levels if lv["latency_p95_s"] <= sla_s]
    return max(meeting, key=lambda lv: (lv["tokens_per_s"], -lv["clients"])) if meeting else None


def fits(level: dict[str, Any]) -> bool:
    """Every request of the level ran as soon as it came: none waited for blocks after a step's
    admission, none was preempted."""
    return level["waited_steps"] == 0 and level["preemptions"] == 0


def reference_level(naive_levels: list[dict[str, Any]], c_ref: int) -> tuple[dict[str, Any], bool]:
    """Naive-evict's level at ``c_ref``, and whether the budget binds, i.e. some scanned level
    does not fit (``fits``). When it never binds, the scan measures speed at equal concurrency,
    not capacity."""
    reference = next(lv for lv in naive_levels if lv["clients"] == c_ref)
    return reference, not all(fits(lv) for lv in naive_levels)


def run_sla_bench(cfg: SlaBenchConfig, model, tokenizer, progress=None) -> dict[str, Any]:
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.workloads import make_workload

    count = cfg.requests_per_client * max(cfg.concurrency)
    items = make_workload(cfg.workload, count, tokenizer, seed=cfg.seed,
                          max_prompt_tokens=cfg.max_prompt_tokens, max_output_tokens=cfg.max_output_tokens)
    prompts = [tokenizer.encode(item.prompt, chat=True) for item in items]
    max_tokens = [item.max_tokens for item in items]
    from trtllm_vtoken.bench.repeats import run_alternating

    def run(label: str, point: tuple[str, int]) -> dict[str, Any]:
        variant, clients = point
        engine = Engine(model, cfg.engine_config(variant), tokenizer)
        level = closed_loop(engine, prompts, max_tokens, clients, cfg.requests_per_client * clients)
        if engine.kv.step is not None:
            level["invariant_checks"] = engine.kv.step_stats.invariant_checks
        return level

    points = [(f"{variant} C={clients}", (variant, clients)) for variant in VARIANTS for clients in cfg.concurrency]
    runs = run_alternating(points, cfg.repeats, run, progress, key="latency_p95_s", spread=("tokens_per_s",))
    scans: dict[str, list[dict[str, Any]]] = {variant: [] for variant in VARIANTS}
    for (_, (variant, _)), level in zip(points, runs):
        scans[variant].append(level)
    reference, binds = reference_level(scans["naive-evict"], cfg.c_ref)
    sla = cfg.sla_factor * reference["latency_p95_s"]
    selected = {variant: select(scans[variant], sla) for variant in VARIANTS}
    summary: dict[str, Any] = {"c_ref": reference["clients"], "sla_p95_s": sla, "budget_binds": binds,
                               "selected": {v: (s["clients"] if s else None) for v, s in selected.items()},
                               "repeats": cfg.repeats}
    if all(selected.values()):
        summary.update(compare(selected["vtoken"], selected["naive-evict"]))
    else:
        summary["verdict"] = "no verdict: a variant meets the SLA at no level"
    return {"config": asdict(cfg), "scans": scans, "summary": summary}


def compare(vtoken: dict[str, Any], naive: dict[str, Any]) -> dict[str, Any]:
    """vtoken's throughput over naive-evict's at their selected levels, with the ratio's range
    over the runs and a verdict that claims a direction only outside that range."""
    low = vtoken["tokens_per_s_min"] / naive["tokens_per_s_max"]
    high = vtoken["tokens_per_s_max"] / naive["tokens_per_s_min"]
    verdict = "higher" if low > 1.0 else "lower" if high < 1.0 else "within the spread"
    ratio = vtoken["tokens_per_s"] / naive["tokens_per_s"]
    return {"throughput_ratio": ratio, "throughput_ratio_min": low, "throughput_ratio_max": high,
            "throughput_gain_pct": 100.0 * (ratio - 1.0), "verdict": verdict}


def plot_sla(result: dict[str, Any], path) -> None:
    """Throughput vs p95 latency per concurrency level, with the SLA line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant, levels in result["scans"].items():
        ax.plot([lv["latency_p95_s"] for lv in levels], [lv["tokens_per_s"] for lv in levels], marker="o", label=variant)
        for lv in levels:
            ax.annotate(f"C={lv['clients']}", (lv["latency_p95_s"], lv["tokens_per_s"]), fontsize=7)
    ax.axvline(result["summary"]["sla_p95_s"], color="gray", linestyle=":", label="SLA (1.05 x naive-evict p95 at C_ref)")
    ax.set(xlabel="p95 latency (s)", ylabel="output tokens / s", title="Throughput-latency frontier (closed loop)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
