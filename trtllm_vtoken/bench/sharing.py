# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench sharing``: prefix sharing at degree 1, 2, 4, 8 (simulated; issue 4, experiment 6).

Groups of ``degree`` requests share a prompt prefix whose full blocks are shared in the block
pool (reference counted, as prefix caching shares them); each request adds a private suffix and
then decodes with H2O at a retention ratio, attention from the synthetic generator of the
simulated backend. Tokens in shared blocks are protected: no policy may evict them, and no
relocation may read, write or free a shared block (every plan is validated in full, I4, and I1/I2
run after every relocation on a small random KV pool, so conservation is checked on real bytes).

Compared, from the same pool: naive-evict with prefix caching (frees only fully dead private
blocks) and vtoken dense. Reported per degree: blocks in use at the end and on average, blocks
the ideal layout would need, relocations, plans that touched a shared block (must be 0), and
invariant checks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from trtllm_vtoken.core import BlockPool, TokenTable
from trtllm_vtoken.policies import make_policy, policy_view
from trtllm_vtoken.reclaim import ReclaimBackend, ReclaimConfig
from trtllm_vtoken.reclaim.copy import TorchCopyExecutor
from trtllm_vtoken.reclaim.dead_blocks import release_dead_blocks
from trtllm_vtoken.runtime.simulated import SyntheticAttention

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
    """One variant at one sharing degree, on its own pool and table."""

    def __init__(self, cfg: SharingBenchConfig, degree: int, variant: str) -> None:
        tpb = cfg.tokens_per_block
        per_request = -(-(cfg.prefix_tokens + cfg.suffix_tokens + cfg.decode_tokens) // tpb)
        self.cfg, self.variant, self.tpb = cfg, variant, tpb
        self.pool = BlockPool(cfg.requests * per_request + 8, tpb)
        self.table = TokenTable(tpb, self.pool.is_shared)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.kv = torch.zeros(self.pool.num_blocks, 1, 2, 1, tpb, 4)
        self.backend = ReclaimBackend(self.table, self.pool, TorchCopyExecutor([self.kv]),
                                      ReclaimConfig("dense", check_invariants=True)) if variant == "vtoken" else None
        self.policy = make_policy("h2o", cfg.budget)
        self.attention = SyntheticAttention(seed=cfg.seed)
        self.dead_released = 0
        self.shared_touched = 0
        for group in range(cfg.requests // degree):
            prefix: list[int] = []
            for member in range(degree):
                self._arrive(group * degree + member, prefix)

    def _write(self, req: int, token_ids) -> None:
        for token in token_ids:
            block, offset = self.table.lookup(req, token)
            self.kv[block, :, :, :, offset] = torch.randn(1, 2, 1, 4, generator=self.gen)

    def _arrive(self, req: int, prefix: list[int]) -> None:
        """The first member writes the prefix; the others share its blocks (prefix caching)."""
        cfg, tpb = self.cfg, self.tpb
        length = cfg.prefix_tokens + cfg.suffix_tokens
        if prefix:
            self.pool.share(prefix)
        fresh = self.pool.allocate(-(-length // tpb) - len(prefix))
        self.table.add_request(req)
        new = self.table.sync_new_tokens(req, prefix + fresh, length)
        self._write(req, new[len(prefix) * tpb:])
        if not prefix:
            prefix.extend(self.table.block_ids(req)[: cfg.prefix_tokens // tpb])

    def step(self) -> None:
        for req in self.table.request_ids():
            blocks, kv_len = self.table.block_ids(req), self.table.kv_len(req)
            if kv_len == len(blocks) * self.tpb:
                blocks += self.pool.allocate(1)
            self._write(req, self.table.sync_new_tokens(req, blocks, kv_len + 1))
            seq = self.table.seq(req)
            live = self.table.live_ids(req)
            self.policy.observe(req, live, self.attention.scores(req, live, seq.num_tokens, 1))
            doomed = self.policy.select(policy_view(self.table, req))
            if len(doomed):
                self.table.evict_tokens(req, doomed)
            if self.backend is None:
                self.dead_released += release_dead_blocks(self.table, self.pool, req)
                continue
            plan = self.backend.plan(req)
            if plan is None:
                continue
            self.shared_touched += any(self.pool.is_shared(b) for b in plan.touched_blocks(self.tpb))
            self.backend.submit(plan)
            self.backend.commit_blocking(req)

    def ideal_blocks(self) -> int:
        """Shared prefix blocks once, plus ceil(private live / tpb) per request."""
        shared = {b for r in self.table.request_ids() for b in self.table.block_ids(r) if self.pool.is_shared(b)}
        private = 0
        for req in self.table.request_ids():
            protected = len(self.table.protected_ids(req))
            private += -(-(self.table.num_live(req) - protected) // self.tpb)
        return len(shared) + private


def run_sharing_bench(cfg: SharingBenchConfig, progress=None) -> dict[str, Any]:
    rows = []
    for degree in cfg.degrees:
        for variant in VARIANTS:
            run = _Run(cfg, degree, variant)
            used = []
            for _ in range(cfg.decode_tokens):
                run.step()
                used.append(run.pool.num_used)
                if progress is not None:
                    progress.update(1)
            run.table.check_integrity()
            run.pool.check_integrity()
            stats = run.backend.stats if run.backend else None
            rows.append({
                "degree": degree, "variant": variant, "blocks_end": run.pool.num_used,
                "blocks_mean": float(np.mean(used)), "ideal_blocks_end": run.ideal_blocks(),
                "shared_blocks": sum(1 for b in range(run.pool.num_blocks) if run.pool.is_shared(b)),
                "relocations": stats.plans if stats else 0, "moves": stats.moves if stats else 0,
                "plans_touching_shared": run.shared_touched, "invariant_checks": stats.invariant_checks if stats else 0,
                "dead_blocks_released": run.dead_released, "blocks_per_step": used,
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
