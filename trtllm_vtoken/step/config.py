# SPDX-License-Identifier: Apache-2.0
"""The step's settings (frozen, validated) and its counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from trtllm_vtoken.reclaim.step_batch import COMPACTIONS
from trtllm_vtoken.step.core import IMPLS
from trtllm_vtoken.threads import usable_cores


@dataclass(frozen=True)
class StepConfig:
    compaction: str = "dense"
    """"dense": fill every hole before the next attention and release the tail (kernels without a
    per-token mask: TensorRT-LLM's). "lazy": holes stay (masked attention); a request is compacted
    once it holds ``fragmentation_threshold`` blocks beyond the ideal, or under pressure.
    "dead-blocks": nothing moves, only blocks whose every token is dead are released (naive-evict)."""
    fragmentation_threshold: int = 1
    check_invariants: bool = False
    """Around every step: I1 (live ids + KV bytes hash the same), I2 (the table and the step's
    batch layout agree, no slot twice), the plan checks of I4."""
    impl: str = "auto"
    """"cpp", "python" or "auto" (cpp where built): the token-table implementation."""
    background: bool = False
    """Lazy only: a request's compaction copies in the background (the next forward does not wait
    for it) and commits at a later step, once its copy has finished (``step/background.py``)."""
    threads: int = 0
    """C++ core: threads H2O's pass over the slots (adding the mass, finding the victims) may split
    a batch's rows over (``cpp/core/select.h``; the same victims; one thread while blocks are
    shared or the batch holds under 64Ki tokens per thread). 0 (the default): the cores this
    process may run on, at most ``MAX_AUTO_THREADS``. On the project's 2-core VM two threads took
    660-1,000 us (a fifth to a third) off the H2O rows' added time per step at batch 256 and made
    no difference at 64 (``benchmarks/RESULTS.md``)."""

    def __post_init__(self) -> None:
        if self.compaction not in COMPACTIONS or self.compaction == "lazy-deferred":
            raise ValueError(f"compaction must be one of {COMPACTIONS}, got {self.compaction!r}")
        if self.fragmentation_threshold < 1:
            raise ValueError(f"fragmentation_threshold must be >= 1, got {self.fragmentation_threshold}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {self.impl!r}")
        if self.background and self.compaction != "lazy":
            raise ValueError("background compaction is lazy compaction's: dense fills holes before the next forward")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: automatic), got {self.threads}")

    def pass_threads(self, beside_host: bool = False) -> int:
        """``threads`` resolved: 0 becomes the cores this process may run on, at most
        ``MAX_AUTO_THREADS`` (the host's other work, e.g. other ranks' processes, keeps the rest);
        ``beside_host``: one core fewer (the step runs on its worker thread while the host's
        thread keeps a core busy, ``DecodeStep.start``)."""
        if self.threads:
            return self.threads
        return max(1, min(MAX_AUTO_THREADS, usable_cores() - beside_host))


MAX_AUTO_THREADS = 4


@dataclass
class StepStats:
    steps: int = 0
    tokens_evicted: int = 0
    compactions: int = 0
    """Request-steps whose physical layout changed (tokens moved, length shortened or blocks
    released): what one relocation plan per request did before."""
    moves: int = 0
    blocks_freed: int = 0
    bytes_copied: int = 0
    invariant_checks: int = 0
    native_decisions: int = 0
    """Steps whose decision the C++ core's call made itself (one natively decided policy, or none,
    for the whole batch: ``BatchDecision.native_decision``); the rest were decided in Python."""
    overlapped_steps: int = 0
    """Steps whose native call ran on the worker thread beside the host (``DecodeStep.start``)."""
    repeated_steps: int = 0
    """Of those, steps whose call repeated the last one's for the same batch, started with no
    check or decision in Python (``step/beside.py`` ``RepeatedCall``; its host time counted as "table")."""
    waited_seconds: float = 0.0
    """Time the host's thread waited for those calls (their own time is counted as "core")."""
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("table", "policy", "core", "copy", "checks", "rerotate"), 0.0))
    """Host time: "table" the batch layout's upkeep outside the call (registration on the host's
    thread, background compaction's commits); "policy" mass reduction, observation and selection
    made before the call; "core" the step's call (``step/fused.py`` or ``step/spec.py``: the
    decision where the C++ core makes it, the victims' slots and ids, the token table's append,
    evict, plan and commit, the layout's update, the output's parts); "copy" submitting the copy
    and ordering it; "checks" invariant checks; "rerotate" turning the surviving keys back (shift
    positions, ``reclaim/rerotate.py``)."""
    core_parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CORE_PARTS, 0.0))
    """Of "core", where the C++ core's call's time went (its own clocks, inside the call):
    "decide" the decision's pass (H2O's statistic, the lowest ids), every call; "plan" and
    "commit" the compaction of the requests with holes, only inside ``core.native.compaction_timed``
    (a diagnostic; ``cpp/core/batch.h`` StepResult: a single hole is filled in one operation,
    counted as "commit"). The rest of "core" is the table's upkeep: registration, append, evict,
    the layout's update and the output. The Python core's call times no parts."""
    mass_seconds: float = 0.0
    """Time in a ``Mass`` function (the simulated attention): not host work of the step."""


CORE_PARTS = ("decide", "plan", "commit")
"""The parts of the C++ core's call's time ``StepStats.core_parts`` holds."""
