# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench shift``: what position-shift mode costs next to keep mode (real model).

One workload, served four ways from the same pool and policy, repeated in alternating order (the
median run is reported with min and max):

    keep  / dense     keys keep their rotation; every step compacts
    shift / dense     every compaction that shortens a request also turns all its surviving keys
                      back (one read and one write of every live key of that request)
    keep  / lazy      compaction only when a whole block can be freed
    shift / lazy      the same, so keys are turned once per freed block: evictions batched

Reported per run: throughput, and per engine step the bytes relocation copies (K and V of moved
tokens) and the extra bytes re-rotation touches (K of every surviving token of each shortened
request, read and written), with the passes and tokens behind them. Greedy outputs of shift are
compared with keep's token for token.

``run_exactness`` is the other half: one prompt, 64 greedy tokens, every policy, keep and shift
in both compaction modes, with and without attention sinks: the largest logit difference between
shift and keep, next to the float32 noise floor of keep mode itself (the same keys in another
physical order: dense vs lazy compaction).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from trtllm_vtoken.bench.overhead import OverheadBenchConfig
from trtllm_vtoken.runtime.config import EngineConfig

RUNS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("keep / dense", dict(positions="keep", mode="dense")),
    ("shift / dense", dict(positions="shift", mode="dense")),
    ("keep / lazy", dict(positions="keep", mode="lazy")),
    ("shift / lazy", dict(positions="shift", mode="lazy")),
)


@dataclass(frozen=True)
class ShiftBenchConfig:
    workload: str = "sharegpt"
    requests: int = 8
    max_prompt_tokens: int = 256
    max_output_tokens: int = 64
    policy: str = "streaming_llm"
    budget: str = "64"
    tokens_per_block: int = 16
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        self.engine_config(positions="keep")  # ValueError for a bad count, policy or budget

    def engine_config(self, **overrides: Any) -> EngineConfig:
        """A pool large enough that admission never waits (as ``bench overhead``'s), prefix
        caching off in both modes: shift positions turn it off (a shared block's keys cannot turn
        for one request alone), and in keep mode it would keep shared blocks' tokens on top of the
        budget, so keep would evict other tokens than shift and the outputs would not compare."""
        roomy = OverheadBenchConfig(self.workload, self.requests, self.max_prompt_tokens, self.max_output_tokens,
                                    self.tokens_per_block, self.repeats, self.seed)
        return roomy.engine_config(policy=self.policy, budget=self.budget, prefix_caching=False, **overrides)


def run_shift_bench(cfg: ShiftBenchConfig, model, tokenizer, progress=None) -> dict[str, Any]:
    from trtllm_vtoken.bench.repeats import run_alternating
    from trtllm_vtoken.bench.variants import serve_workload
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.workloads import make_workload

    items = make_workload(cfg.workload, cfg.requests, tokenizer, seed=cfg.seed,
                          max_prompt_tokens=cfg.max_prompt_tokens, max_output_tokens=cfg.max_output_tokens)
    prompts = [tokenizer.encode(item.prompt, chat=True) for item in items]
    outputs: dict[str, list[list[int]]] = {}

    def run(label: str, overrides: dict[str, Any]) -> dict[str, Any]:
        engine = Engine(model, cfg.engine_config(**overrides), tokenizer)
        result, outputs[label] = serve_workload(engine, prompts, items, None)
        result.pop("blocks_per_step")
        rotation = engine.kv.rerotation.stats if engine.kv.rerotation else None
        steps = max(result["steps"], 1)
        result.update(
            positions=overrides["positions"],
            relocation_bytes_per_step=result["bytes_copied"] / steps,
            rerotation_bytes_per_step=(rotation.bytes if rotation else 0) / steps,
            rerotation_passes=rotation.passes if rotation else 0,
            keys_rerotated=rotation.tokens if rotation else 0,
        )
        return result

    runs = run_alternating(RUNS, cfg.repeats, run, progress)
    by_label = {r["label"]: r for r in runs}
    for row in runs:
        keep = by_label[row["label"].replace("shift", "keep")]
        row["throughput_vs_keep"] = row["tokens_per_s"] / keep["tokens_per_s"]
        row["outputs_equal_keep"] = outputs[row["label"]] == outputs[keep["label"]]
    return {"config": asdict(cfg), "prompt_tokens": [len(p) for p in prompts], "runs": runs}


def run_exactness(model, tokenizer, prompt: str = "Explain what a hash table is.", tokens: int = 64,
                  budget: int = 24, tokens_per_block: int = 4, sinks: tuple[int, ...] = (0, 4),
                  progress=None) -> dict[str, Any]:
    """Max |logit difference| of shift vs keep per policy, compaction mode and number of sinks."""
    from trtllm_vtoken.policies import POLICIES
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.sampling import SamplingParams

    ids = tokenizer.encode(prompt, chat=True)

    def decode(**config: Any):
        cfg = EngineConfig(budget=budget, tokens_per_block=tokens_per_block, num_blocks=len(ids) + tokens,
                           max_batch_size=1, max_seq_len=len(ids) + tokens, **config)
        engine = Engine(model, cfg, record_trace=True)
        req = engine.add_request(ids, SamplingParams(max_tokens=tokens, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        if progress is not None:
            progress.update(1)
        return engine.pop_finished(req)

    def worst(a, b) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))

    rows = []
    for n_sink in sinks:
        for policy in POLICIES.names():
            runs = {(mode, positions): decode(policy=policy, mode=mode, positions=positions,
                                              policy_options={"n_sink": n_sink})
                    for mode in ("dense", "lazy") for positions in ("keep", "shift")}
            rows.append({
                "policy": policy, "n_sink": n_sink,
                "shift_vs_keep_dense": worst(runs["dense", "shift"], runs["dense", "keep"]),
                "shift_vs_keep_lazy": worst(runs["lazy", "shift"], runs["lazy", "keep"]),
                "keep_dense_vs_keep_lazy": worst(runs["dense", "keep"], runs["lazy", "keep"]),
                "same_greedy_tokens": all(runs[m, "shift"].output_ids == runs[m, "keep"].output_ids
                                          for m in ("dense", "lazy")),
            })
    return {"config": {"prompt": prompt, "prompt_tokens": len(ids), "tokens": tokens, "budget": budget,
                       "tokens_per_block": tokens_per_block, "dtype": "float32"}, "rows": rows}


def plot_shift(result: dict[str, Any], path) -> None:
    """Throughput with its run range, and bytes per step (relocation vs re-rotation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = [r["label"] for r in runs]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4))
    medians = [r["tokens_per_s"] for r in runs]
    spread = [[m - r["tokens_per_s_min"] for m, r in zip(medians, runs)],
              [r["tokens_per_s_max"] - m for m, r in zip(medians, runs)]]
    ax0.bar(labels, medians, yerr=spread, capsize=4, color="tab:blue")
    ax0.set(ylabel="output tokens / s", title="Throughput (median, min-max of runs)")
    ax1.bar(labels, [r["relocation_bytes_per_step"] / 1e6 for r in runs], label="relocation (K+V moved)")
    ax1.bar(labels, [r["rerotation_bytes_per_step"] / 1e6 for r in runs],
            bottom=[r["relocation_bytes_per_step"] / 1e6 for r in runs], label="re-rotation (K read+write)")
    ax1.set(ylabel="MB per engine step", title="KV bytes touched per step")
    ax1.legend()
    for ax in (ax0, ax1):
        ax.tick_params(axis="x", rotation=15)
    c = result["config"]
    fig.suptitle(f"{c['workload']}, {c['requests']} requests, {c['policy']} budget {c['budget']}, "
                 f"tokens_per_block {c['tokens_per_block']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
