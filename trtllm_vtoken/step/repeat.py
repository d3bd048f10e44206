# SPDX-License-Identifier: Apache-2.0
"""The fused call on the worker repeated for the same batch. A decode loop passes the same lists
step after step; while nothing the step's checks and decision read has changed, the next call
starts from the last one's arguments with this step's new blocks and pressure, and no Python
work between: on the host's thread each Python call and numpy object costs a multiple of its
warm time (``benchmarks/step/cold_host``). The C++ core still checks the new blocks and tokens.

A batch that observes attention repeats where the host hands the same mass buffer every step,
rewritten in place (a CUDA-graph host's static output staged to one host buffer), or a new numpy
array each step (a forward's output copied to the host), each as the call took the first (C
order, one row per request, of the first one's dtype, float32 or float64; no ``reduce_mass``): the
call reads this step's when it runs, and the C++ core checks its width against the rows' lengths
at each repetition. A torch tensor, a reduced or converted mass takes the whole path.
``tests/step/test_step_repeat.py`` holds each to the whole path."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, NamedTuple

import numpy as np

from trtllm_vtoken.policies import EvictionPolicy
from trtllm_vtoken.policies.budget import BoundsRule
from trtllm_vtoken.step.decide import NativeDecision
from trtllm_vtoken.step.io import StepInput
from trtllm_vtoken.step.iteration import Iteration
from trtllm_vtoken.step.slots import LISTS, SlotMap, copied


class RepeatedCall(NamedTuple):
    """A call started on the worker, kept for the same batch's next one (``DecodeStep.start``).
    Valid while what the skipped work read is unchanged: the host's lists, the requests' rows,
    the layout's buffers, the policy's rule, whether any block is shared."""

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
    rows, num_new int64 arrays) and the decision (``native``), made again for each repetition
    (``Iteration.again``)."""

    @classmethod
    def of(cls, req_ids: list | tuple, num_new: list | tuple, slots: SlotMap, policy: EvictionPolicy,
           arguments: tuple, decision: NativeDecision, worker: Any) -> RepeatedCall:
        """From the host's lists and the call's arguments as ``start_decide_and_step`` made them
        (``fused_arguments``, then skip_shared, threads, may_plan, num_blocks; no may_plan). The
        mass, if any, is the host's own array (``DecodeStep`` checks that)."""
        mass = arguments[13]
        bound = worker.bind(*arguments[:5], *arguments[7:11], *arguments[12:16], arguments[17])
        iteration = Iteration(*arguments[2:5], None, None, None)
        iteration.native, iteration.registers = decision, True
        return cls(copied(req_ids), copied(num_new), slots.membership, arguments[0], policy, decision.rule,
                   None if mass is None else mass.dtype, bound, iteration)

    def start_unchanged(self, inp: StepInput, slots: SlotMap, shared: Collection[int], worker: Any) -> int | None:
        """This step's call, started where the host passes what it passed then (equal lists, new
        blocks one list per request, a mass array of the same dtype, one row per request, or
        none) and nothing the skipped work read has changed (``shared``: the blocks shared now):
        0 (started) or the block-table columns needed first, as ``DecodeWorker.start``. None: something changed, nothing started
        (the whole path runs). ``BatchRefused`` where the new blocks or the mass's width do not fit
        (nothing changed). One method, not three: each Python call on the host's thread costs a
        few microseconds after the host's own work."""
        mass, dtype = inp.mass, self.mass_dtype
        takes_mass = mass is None if dtype is None else (
            type(mass) is np.ndarray and mass.dtype == dtype and mass.ndim == 2 and len(mass) == len(self.req_ids)
            and mass.flags.c_contiguous)
        if not (takes_mass and inp.new_block_offsets is None and type(inp.req_ids) in LISTS and
                type(inp.num_new) in LISTS and inp.req_ids == self.req_ids and inp.num_new == self.num_new and
                slots.membership == self.membership and slots.native_layout() is self.layout and
                bool(len(shared)) == self.iteration.native.skip_shared and self.policy.bounds_rule() is self.rule):
            return None
        return worker.repeat(self.bound, inp.new_blocks, inp.pressure, mass)
