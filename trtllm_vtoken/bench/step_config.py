# SPDX-License-Identifier: Apache-2.0
"""The settings of ``vtoken bench step`` (``bench/step.py`` says what it measures): its rows, the
engine each row runs, and the README's target each row is held to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trtllm_vtoken.bench.repeats import at_most_verdict
from trtllm_vtoken.config_base import require_positive
from trtllm_vtoken.runtime.config import EngineConfig

SPLIT = ("table", "policy", "core", "copy")
IMPLS = ("cpp", "python", "cpp-at-once", "cpp-overlap", "cpp-at-once-overlap")
"""The step's core: C++ (its native call on the step's worker thread beside the engine's
sampling), Python, C++ with the native call on the engine's thread before sampling
(``EngineConfig.step_overlap`` off); "-overlap": the same under the overlap scheduler."""
MASSES = ("fixed", "buffer", "forward", "synthetic")
NATIVE = dict(variant="native", mode="-", policy="-", impl="-")
"""The baseline row: plain block lists, no token table (also every run's paired partner)."""


def native_partner(overlap: bool) -> dict[str, Any]:
    """The native row a row is paired with: in the same order (the overlap scheduler or not)."""
    return dict(NATIVE, overlap=True) if overlap else NATIVE


@dataclass(frozen=True)
class StepBenchConfig:
    batches: tuple[int, ...] = (64, 256)
    context: int = 4096
    tokens_per_block: int = 32
    steps: int = 20
    warmup: int = 3
    repeats: int = 3
    impls: tuple[str, ...] = ("cpp", "python")
    """Among ``IMPLS``."""
    mass: str = "fixed"
    """Where the attention mass comes from: "fixed" (one array per layout shape, from a function
    of the layout), "buffer" (one array per batch, the same every step), "forward" (a forward's
    tensor per batch, handed to the step by the engine as the model's) or "synthetic" (the simulated
    attention)."""
    threads: int = 0
    """The step's native H2O pass threads (``EngineConfig.step_threads``; 0: automatic, the default)."""
    forward_us: float = 0.0
    """Device time of the simulated forward (see ``bench/step.py``); 0: none."""
    seed: int = 0

    def __post_init__(self) -> None:
        require_positive(self, "context", "tokens_per_block", "steps", "repeats")
        if self.context <= 2 * self.tokens_per_block:
            raise ValueError(f"context ({self.context}) must exceed two blocks of {self.tokens_per_block} tokens")
        if not self.batches or min(self.batches) <= 0:
            raise ValueError(f"batches must be positive, got {self.batches}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not self.impls or set(self.impls) - set(IMPLS):
            raise ValueError(f"impls must be among {', '.join(IMPLS)}, got {self.impls}")
        if self.mass not in MASSES:
            raise ValueError(f"mass must be one of {MASSES}, got {self.mass!r}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: automatic), got {self.threads}")
        if self.forward_us < 0:
            raise ValueError(f"forward_us must be >= 0, got {self.forward_us}")

    def rows(self) -> list[tuple[str, dict[str, Any]]]:
        """(label, the row's settings) for one batch size, in run order."""
        rows: list[tuple[str, dict[str, Any]]] = [("native", NATIVE)]
        if any(impl.endswith("-overlap") for impl in self.impls):
            rows.append(("native overlap", native_partner(True)))
        for impl in self.impls:
            overlap = impl.endswith("-overlap")
            rows.append((f"indirection-only {impl}", dict(variant="indirection-only", mode="dense",
                                                          policy="streaming_llm", impl=impl, overlap=overlap)))
            for policy in ("h2o", "streaming_llm"):
                for mode in ("dense", "lazy"):
                    rows.append((f"vtoken {mode} {policy} {impl}",
                                 dict(variant="vtoken", mode=mode, policy=policy, impl=impl, overlap=overlap)))
            if impl == self.impls[0]:  # the bracket's other end, once
                rows.append((f"vtoken dense h2o at a block boundary {impl}",
                             dict(variant="vtoken", mode="dense", policy="h2o", impl=impl, boundary=True,
                                  overlap=overlap)))
        return rows

    def budget(self, row: dict[str, Any]) -> int:
        """Live tokens an evicting row keeps: mid-block, or at a block boundary (see ``bench/step.py``)."""
        tpb = self.tokens_per_block
        return self.context - tpb - (0 if row.get("boundary") else tpb // 2)

    def max_seq_len(self) -> int:
        """Every request's tokens: the context, the warm-up and timed steps, and a margin."""
        return self.context + self.warmup + self.steps + 4

    def engine_config(self, batch: int, row: dict[str, Any]) -> EngineConfig:
        tpb, length = self.tokens_per_block, self.max_seq_len()
        values: dict[str, Any] = dict(
            tokens_per_block=tpb, num_blocks=batch * (-(-length // tpb) + 1) + 8, max_batch_size=batch,
            max_seq_len=length, seed=self.seed, admission="greedy",  # the pool holds every request
            prefix_caching=False,  # identical placeholder prompts must not share blocks
            overlap_scheduler=row.get("overlap", False),  # else each iteration's step before the next forward
            # Every step evicts here: deciding at once, H2O's would all run before the next forward,
            # as the plain rows time them; lagged, each runs beside it, the work the overlap hides.
            decode_decision="lagged" if row.get("overlap", False) else "at_once",
            variant="native" if row["variant"] == "native" else "vtoken")
        if row["variant"] != "native":
            values.update(mode=row["mode"], policy=row["policy"], step_impl=row["impl"].split("-")[0],
                          step_overlap="at-once" not in row["impl"],
                          step_threads=self.threads,
                          budget="1.0" if row["variant"] == "indirection-only" else self.budget(row))
        return EngineConfig(**values)


def target_of(row: dict[str, Any]) -> tuple[str, float, str] | None:
    """The README's target a row is held to: (field, bound, unit), or None. The C++ core's step
    (the default) beside sampling with nothing to evict adds at most 2% over native; dense H2O at
    most 300 us a step at batch 64, 1 ms at 256. The Python core, the specification, has none."""
    if not row["impl"].startswith("cpp"):
        return None
    if row["variant"] == "indirection-only":
        return "added_pct", 2.0, "%"
    if row["variant"] == "vtoken" and row["mode"] == "dense" and row["policy"] == "h2o":
        return "added_us_p50", 300.0 if row["batch"] <= 64 else 1000.0, " us"
    return None


def judged(row: dict[str, Any]) -> dict[str, Any]:
    """The row's target and whether its runs meet it outside their spread."""
    target = target_of(row)
    if target is None:
        return {"target": None, "verdict": None}
    field, bound, unit = target
    return {"target": f"{field} <= {bound:g}{unit}",
            "verdict": at_most_verdict(row[f"{field}_min"], row[f"{field}_max"], bound, unit)}
