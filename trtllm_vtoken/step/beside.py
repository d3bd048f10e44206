# SPDX-License-Identifier: Apache-2.0
"""The C++ core's call on the step's worker thread, beside the host's own work (``DecodeStep.start``
with overlap draws the timeline): started for a checked batch, repeated for the same batch, waited
for. The victims hook then runs after the call, on the host's thread, with the block lists copied
before it (``Iteration.listed_before``).

Repeated: a decode loop passes the same lists step after step; while nothing the step's checks
and decision read has changed, the next call starts from the last one's arguments with this
step's new blocks and pressure, and no Python work between: on the host's thread each Python call
and numpy object costs a multiple of its warm time (``benchmarks/step/cold_host``). The C++ core
still checks the new blocks and tokens. A batch that observes attention repeats where the host
hands the same mass buffer every step, rewritten in place (a CUDA-graph host's static output
staged to one host buffer), or a new numpy array each step (a forward's output copied to the
host), each as the call took the first (C order, one row per request, of the first one's dtype,
float32 or float64; no ``reduce_mass``): the call reads this step's when it runs, and the C++ core
checks its width against the rows' lengths at each repetition. A torch tensor, a reduced or
converted mass takes the whole path. ``tests/step/test_step_repeat.py`` holds each to the whole path.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any, NamedTuple

import numpy as np

from trtllm_vtoken.policies import EvictionPolicy
from trtllm_vtoken.policies.budget import BoundsRule
from trtllm_vtoken.step.config import StepStats
from trtllm_vtoken.step.core import TableCore
from trtllm_vtoken.step.fused import FusedOutput, start_decode_step
from trtllm_vtoken.step.io import StepInput
from trtllm_vtoken.step.iteration import Iteration
from trtllm_vtoken.step.slots import LISTS, SlotMap, copied


class BesideHost:
    """The step's call on its worker: one call in flight at most, and the last one kept for
    repetition where nothing else reads the batch on the host's thread (``may_repeat``: no
    invariant checks, no background compaction; a victims hook runs after the call, with the block
    lists copied before it, as without repetition). ``policies``: the step's, as ``SlotMap.policy``
    indexes them; ``reduces``: the step reduces the mass across ranks (never repeated)."""

    def __init__(self, slots: SlotMap, core: TableCore, stats: StepStats, policies: list[EvictionPolicy],
                 may_repeat: bool, reduces: bool) -> None:
        self.slots, self.core, self.stats, self.policies = slots, core, stats, policies
        self.may_repeat, self.reduces = may_repeat, reduces
        self.worker = slots.native.DecodeWorker()
        self.repeated: RepeatedCall | None = None

    def start(self, it: Iteration, inp: StepInput, compaction: str, fragmentation_threshold: int,
              may_plan: np.ndarray | None, hooked: bool) -> None:
        """The call for the checked batch and its decision, started on the worker (``hooked``:
        the step has a victims hook); kept for repetition where the call decides itself and the
        host passed lists and no mass, or a mass array the call takes as it is, not reduced.
        ValueError/KeyError (``BatchRefused`` for the batch) as the worker's checks raise them,
        nothing started."""
        it.block_lists = self._lists_for_hook(it.rows, hooked)
        arguments = start_decode_step(self.worker, self.slots, self.core.table, it, compaction,
                                      fragmentation_threshold, inp.pressure, may_plan)
        decision = it.decision
        if self.may_repeat and not it.registered and it.offsets is None and decision.repeats and \
                decision.mass is inp.mass and (inp.mass is None or not self.reduces) and \
                type(inp.req_ids) in LISTS and type(inp.num_new) in LISTS:
            policy = self.policies[int(self.slots.policy[it.rows[0]])]  # the batch's one policy
            self.repeated = RepeatedCall.of(inp.req_ids, inp.num_new, self.slots, policy, arguments, it, self.worker)

    def repeat(self, inp: StepInput, shared: Collection[int], hooked: bool) -> Iteration | None:
        """Starts the call on the worker as the last one (``RepeatedCall``) where the host passes
        the same lists and nothing the skipped checks and decision read has changed (``shared``:
        the blocks shared now); returns its iteration. None: the whole path runs (``start``).
        ValueError/KeyError as ``start``."""
        last = self.repeated
        if last is None:
            return None
        block_lists = self._lists_for_hook(last.iteration.rows, hooked)  # before the call changes them
        needed = last.start_unchanged(inp, self.slots, shared, self.worker)
        if needed is None or needed:  # something changed, or the rows' lists outgrow the block table
            self.repeated = None
            return None
        return last.iteration.again(inp.new_blocks, inp.stream, block_lists)

    def wait(self) -> tuple[FusedOutput, float]:
        """The call in flight, completed: its output and its seconds on the worker. Raises what
        the call raised."""
        waited = time.perf_counter()
        fused, seconds = self.worker.wait()
        self.stats.waited_seconds += time.perf_counter() - waited
        self.stats.overlapped_steps += 1
        return FusedOutput(fused), seconds

    def _lists_for_hook(self, rows: np.ndarray, hooked: bool) -> tuple[np.ndarray, np.ndarray] | None:
        """With a victims hook, the rows' block lists copied before a call on the worker changes
        them: the hook sees them as the decision did (``Iteration.listed_before``)."""
        if not hooked:
            return None
        return self.slots.block_table[rows], self.slots.num_blocks_of[rows]


class RepeatedCall(NamedTuple):
    """A call started on the worker, kept for the same batch's next one. Valid while what the
    skipped work read is unchanged: the host's lists, the requests' rows, the layout's buffers,
    the policy's rule, whether any block is shared."""

    req_ids: list | tuple
    """The host's request ids and token counts then (copies), compared with the next step's."""
    num_new: list | tuple
    membership: int
    """``SlotMap.membership`` then: the same requests in the same rows."""
    layout: Any
    """``SlotMap.native_layout()`` then: no buffer replaced since."""
    policy: EvictionPolicy
    rule: BoundsRule
    """``policy.bounds_rule()`` then (kept by the policy until an attribute of it is set)."""
    mass_dtype: Any
    """The dtype of the host's mass array the call took (numpy), or None (the batch observes
    none): each repetition takes this step's array, of that dtype, one row per request."""
    bound: Any
    """The call's arguments but the new blocks and the pressure, bound once by the C++ core
    (``DecodeWorker.bind``: a call's own conversion of them costs the host's thread more than
    the rest of its work there)."""
    iteration: Iteration
    """The step between the call's start and its end: the batch as the call takes it (req_ids,
    rows, num_new int64 arrays) and the decision, made again for each repetition
    (``Iteration.again``)."""

    @classmethod
    def of(cls, req_ids: list | tuple, num_new: list | tuple, slots: SlotMap, policy: EvictionPolicy,
           arguments: tuple, it: Iteration, worker: Any) -> RepeatedCall:
        """From the host's lists and the call's arguments as ``fused.call_arguments`` made them
        (no may_plan, no victims). The mass, if any, is the host's own array (``BesideHost.start``
        checks that)."""
        mass = arguments[13]
        bound = worker.bind(*arguments[:5], *arguments[7:11], *arguments[12:16], arguments[17])
        iteration = Iteration(it.req_ids, it.rows, it.num_new, None, None, None, it.host_ids)
        iteration.decision = it.decision
        return cls(copied(req_ids), copied(num_new), slots.membership, arguments[0], policy, it.decision.rule,
                   None if mass is None else mass.dtype, bound, iteration)

    def start_unchanged(self, inp: StepInput, slots: SlotMap, shared: Collection[int], worker: Any) -> int | None:
        """This step's call, started where the host passes what it passed then (equal lists, new
        blocks one list per request, a mass array of the same dtype, one row per request, or
        none) and nothing the skipped work read has changed (``shared``: the blocks shared now):
        0 (started) or the block-table columns needed first, as ``DecodeWorker.start``. None:
        something changed, nothing started (the whole path runs). ``BatchRefused`` where the new
        blocks or the mass's width do not fit (nothing changed). One method, not three: each
        Python call on the host's thread costs a few microseconds after the host's own work."""
        mass, dtype = inp.mass, self.mass_dtype
        takes_mass = mass is None if dtype is None else (
            type(mass) is np.ndarray and mass.dtype == dtype and mass.ndim == 2 and len(mass) == len(self.req_ids)
            and mass.flags.c_contiguous)
        if not (takes_mass and inp.new_block_offsets is None and type(inp.req_ids) in LISTS and
                type(inp.num_new) in LISTS and inp.req_ids == self.req_ids and inp.num_new == self.num_new and
                slots.membership == self.membership and slots.native_layout() is self.layout and
                bool(len(shared)) == self.iteration.decision.skip_shared and self.policy.bounds_rule() is self.rule):
            return None
        return worker.repeat(self.bound, inp.new_blocks, inp.pressure, mass)
