# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench sharing``: prefix sharing at degree 1, 2, 4, 8 (simulated; issue 4, experiment 6).

Groups of ``degree`` requests share a prompt prefix whose full blocks are shared in the block
pool (reference counted, as prefix caching shares them); each request adds a private suffix and
then decodes with H2O at a retention ratio, attention from the synthetic generator of the
simulated backend. Every iteration, the prompts' and then each decode token's, is one batched
step (``DecodeStep``, the one every host runs): the policy decides, the table evicts and plans,
one copy, commit. Tokens in shared blocks are protected: no policy may evict them, and no
relocation may read, write or free a shared block (I1/I2 run around every step on a small random
KV pool, so conservation is checked on real bytes; the plans' I4 inside the token table).

Compared, from the same pool: naive-evict with prefix caching (frees only fully dead private
blocks: the step's "dead-blocks" compaction) and vtoken dense. Reported per degree: blocks in use
at the end and on average, blocks the ideal layout would need, relocations (request-steps whose
layout changed: tokens moved, blocks released or the length shortened; naive-evict only
releases), steps whose moves or releases touched a shared block (must be 0), and invariant checks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from trtllm_vtoken.core import BlockPool
from trtllm_vtoken.policies import make_policy
from trtllm_vtoken.reclaim.copy import TorchCopyExecutor
from trtllm_vtoken.runtime.simulated import SyntheticAttention
from trtllm_vtoken.step import DecodeStep, StepConfig, StepInput

VARIANTS = ("naive-evict", "vtoken")


@dataclass(frozen=True)
class SharingBenchConfig:
    requests: int = 8
    prefix_tokens: int = 128
    suffix_tokens: int = 256
    decode_tokens: int = 256
    tokens_per_block: int = 16
    budget: float = 0.6
    """H2O retention ratio of each request's private tokens (the protected shared prefix is kept on top)."""
    degrees: tuple[int, ...] = (1, 2, 4, 8)
    seed: int = 0

    def __post_init__(self) -> None:
        if any(d <= 0 or self.requests % d for d in self.degrees):
            raise ValueError(f"every degree must divide requests ({self.requests}), got {self.degrees}")
        if self.prefix_tokens % self.tokens_per_block:
            raise ValueError("prefix_tokens must be a multiple of tokens_per_block (whole shared blocks)")


class _Run:
    """One variant at one sharing degree, on its own pool and step."""

    def __init__(self, cfg: SharingBenchConfig, degree: int, variant: str) -> None:
        tpb = cfg.tokens_per_block
        per_request = -(-(cfg.prefix_tokens + cfg.suffix_tokens + cfg.decode_tokens) // tpb)
        self.cfg, self.variant, self.tpb = cfg, variant, tpb
        self.pool = BlockPool(cfg.requests * per_request + 8, tpb)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.kv = torch.zeros(self.pool.num_blocks, 1, 2, 1, tpb, 4)
        self.attention = SyntheticAttention(seed=cfg.seed)
        compaction = "dense" if variant == "vtoken" else "dead-blocks"
        self.step = DecodeStep(StepConfig(compaction, check_invariants=True), self.pool.num_blocks, tpb,
                               make_policy("h2o", cfg.budget), TorchCopyExecutor([self.kv]), self.pool.is_shared,
                               lambda: self.pool.shared)
        self.dead_released = 0
        self.shared_touched = 0
        self._arrive(degree)

    def _write(self, blocks: list[int], start: int, end: int) -> None:
        """The forward's KV for the tokens at positions [start, end) of a block list."""
        for position in range(start, end):
            self.kv[blocks[position // self.tpb], :, :, :, position % self.tpb] = \
                torch.randn(1, 2, 1, 4, generator=self.gen)

    def _arrive(self, degree: int) -> None:
        """Every request's prompt, in one step: in each group the first member writes the prefix,
        the others share its blocks (prefix caching: shared before the step, so protected)."""
        cfg, tpb = self.cfg, self.tpb
        length = cfg.prefix_tokens + cfg.suffix_tokens
        req_ids, lists = list(range(cfg.requests)), []
        for req in req_ids:
            prefix = lists[req - req % degree][: cfg.prefix_tokens // tpb] if req % degree else []
            self.pool.share(prefix)
            blocks = prefix + self.pool.allocate(-(-length // tpb) - len(prefix))
            self._write(blocks, len(prefix) * tpb, length)
            self.step.add_request(req)
            lists.append(blocks)
        self._run(req_ids, [length] * len(req_ids), lists)

    def decode(self) -> None:
        """One decode step of every request: a block where the last is full, the new token's KV."""
        req_ids, fresh = self.step.request_ids(), []
        for req in req_ids:
            blocks, kv_len = self.step.block_ids(req), self.step.kv_len(req)
            fresh.append(self.pool.allocate(1) if kv_len == len(blocks) * self.tpb else [])
            self._write(blocks + fresh[-1], kv_len, kv_len + 1)
        self._run(req_ids, [1] * len(req_ids), fresh)

    def _run(self, req_ids: list[int], num_new: list[int], new_blocks: list[list[int]]) -> None:
        mass = self.attention.batch_mass(req_ids, num_new)
        out = self.step.run(StepInput.of_lists(req_ids, num_new, new_blocks, mass=mass))
        self.shared_touched += any(self.pool.is_shared(b) for b in out.touched_blocks(self.tpb))
        if self.variant != "vtoken":
            self.dead_released += out.num_freed
        self.pool.free(out.table.freed.tolist())

    def ideal_blocks(self) -> int:
        """Shared prefix blocks once, plus ceil(private live / tpb) per request."""
        step, tpb = self.step, self.tpb
        shared = {b for r in step.request_ids() for b in step.block_ids(r) if self.pool.is_shared(b)}
        private = 0
        for req in step.request_ids():
            blocks = step.block_ids(req)
            held = step.batch_tokens([req])[0, : len(blocks) * tpb].reshape(len(blocks), tpb) >= 0
            protected = int(sum(held[k].sum() for k, b in enumerate(blocks) if b in shared))
            private += -(-(step.num_live(req) - protected) // tpb)
        return len(shared) + private


def run_sharing_bench(cfg: SharingBenchConfig, progress=None) -> dict[str, Any]:
    rows = []
    for degree in cfg.degrees:
        for variant in VARIANTS:
            run = _Run(cfg, degree, variant)
            used = []
            for _ in range(cfg.decode_tokens):
                run.decode()
                used.append(run.pool.num_used)
                if progress is not None:
                    progress.update(1)
            run.step.check_integrity()
            run.pool.check_integrity()
            stats = run.step.stats
            rows.append({
                "degree": degree, "variant": variant, "blocks_end": run.pool.num_used,
                "blocks_mean": float(np.mean(used)), "ideal_blocks_end": run.ideal_blocks(),
                "shared_blocks": sum(1 for b in range(run.pool.num_blocks) if run.pool.is_shared(b)),
                "relocations": stats.compactions, "moves": stats.moves, "plans_touching_shared": run.shared_touched,
                "invariant_checks": stats.invariant_checks, "dead_blocks_released": run.dead_released,
                "blocks_per_step": used,
            })
    for row in rows:
        if row["variant"] == "vtoken":
            naive = next(r for r in rows if r["degree"] == row["degree"] and r["variant"] == "naive-evict")
            row["fewer_blocks_than_naive_pct"] = 100.0 * (1 - row["blocks_end"] / naive["blocks_end"])
    return {"config": asdict(cfg), "rows": rows, "simulated": True}


def plot_sharing(result: dict[str, Any], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    degrees = sorted({r["degree"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.35
    for k, variant in enumerate(VARIANTS):
        values = [next(r["blocks_end"] for r in rows if r["degree"] == d and r["variant"] == variant) for d in degrees]
        ax.bar([i + (k - 0.5) * width for i in range(len(degrees))], values, width, label=variant)
    ideal = [next(r["ideal_blocks_end"] for r in rows if r["degree"] == d and r["variant"] == "vtoken") for d in degrees]
    ax.plot(range(len(degrees)), ideal, "k_", markersize=30, label="ideal")
    ax.set_xticks(range(len(degrees)), [str(d) for d in degrees])
    ax.set(xlabel="sharing degree", ylabel="blocks in use at the end", title="Prefix sharing (simulated)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
