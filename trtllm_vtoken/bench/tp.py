# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench tp``: tensor parallelism on the real model, and what keeping the ranks' eviction
decisions identical costs.

1. **Runs.** One ShareGPT workload under vToken dense with H2O (a policy that reads the attention
   mass, so the protocol has work) at TP=1 (one process, all cores) and TP=2 (two gloo rank
   processes, half the cores each), in alternating order, ``repeats`` times: tokens/s and step
   time (median run, with min-max), and, per step of the TP=2 run, the time inside the mass
   all-reduce and the bytes it reduced. The outputs of both must be token-for-token equal.
2. **The collectives alone**, on the ranks, back to back at the run's mean mass shape: the
   protocol (all-reduce of the mass), the alternative (reduce of the same mass to rank 0, then a
   broadcast of the victims), and the digest all-gather of ``check_invariants``. Time inside the
   run includes waiting for the slower rank (rank 0 holds 2 of the 3 KV heads); these do not.
3. **On paper**, Llama-3.1-70B at TP=8: the protocol's bytes per decode step from the formula
   (fp32 mass, one value per cached position of each sequence), next to the all-reduces the
   model itself makes per step (two per layer of the bf16 hidden state).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from trtllm_vtoken.config_base import require_positive
from trtllm_vtoken.runtime.config import EngineConfig


@dataclass(frozen=True)
class TpBenchConfig:
    requests: int = 8
    max_prompt_tokens: int = 128
    max_output_tokens: int = 32
    policy: str = "h2o"
    budget: str = "0.5"
    tokens_per_block: int = 16
    repeats: int = 3
    probe_repeats: int = 200
    seed: int = 0
    threads: int = 1
    """Intra-op threads of TP=1 and of each rank of TP=2: one core per rank, as TP=N uses N devices."""

    def __post_init__(self) -> None:
        require_positive(self, "threads", "requests", "max_prompt_tokens", "max_output_tokens",
                         "tokens_per_block", "repeats", "probe_repeats")

    def engine_config(self, tensor_parallel_size: int) -> EngineConfig:
        seq_len = self.max_prompt_tokens + self.max_output_tokens + 64  # + chat template
        per_request = -(-seq_len // self.tokens_per_block)
        return EngineConfig(variant="vtoken", mode="dense", policy=self.policy, budget=self.budget,
                            tokens_per_block=self.tokens_per_block, num_blocks=self.requests * per_request + 8,
                            max_batch_size=self.requests, max_seq_len=seq_len, seed=self.seed,
                            tensor_parallel_size=tensor_parallel_size)


# ---- 3. on paper ---------------------------------------------------------------------------------
LLAMA_70B = dict(name="Llama-3.1-70B", layers=80, hidden=8192, heads=64, kv_heads=8)


def projected_protocol_cost(batch: int, context: int, tp: int = 8, model: dict = LLAMA_70B) -> dict[str, Any]:
    """Bytes per decode step of the protocol and of the model's own TP all-reduces.

    protocol:  one all-reduce of the fp32 mass [batch, context]         4 * batch * context bytes
    model:     2 all-reduces per layer of the bf16 hidden [batch, hidden] 2 * layers * 2 * batch * hidden
    A ring all-reduce sends 2 (tp-1)/tp times its payload per rank. The alternative first reduces
    the same mass to one rank ((tp-1)/tp of it per rank) and then broadcasts the victims (8 bytes
    per id, one per sequence and step here, plus a count per sequence).
    """
    mass = 4 * batch * context
    hidden = 2 * model["layers"] * 2 * batch * model["hidden"]
    ring = 2 * (tp - 1) / tp
    return {
        "model": model["name"], "tp": tp, "batch": batch, "context": context,
        "mass_bytes": mass, "mass_bytes_sent_per_rank": ring * mass,
        "model_allreduce_bytes": hidden, "model_allreduces": 2 * model["layers"],
        "protocol_vs_model_bytes": mass / hidden,
        "alternative_bytes_sent_per_rank": (tp - 1) / tp * mass + 8 * 2 * batch,
    }


PROJECTIONS = ((64, 4096), (256, 8192), (64, 32768), (16, 131072))
"""(batch, context) pairs whose KV fits 8 x 141 GB beside the weights (320 KiB per token in bf16)."""


# ---- 2. the collectives alone (runs on every rank) ----------------------------------------------
def time_collectives(ranks, batch: int, hidden_size: int, length: int, victims: int,
                     repeats: int) -> dict[str, float]:
    """Median microseconds per call of each collective on this rank, back to back after a barrier,
    at one decode step's shapes. Called on every rank at once (``RankProcesses.call``).

        hidden               the last layer's o_proj all-reduce, [batch, hidden] fp32
        hidden_plus_mass     the same carrying the mass (the protocol as it runs): one buffer
        mass_alone           the mass in a collective of its own (the protocol, not carried)
        reduce_then_broadcast   the alternative: the mass reduced to rank 0, the victims broadcast
        digest_allgather     the check_invariants comparison
    """
    import torch.distributed as dist

    x, mass = torch.rand(batch, hidden_size), torch.rand(batch, length)
    both = torch.rand(batch * (hidden_size + length))
    ids = torch.zeros(batch + victims, dtype=torch.int64)

    def median_us(*fns) -> list[float]:
        """Calls the functions in turn, ``repeats`` rounds (drift hits them alike)."""
        dist.barrier()
        samples: list[list[float]] = [[] for _ in fns]
        for _ in range(repeats):
            for fn, out in zip(fns, samples):
                start = time.perf_counter()
                fn()
                out.append(time.perf_counter() - start)
        return [1e6 * statistics.median(out) for out in samples]

    hidden, carried, alone, alternative = median_us(
        lambda: dist.all_reduce(x), lambda: dist.all_reduce(both), lambda: dist.all_reduce(mass),
        lambda: (dist.reduce(mass, dst=0), dist.broadcast(ids, src=0)))
    (digest,) = median_us(lambda: ranks.all_gather_int(12345))
    return {"hidden_us": hidden, "hidden_plus_mass_us": carried, "mass_alone_us": alone,
            "reduce_then_broadcast_us": alternative, "digest_allgather_us": digest}


# ---- 1. the runs ---------------------------------------------------------------------------------
def run_tp_bench(cfg: TpBenchConfig, folder, tokenizer, progress=None) -> dict[str, Any]:
    """Everything above; ``progress`` (a tqdm-like bar) advances once per run."""
    from trtllm_vtoken.bench.repeats import run_alternating
    from trtllm_vtoken.consistency import SingleRank
    from trtllm_vtoken.runtime.model import load_llama
    from trtllm_vtoken.runtime.parallel.launch import RankProcesses
    from trtllm_vtoken.runtime.parallel.rank_process import Job, run_job
    from trtllm_vtoken.runtime.sampling import SamplingParams
    from trtllm_vtoken.workloads import make_workload

    load_before = os.getloadavg()[0]  # other tenants of a shared machine slow every collective
    items = make_workload("sharegpt", cfg.requests, tokenizer, seed=cfg.seed,
                          max_prompt_tokens=cfg.max_prompt_tokens, max_output_tokens=cfg.max_output_tokens)
    prompts = [tokenizer.encode(item.prompt, chat=True) for item in items]
    params = SamplingParams(max_tokens=cfg.max_output_tokens, ignore_eos=True)
    model = load_llama(folder)
    outputs: dict[int, dict] = {}
    # One core per rank: TP=1 computes on one core, TP=2 on two (as TP=N uses N devices).
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    with RankProcesses(folder, 2, threads=cfg.threads) as ranks:
        def run(label: str, tp: int) -> dict[str, Any]:
            job = Job(cfg.engine_config(tp), prompts, params, timings=True)
            start = time.perf_counter()
            reports = [run_job(job, model, tokenizer, SingleRank(), None)] if tp == 1 else ranks.run(job)
            wall = time.perf_counter() - start
            if reports[0].error is not None:
                raise reports[0].error
            outputs[tp] = reports[0].outputs
            return summarize_run(tp, reports, wall)

        runs = run_alternating((("tp=1", 1), ("tp=2", 2)), cfg.repeats, run, progress)
        tp2 = runs[1]
        # The mass of one decode step of the whole batch: [requests, bytes per step / 4 / requests].
        length = max(1, round(tp2["bytes_reduced_per_step"] / 4 / cfg.requests))
        samples = [ranks.call(time_collectives, cfg.requests, model.config.hidden_size, length, cfg.requests,
                              cfg.probe_repeats) for _ in range(cfg.repeats)]
    torch.set_num_threads(threads)
    probes = [{key: statistics.median(s[rank][key] for s in samples) for key in samples[0][rank]}
              for rank in range(2)]
    for rank, probe in enumerate(probes):
        for key in samples[0][rank]:
            probe[f"{key}_min"] = min(s[rank][key] for s in samples)
            probe[f"{key}_max"] = max(s[rank][key] for s in samples)
    # What the carried mass adds to the collective it rides in, at this step's shapes (the worse rank).
    marginal = max(p["hidden_plus_mass_us"] - p["hidden_us"] for p in probes)
    tp2["carried_marginal_us"] = marginal
    # (A negative difference is the collective's noise: counted as free, reported as measured.)
    tp2["protocol_us_per_step"] = (tp2["separate_collective_us_per_step"]
                                   + tp2["carried"] / tp2["steps"] * max(marginal, 0.0))
    tp2["protocol_share_of_step_pct"] = 100 * tp2["protocol_us_per_step"] / (1e3 * tp2["step_ms_mean"])
    return {
        "config": asdict(cfg), "runs": runs, "same_outputs": outputs[1] == outputs[2],
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "collectives": probes,
        "projection": [projected_protocol_cost(b, c) for b, c in PROJECTIONS],
    }


def summarize_run(tp: int, reports, wall: float) -> dict[str, Any]:
    lead = reports[0]
    steps = len(lead.step_seconds)
    tokens = sum(len(o) for o in lead.outputs.values())
    row: dict[str, Any] = {
        "tp": tp, "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall, "steps": steps,
        "step_ms_mean": 1e3 * sum(lead.step_seconds) / steps,
        "tokens_evicted": lead.tokens_evicted, "blocks_freed": lead.blocks_freed,
    }
    if tp > 1:
        # The mass rides in the last layer's o_proj all-reduce (``carried``): no collective of its
        # own. Any that did not (none, normally) are timed; a rank waits inside a collective for
        # the last to arrive, so the last arriver's time is the collective's own cost.
        durations = list(zip(*(r.protocol.durations for r in reports)))
        own = sum(min(d) for d in durations)
        p = lead.protocol
        row.update(
            reductions=p.reductions, carried=p.carried, bytes_reduced_per_step=p.bytes_reduced / steps,
            separate_collective_us_per_step=1e6 * own / steps,
            all_reduces_per_step=lead.all_reduces / steps,
            all_reduce_ms_per_step=[1e3 * r.all_reduce_seconds / steps for r in reports],
        )
    return row


def plot_tp(result: dict[str, Any], path) -> None:
    """Step time at TP=1 and TP=2 (all-reduces and the protocol's part), and the collectives alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {r["tp"]: r for r in result["runs"]}
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(12, 4))
    labels = [f"TP={tp}" for tp in sorted(runs)]
    step = [runs[tp]["step_ms_mean"] for tp in sorted(runs)]
    comm = [max(runs[tp].get("all_reduce_ms_per_step", [0.0])) for tp in sorted(runs)]
    protocol = [runs[tp].get("protocol_us_per_step", 0.0) / 1e3 for tp in sorted(runs)]
    ax0.bar(labels, [s - c for s, c in zip(step, comm)], color="tab:blue", label="compute")
    ax0.bar(labels, comm, bottom=[s - c for s, c in zip(step, comm)], color="tab:gray", label="model all-reduces")
    ax0.bar(labels, protocol, bottom=step, color="tab:red", label="protocol")
    ax0.set(ylabel="ms per step (median run)", title="Decode step, SmolLM2-135M fp32, CPU")
    ax0.legend()
    names = {"hidden_us": "o_proj\nall-reduce", "hidden_plus_mass_us": "o_proj + mass\n(protocol)",
             "mass_alone_us": "mass alone", "reduce_then_broadcast_us": "reduce +\nbroadcast",
             "digest_allgather_us": "digest\nall-gather"}
    for rank, probe in enumerate(result["collectives"]):
        ax1.bar([i + 0.4 * rank for i in range(len(names))], [probe[n] for n in names], width=0.4,
                label=f"rank {rank}")
    ax1.set_xticks([i + 0.2 for i in range(len(names))], list(names.values()))
    ax1.set(ylabel="us per call (median)", title="Collectives alone, one decode step's shapes")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
