# SPDX-License-Identifier: Apache-2.0
"""``DecodeStep``: vToken's whole per-iteration work for a batch, in one call a host makes after
each forward (design: "One step for every host").

    run(StepInput)
      1. register   the new tokens and blocks (batch layout: slots, block rows, counters)
      2. decide     per policy group: mass (optionally reduced across ranks), observe, select,
                    all vectorised over [requests, positions]
      3. table      one call of the token-table core: append, evict, plan (dense / lazy), commit
                    (C++ where built: ``cpp/core/batch.cpp``; else ``reclaim/step_batch.py``)
      4. copy       ONE copy of every request's moves through the copy executor, ordered before
                    the host's next forward (I3)
      5. shift      with a re-rotation pass (position-shift mode): every surviving key of a request
                    whose length shrank is turned back by the tokens it lost (reclaim/rerotate.py)
      6. out        victims, moves, freed blocks, refreshed lengths, lost lengths (``StepOutput``)

``run`` is ``start`` then ``finish``. A host with work of its own between the forward and its next
iteration (the engine's sampling) calls ``start(inp, overlap=True)``: where the fused native call
serves the batch, steps 2-3 run on the step's worker thread until ``finish`` (or any query) waits
for them; the batch's checks and steps 4-6 stay on the host's thread. The fused call (at once or
on the worker) makes step 1's registration too, unless something on the host's thread reads the
registered layout before it (a mass function, the invariant checks). The call beside the host:
``step/beside.py``; the general path's numpy around the token table: ``step/general.py``.

Requests in one batch may follow different policies (``add_request(req, policy)``; None: the
request never evicts). The host owns the blocks: it allocates the new ones it passes in and frees
the ones the output lists. Shared blocks (prefix caching) are protected: no policy evicts their
tokens (they are kept on top of the budget), no plan moves in or out of them; several requests of
one batch may take the same shared block as a new block (a prefix cached by a request admitted
just before them). ``on_victims`` sees the victims after the decision, with the block lists the
decision saw: a prefix cache ends a request's cached chain there, before any of its blocks whose
content compaction changes can be shared (at once: before the token table's step; beside the host:
right after the call, before the step completes).
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
from trtllm_vtoken.step.background import background_for
from trtllm_vtoken.step.beside import CallBesideHost
from trtllm_vtoken.step.checks import StepChecks
from trtllm_vtoken.step.config import CORE_PARTS, StepConfig, StepStats
from trtllm_vtoken.step.core import TableCore, make_core
from trtllm_vtoken.step.decide import BadMass, BatchDecision
from trtllm_vtoken.step.fused import FusedOutput, decide_and_step
from trtllm_vtoken.step.general import GeneralPath
from trtllm_vtoken.step.input_checks import InputChecks
from trtllm_vtoken.step.io import StepInput, StepOutput
from trtllm_vtoken.step.iteration import Iteration
from trtllm_vtoken.step.repeat import RepeatedCall
from trtllm_vtoken.step.requests import StepRequests
from trtllm_vtoken.step.slots import SlotMap


class DecodeStep(CallBesideHost, StepRequests):
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
        self.fuses = self.impl == "cpp" and config.fused
        """A batch may take the fused native call (``step/fused.py``)."""
        self.slots = SlotMap(num_blocks, tokens_per_block, load_native() if self.impl == "cpp" else None)
        self.executor = executor
        self.policy = policy
        self.stats = StepStats()
        self.checks = StepChecks(self) if config.check_invariants else None
        self.background = background_for(self) if config.background else None
        self.general = GeneralPath(self.slots, self.core, config, self.background)
        self._policies: list[EvictionPolicy] = []
        self.input_checks = InputChecks(self.slots, self._policies, self.is_shared, self.impl == "python")
        self.decision = BatchDecision(self.slots, self._policies, tokens_per_block,
                                      self.core.table if self.impl == "cpp" else None, reduce_mass, self.stats,
                                      config.pass_threads(), config.pass_threads(beside_host=True))
        self._policy_of: dict[int, int] = {}  # request -> index into _policies (absent: never evicts)
        self._following: dict[int, int] = {}  # policy index (-1: none) -> requests that follow it
        self._broken: str | None = None
        self._flight: Iteration | None = None  # started on the worker thread, not yet waited for
        self._landed: StepOutput | None = None  # completed, not yet handed over by finish()
        self._native_worker = None
        self._may_repeat = self.fuses and self.checks is None and self.background is None
        """A call on the worker may be repeated for the same batch (``RepeatedCall``): no checks or
        background compaction read the batch on the host's thread (a victims hook runs after the
        call, with the block lists copied before it, as on the whole path)."""
        self._repeated: RepeatedCall | None = None
        if policy is not None:
            self.policy_index(policy)

    # ---- the step ------------------------------------------------------------------------------
    def run(self, inp: StepInput) -> StepOutput:
        """One iteration of the batch (``start`` then ``finish``). Raises ValueError/KeyError for
        bad input (nothing changed); RuntimeError if the token table refused the step midway (the
        step is then unusable)."""
        self.start(inp)
        return self.finish()

    def start(self, inp: StepInput, overlap: bool = False) -> None:
        """Begins an iteration: checks the input (errors as ``run``, nothing changed), registers
        the new tokens and prepares the decision. ``overlap``: where the fused native call serves
        the batch, the call runs on the step's worker thread (the victims hook right after it),
        registering the new tokens first as it does at once, and this returns; the host goes on
        with work that does not touch the step (sampling the batch) and then calls ``finish``:

            host     start ── sampling, outputs ─────────────────── finish ── copy, output
            worker        └── register, decide, table step, layout ┘

        Any other use of the step in between (a query, a request added or removed) waits for the
        call first. Otherwise the whole step runs here. RuntimeError if a step started before
        has not been finished."""
        if self._flight is not None or self._landed is not None:
            raise RuntimeError("the step started last has not been finished")
        if self._broken:
            raise RuntimeError(f"the step is unusable after an earlier failure: {self._broken}")
        try:
            if not (overlap and self._repeat(inp)):
                self._start(inp, overlap)
        except batch_refused() as exc:  # the C++ core's checks of the batch, before anything changed
            raise ValueError(str(exc)) from None  # as the Python core says it

    def _start(self, inp: StepInput, overlap: bool) -> None:
        it = self._begin(inp, overlap)
        if it.native is not None and overlap:
            self._start_beside(it, inp)
        else:
            self._landed = self._end(it, self._table_step(it, inp.pressure))

    def finish(self) -> StepOutput:
        """The iteration ``start`` began, completed: what ``run`` returns. RuntimeError if none
        was started, or what the call on the worker raised (the step is then unusable)."""
        self.settle()
        out, self._landed = self._landed, None
        if out is None:
            raise RuntimeError("no step was started")
        return out

    def _begin(self, inp: StepInput, overlap: bool = False) -> Iteration:
        """Checks, registration (unless the fused call makes it), the decision (the general path:
        its victims too); ``overlap``: a fused call will run on the worker."""
        clock, stats = time.perf_counter, self.stats
        t0 = clock()
        req_ids, rows, num_new, block_offsets, new_blocks = self.input_checks.validated(inp)
        shared = self.shared_blocks()
        self.core.sync_shared(shared)
        it = Iteration(req_ids, rows, num_new, block_offsets, new_blocks, inp.stream)
        # The fused call registers the batch itself, unless something on this thread reads the
        # registered layout first: a mass function (the simulated attention) or the checks.
        it.registers = self.fuses and not callable(inp.mass) and self.checks is None
        new_slots = None if it.registers else self._register(it)
        t1, mass_seconds = clock(), stats.mass_seconds
        try:
            it.native = (self.decision.native_decision(rows, inp.mass, shared, self.sole_policy(), overlap)
                         if self.fuses else None)
            if it.native is None:
                if it.registers:  # the general path after all: it registers here
                    it.registers, new_slots = False, self._register(it)
                victim_index, victim_pos = self.decision.victims(req_ids, rows, inp.mass, shared)
        except BadMass as exc:  # the new tokens are registered already: the step cannot go on
            self._broken = str(exc)
            raise
        if it.native is None or self.background:
            it.length = self.slots.kv_len[rows] + num_new if it.registers else self.slots.kv_len[rows]
        if it.native is None:
            it.victims = self.general.victims(rows, victim_index, victim_pos)
            if self.on_victims is not None and len(victim_index):  # before the table's step
                self._on_victims(req_ids, *it.victims[2:])
        t2 = clock()
        it.before = self.checks.before(req_ids, new_slots, num_new) if self.checks else None
        stats.seconds["table"] += t1 - t0
        stats.seconds["policy"] += t2 - t1 - (stats.mass_seconds - mass_seconds)  # not the simulated attention
        stats.seconds["checks"] += clock() - t2
        return it

    def _register(self, it: Iteration) -> np.ndarray | None:
        """The batch's new blocks and tokens join the layout (checked first); their slots where
        the invariant checks read them. The C++ core takes the host's lists as they are; the
        Python core's table step reads CSR too, so the iteration converts them once for both."""
        offsets, blocks = it.new_blocks_csr() if self.slots.native is None else (it.offsets, it.blocks)
        return self.slots.add_tokens(it.rows, offsets, blocks, it.num_new, it.req_ids, self.core.table,
                                     self.checks is not None)

    def _table_step(self, it: Iteration, pressure: bool) -> tuple[Any, float]:
        """The token table's step here: the fused call (a ``FusedOutput``) or the general path's
        (a ``StepBatchResult``), and its seconds."""
        start = time.perf_counter()
        compaction, may_plan = self._call_settings(it.req_ids)
        try:
            if it.native is not None:
                result = decide_and_step(self.slots, self.core.table, it.req_ids, it.rows, it.num_new, it.offsets,
                                         it.blocks, it.native, compaction, self.config.fragmentation_threshold,
                                         pressure, self._on_victims if self.on_victims else None, may_plan,
                                         it.registers)
            else:
                result = self.general.table_step(it, compaction, pressure, may_plan)
        except batch_refused():  # the fused call's checks of the batch it registers: nothing changed
            raise
        except (KeyError, ValueError) as exc:
            if self._broken:  # the victims hook failed inside the fused call: its own error
                raise
            raise self._refused(exc) from exc
        return result, time.perf_counter() - start

    def _end(self, it: Iteration, stepped: tuple[Any, float]) -> StepOutput:
        """After the table's step: the layout follows (general path, background), the copy, the
        re-rotation, the output and the counters."""
        clock, stats, seconds = time.perf_counter, self.stats, self.stats.seconds
        result, seconds["core"] = stepped[0], seconds["core"] + stepped[1]
        req_ids, background, stream = it.req_ids, self.background, it.stream
        t4 = clock()
        fused = isinstance(result, FusedOutput)
        if fused:  # the output itself, its parts made when read
            out, changed, num_changed, copied = result, None, result.num_changed, result.num_moves
            stats.fused_steps += 1
            for name, part in zip(CORE_PARTS, result.seconds):  # of "core": the call's own clocks
                stats.core_parts[name] += part
            if it.block_lists is not None and out.num_evicted:  # the call ran on the worker: the hook now
                self._on_victims(req_ids, out.victim_offsets, out.victims, it.listed_before)
        else:
            copied = len(result.move_src)
        if not fused or background:  # the layout follows the table, numpy makes the output
            victim_offsets, victims, planned = (out.victim_offsets, out.victims, out.table) if fused else \
                (*it.victims[2:], result)
            try:
                table = self.general.follow(it, planned, fused)
            except RuntimeError as exc:  # a background plan could not commit: the tables disagree now
                self._broken = str(exc)
                raise
            t5 = clock()
            handle = (background.start(req_ids, planned, self.checks is not None) if background
                      else self._submit_copy(table.move_src, table.move_dst, stream))
            t6 = clock()
            out, changed = self.general.output(it, victim_offsets, victims, table)
            num_changed = int(np.count_nonzero(changed))
        else:
            t5 = t4
            handle = self._submit_copy(*out.moved_slots(), stream) if copied else None  # no moves: no parts made
            t6 = clock()
        out.req_ids = self.input_checks.read_only_ids(req_ids)  # the step may reuse the array (``LastList``)
        out.copy = handle
        if self.checks:  # I1 on the relocated keys, before they turn
            self.checks.after(out, it.before, (out.changed if changed is None else changed).astype(bool))
        t7 = clock()
        if self.rerotation is not None and out.lost.any():
            self.rerotation.shift_requests(self.core, dict(zip(req_ids.tolist(), out.lost.tolist())), stream)
        t8 = clock()
        stats.steps += 1
        stats.tokens_evicted += out.num_evicted
        stats.compactions += num_changed
        stats.moves += out.num_moves
        stats.blocks_freed += out.num_freed
        if copied and self.executor is not None:
            stats.bytes_copied += copied * self.executor.bytes_per_move()
        seconds["table"] += t5 - t4
        seconds["copy"] += t6 - t5
        seconds["checks"] += t7 - t6
        seconds["rerotate"] += t8 - t7
        return out

    # ---- private -------------------------------------------------------------------------------
    def _call_settings(self, req_ids: np.ndarray) -> tuple[str, np.ndarray | None]:
        """The table step's compaction and, with background compaction, the requests it may plan."""
        background = self.background
        if background is None:
            return self.config.compaction, None
        return "lazy-deferred", background.may_plan(req_ids)

    def _refused(self, exc: Exception) -> RuntimeError:
        """The token table refused a step midway: the step is unusable from now on."""
        self._repeated = None
        self._broken = f"the token table refused a step: {exc}"
        return RuntimeError(self._broken)

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

    def _submit_copy(self, move_src: np.ndarray, move_dst: np.ndarray, stream: Any) -> Any:
        """ONE copy of every move (source and destination slots), ordered before the host's next
        forward (I3); None if none."""
        return None if self.executor is None else self.executor.submit_before(move_src, move_dst, stream)
