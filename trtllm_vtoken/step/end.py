# SPDX-License-Identifier: Apache-2.0
"""Stage 5 of a ``DecodeStep`` (``step/__init__.py``), after its call: the victims hook where the
call ran on the worker, background compaction's commits and new plans, the ONE copy of every move
(I3, ordered before the host's next forward), the invariant checks, the re-rotation, the
counters. A base of ``DecodeStep``, which sets the state it reads."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from trtllm_vtoken.reclaim.copy import CopyExecutor
from trtllm_vtoken.reclaim.rerotate import KeyRerotation
from trtllm_vtoken.step.background import output as committed_output
from trtllm_vtoken.step.checks import StepChecks
from trtllm_vtoken.step.config import CORE_PARTS, StepStats
from trtllm_vtoken.step.decide import GIVEN
from trtllm_vtoken.step.io import StepOutput
from trtllm_vtoken.step.iteration import Iteration


class StepEnd:
    """What a step does once its call returned."""

    impl: str
    core: Any
    stats: StepStats
    checks: StepChecks | None
    background: Any
    executor: CopyExecutor | None
    rerotation: KeyRerotation | None
    _broken: str | None
    _on_victims: Callable[..., None]

    def _end(self, it: Iteration, called: tuple[StepOutput, float]) -> StepOutput:
        """After the call: the victims hook (a call made on the worker), 4. background
        compaction's commits and new plans (``step/background.py``), 5. the one copy, the checks,
        the re-rotation, the counters."""
        clock, stats, seconds = time.perf_counter, self.stats, self.stats.seconds
        out, seconds["core"] = called[0], seconds["core"] + called[1]
        req_ids, background = it.req_ids, self.background
        t4 = clock()
        if it.before is not None:  # I1's before: the KV as the copy will find it
            it.before = self.checks.snapshots(it.before)
            seconds["checks"], t4 = seconds["checks"] + clock() - t4, clock()
        if self.impl == "cpp":  # of "core": the call's own clocks
            for name, part in zip(CORE_PARTS, out.seconds):
                stats.core_parts[name] += part
        if it.decision.selector != GIVEN:
            stats.native_decisions += 1
        if it.block_lists is not None and out.num_evicted:  # the call ran on the worker: the hook now
            self._on_victims(req_ids, out.victim_offsets, out.victims, it.listed_before)
        copied = out.num_moves
        if background is not None:  # the call planned: commit what finished, copy the new plans
            planned = copied or out.num_freed
            handle = None
            if it.at_once:  # the new plans too, at once: their blocks are needed by the next reservation
                handle = background.start(req_ids, out.table, self.checks is not None) if planned else None
                background.order_before(it.stream)
            try:
                committed = background.finish(req_ids, it.rows, every=it.at_once)
            except RuntimeError as exc:  # a plan could not commit: the tables disagree now
                self._broken = str(exc)
                raise
            t5 = clock()
            if not it.at_once and planned:
                handle = background.start(req_ids, out.table, self.checks is not None)
            out = committed_output(out, committed)
        else:
            t5 = t4
            # ONE copy of every move, ordered before the host's next forward (I3); no moves: no parts made
            handle = None
            if copied and self.executor is not None:
                handle = self.executor.submit_before(*out.moved_slots(), it.stream)
        t6 = clock()
        out.req_ids, out.copy = it.host_ids, handle
        if self.checks:  # I1 on the relocated keys, before they turn
            self.checks.after(out, it.before)
        t7 = clock()
        if self.rerotation is not None and out.lost.any():
            self.rerotation.shift_requests(self.core, dict(zip(req_ids.tolist(), out.lost.tolist())), it.stream)
        t8 = clock()
        stats.steps += 1
        stats.tokens_evicted += out.num_evicted
        stats.compactions += out.num_changed
        stats.moves += out.num_moves
        stats.blocks_freed += out.num_freed
        if copied and self.executor is not None:
            stats.bytes_copied += copied * self.executor.bytes_per_move()
        seconds["table"] += t5 - t4
        seconds["copy"] += t6 - t5
        seconds["checks"] += t7 - t6
        seconds["rerotate"] += t8 - t7
        return out
