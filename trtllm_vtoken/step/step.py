# SPDX-License-Identifier: Apache-2.0
"""``DecodeStep``: vToken's whole per-iteration work for a batch, in one call a host makes after
each forward (design: "One step for every host"). Its path, stage by stage, each stage one module,
is drawn in the package docstring (``step/__init__.py``); ``run`` is ``start`` then ``finish``.

Requests in one batch may follow different policies (``add_request(req, policy)``; None: the
request never evicts). The host owns the blocks: it allocates the new ones it passes in and frees
the ones the output lists; a new block that a request holds already is refused (ValueError)
unless shared. Shared blocks (prefix caching) are protected: no policy evicts their tokens (they
are kept on top of the budget), no plan moves in or out of them; several requests of one batch may
take the same shared block as a new block (a prefix cached by a request admitted just before
them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from trtllm_vtoken.core.native import batch_refused
from trtllm_vtoken.core.native import load as load_native
from trtllm_vtoken.policies import EvictionPolicy
from trtllm_vtoken.reclaim.copy import CopyExecutor
from trtllm_vtoken.reclaim.rerotate import KeyRerotation
from trtllm_vtoken.step import fused, spec
from trtllm_vtoken.step.background import background_for
from trtllm_vtoken.step.beside import BesideHost
from trtllm_vtoken.step.checks import StepChecks
from trtllm_vtoken.step.config import StepConfig, StepStats
from trtllm_vtoken.step.core import TableCore, make_core
from trtllm_vtoken.step.decide import BatchDecision, given
from trtllm_vtoken.step.io import StepInput, StepOutput
from trtllm_vtoken.step.iteration import InputChecks, Iteration
from trtllm_vtoken.step.end import StepEnd
from trtllm_vtoken.step.requests import StepRequests
from trtllm_vtoken.step.slots import SlotMap


class DecodeStep(StepRequests, StepEnd):
    """One step for every host. See the module docstring; its tables' queries: ``TableQueries``.

    Args:
        num_blocks: Blocks in the host's pool (block ids lie in [0, num_blocks)).
        policy: The default policy (None: requests never evict unless given one).
        executor: Copies KV for the moves; None for metadata-only hosts (no KV tensors).
        is_shared / shared_blocks: Prefix caching: whether a block is shared, and the set of shared
            blocks now. Default: nothing is ever shared.
        reduce_mass: Applied to the batch's mass [B, L] before any policy sees it: tensor /
            pipeline parallelism sums it over the ranks here, so every rank decides alike.
        rerotation: Position-shift mode's pass over the same KV pools (None: keep positions).
        on_victims: Called with (req_ids, victim_offsets, victim_ids, block_ids) when the batch
            evicts: the victims in the ``StepOutput`` CSR form, and ``block_ids(req)``, each
            request's block list as the decision saw it. For prefix caching's cut. It runs on the
            host's thread, before the step completes and before its blocks are freed: inside the
            call made at once, between the decision and the token table; after the call made on
            the worker. It must not change the shared blocks.
    """

    def __init__(self, config: StepConfig, num_blocks: int, tokens_per_block: int,
                 policy: EvictionPolicy | None = None, executor: CopyExecutor | None = None,
                 is_shared: Callable[[int], bool] | None = None,
                 shared_blocks: Callable[[], Collection[int]] | None = None,
                 reduce_mass: Callable[[np.ndarray], np.ndarray] | None = None,
                 rerotation: KeyRerotation | None = None,
                 on_victims: Callable[[np.ndarray, np.ndarray, np.ndarray, Callable[[int], list[int]]], None]
                 | None = None) -> None:
        self.config = config
        self.on_victims = on_victims
        self.rerotation = rerotation
        self.tokens_per_block = tokens_per_block
        self.is_shared = is_shared or (lambda block_id: False)
        self.shared_blocks = shared_blocks or (lambda: ())
        self.core: TableCore = make_core(config.impl, tokens_per_block, self.is_shared)
        self.impl = self.core.impl
        native = self.impl == "cpp"
        self.slots = SlotMap(num_blocks, tokens_per_block, load_native() if native else None)
        self.executor = executor
        self.policy = policy
        self.stats = StepStats()
        self.checks = StepChecks(self.core, self.slots, executor, self.is_shared, self.stats) \
            if config.check_invariants else None
        self.background = background_for(self.core, self.slots, executor) if config.background else None
        self._policies: list[EvictionPolicy] = []
        self.input_checks = InputChecks(self.slots, self._policies, self.is_shared,
                                        None if native else self.core.table.block_holders)
        self.decision = BatchDecision(self.slots, self._policies, tokens_per_block,
                                      self.core.table if native else None, reduce_mass, self.stats,
                                      config.pass_threads(), config.pass_threads(beside_host=True))
        self._call = fused.decode_step if native else spec.decode_step
        """The step's call: the C++ core's one native call, or its Python specification."""
        self._beside: BesideHost | None = None  # the call on the worker (C++ core), made when first asked for
        self._policy_of: dict[int, int] = {}  # request -> index into _policies (absent: never evicts)
        self._following: dict[int, int] = {}  # policy index (-1: none) -> requests that follow it
        self._broken: str | None = None
        self._flight: Iteration | None = None  # started on the worker thread, not yet waited for
        self._landed: StepOutput | None = None  # completed, not yet handed over by finish()
        self._called: tuple[StepOutput, float] | None = None  # made here, its copy waiting for settle
        if policy is not None:
            self.policy_index(policy)

    # ---- the step ------------------------------------------------------------------------------
    def run(self, inp: StepInput) -> StepOutput:
        """One iteration of the batch (``start`` then ``finish``). Raises ValueError/KeyError for
        bad input (nothing changed); RuntimeError if the token table refused the step midway (the
        step is then unusable)."""
        self.start(inp)
        return self.finish()

    def start(self, inp: StepInput, overlap: bool = False, forward_between: bool = False) -> None:
        """Begins an iteration: checks the input (errors as ``run``, nothing changed), decides
        and makes the call. ``overlap``: with the C++ core the call runs on the step's worker
        thread (the victims hook right after it), registering the new tokens first as it does at
        once, and this returns; the host goes on with work that does not touch the step
        (sampling the batch) and then calls ``finish``:

            host     start ── sampling, outputs ─────────────────── finish ── copy, output
            worker        └── register, decide, table step, layout ┘

        Any other use of the step in between (a query, a request added or removed) waits for the
        call first. Otherwise the whole step runs here. ``forward_between``: the host launches a
        forward between ``start`` and ``finish`` that writes the batch's newest tokens (the
        overlap scheduler's, ``runtime/overlap.py``): the copy, and I1's reading of the KV, wait
        for ``finish`` wherever the call runs. RuntimeError if a step started before has not been
        finished."""
        if self._flight is not None or self._landed is not None:
            raise RuntimeError("the step started last has not been finished")
        if self._broken:
            raise RuntimeError(f"the step is unusable after an earlier failure: {self._broken}")
        beside = overlap and self.impl == "cpp"
        try:
            if beside and self._beside is not None and self._beside.repeated is not None and self._repeat(inp):
                return  # 0. the last call started again
            it = self._begin(inp, beside)  # 1-2. the checked batch, its decision
            if beside:  # 3. the call, on the worker (``settle`` ends the step) or here
                self._start_beside(it, inp)
            elif forward_between:  # the call here, its copy after the host's forward
                self._called, self._flight = self._call_here(it), it
            else:
                self._landed = self._end(it, self._call_here(it))
        except batch_refused() as exc:  # the C++ core's checks of the batch, before anything changed
            raise ValueError(str(exc)) from None  # as the Python core says it

    def finish(self) -> StepOutput:
        """The iteration ``start`` began, completed: what ``run`` returns. RuntimeError if none
        was started, or what the call on the worker raised (the step is then unusable)."""
        self.settle()
        out, self._landed = self._landed, None
        if out is None:
            raise RuntimeError("no step was started")
        return out

    def settle(self) -> None:
        """Waits for a step's call on the worker thread (``start`` with overlap) and completes
        the step; ``finish`` hands its output over. Every query and request change calls it."""
        it = self._flight
        if it is None:
            return
        self._flight = None
        called, self._called = self._called, None
        self._landed = self._end(it, called if called is not None else self._guarded(self._beside.wait))

    def _begin(self, inp: StepInput, beside: bool) -> Iteration:
        """1. The input's checks (``step/iteration.py``); 2. the decision (``step/decide.py``):
        the C++ core's call makes it itself where it can, else it is made here, in Python. The
        call registers the batch itself unless something on this thread reads the registered
        layout before it: a mass function (the simulated attention), the invariant checks, a
        decision made here (and the Python core's call takes a registered batch)."""
        clock, stats = time.perf_counter, self.stats
        t0 = clock()
        it = self.input_checks.validated(inp)
        shared = self.shared_blocks()
        self.core.sync_shared(shared)
        mass, new_slots = inp.mass, None
        if self.impl == "python" or callable(mass) or self.checks is not None:
            new_slots = self._register(it)
        t1, mass_seconds = clock(), stats.mass_seconds
        try:
            decision = None if self.impl == "python" else \
                self.decision.native_decision(it.rows, mass, shared, self.sole_policy(), beside)
            if decision is None:  # decided here
                if not it.registered:
                    new_slots = self._register(it)
                decision = given(*self.decision.victims(it.req_ids, it.rows, mass, shared, it.unobserved))
        except Exception as exc:
            # A bad mass function's result (BadMass: a function's mass registers the batch first),
            # or a failure in the mass function or the cross-rank sum: once the new tokens are
            # registered the step cannot go on. Before, nothing changed (the call registers them
            # itself) and the step stays usable.
            if it.registered:
                self._broken = str(exc)
            raise
        it.decision = decision
        t2 = clock()
        it.before = self.checks.before(it.req_ids, new_slots, it.num_new) if self.checks else None
        stats.seconds["table"] += t1 - t0
        stats.seconds["policy"] += t2 - t1 - (stats.mass_seconds - mass_seconds)  # not the simulated attention
        stats.seconds["checks"] += clock() - t2
        return it

    def _register(self, it: Iteration) -> np.ndarray | None:
        """The batch's new blocks and tokens join the layout on this thread (checked first); their
        slots where the invariant checks read them. The C++ core takes the host's lists as they
        are; the Python core's checks converted them to CSR already."""
        registered = self.slots.add_tokens(it.rows, it.offsets, it.blocks, it.num_new, it.req_ids, self.core.table,
                                           self.checks is not None)
        it.registered = True
        return registered

    def _call_here(self, it: Iteration) -> tuple[StepOutput, float]:
        """3. The step's call on this thread (``step/fused.py`` or ``step/spec.py``), and its seconds."""
        start = time.perf_counter()
        compaction, may_plan = self._call_settings(it.req_ids)
        out = self._guarded(self._call, self.slots, self.core.table, it, compaction,
                            self.config.fragmentation_threshold, it.pressure,
                            self._on_victims if self.on_victims else None, may_plan)
        return out, time.perf_counter() - start

    def _start_beside(self, it: Iteration, inp: StepInput) -> None:
        """3. The step's call on the worker (``step/beside.py``); ``settle`` completes the step."""
        if self._beside is None:
            self._beside = BesideHost(self.slots, self.core, self.stats, self._policies,
                                      self.checks is None and self.background is None,
                                      self.decision.reduce_mass is not None)
        compaction, may_plan = self._call_settings(it.req_ids)
        self._guarded(self._beside.start, it, inp, compaction, self.config.fragmentation_threshold, may_plan,
                      self.on_victims is not None)
        self._flight = it

    def _repeat(self, inp: StepInput) -> bool:
        """0. The call on the worker started as the last step's (``RepeatedCall``) where the host
        passes the same lists and nothing the skipped checks and decision read has changed.
        False: the whole path runs."""
        started = time.perf_counter()
        shared = self.shared_blocks()
        self.core.sync_shared(shared)
        it = self._guarded(self._beside.repeat, inp, shared, self.on_victims is not None)
        if it is None:
            return False
        self._flight = it
        self.stats.repeated_steps += 1
        self.stats.seconds["table"] += time.perf_counter() - started
        return True

    # ---- private -------------------------------------------------------------------------------
    def _call_settings(self, req_ids: np.ndarray) -> tuple[str, np.ndarray | None]:
        """The call's compaction and, with background compaction, the requests it may plan."""
        background = self.background
        if background is None:
            return self.config.compaction, None
        return "lazy-deferred", background.may_plan(req_ids)

    def _guarded(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``, which reaches the token table. The batch's own checks' refusal
        (``BatchRefused``: nothing changed) goes to the host as it is, and so does a victims hook's
        failure; any other ValueError/KeyError is the table refusing the step midway (the new tokens
        registered): RuntimeError, and the step is unusable from now on."""
        try:
            return call(*args)
        except batch_refused():
            raise
        except (KeyError, ValueError) as exc:
            if self._broken:  # the victims hook failed inside the call: its own error
                raise
            if self._beside is not None:
                self._beside.repeated = None
            self._broken = f"the token table refused a step: {exc}"
            raise RuntimeError(self._broken) from exc

    def _on_victims(self, req_ids: np.ndarray, victim_offsets: np.ndarray, victim_ids: np.ndarray,
                    block_ids: Callable[[int], list[int]] | None = None) -> None:
        """The victims hook, with the block lists before the table's step (default: the layout's
        now, when the table has not stepped yet); if it fails, the step (its new tokens
        registered) is unusable, and its error goes to the host as it is."""
        try:
            self.on_victims(req_ids, victim_offsets, victim_ids, block_ids or self.block_ids)
        except Exception as exc:
            self._broken = f"the victims hook failed: {exc}"
            raise
