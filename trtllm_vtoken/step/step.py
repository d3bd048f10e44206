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

Requests in one batch may follow different policies (``add_request(req, policy)``; None: the
request never evicts). The host owns the blocks: it allocates the new ones it passes in and frees
the ones the output lists. Shared blocks (prefix caching) are protected: no policy evicts their
tokens (they are kept on top of the budget), no plan moves in or out of them; several requests of
one batch may take the same shared block as a new block (a prefix cached by a request admitted
just before them). ``on_victims`` runs between the decision and the token table: a prefix cache
ends a request's cached chain there, before compaction may write into its blocks.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from trtllm_vtoken.core.native import load as load_native
from trtllm_vtoken.policies import EvictionPolicy
from trtllm_vtoken.reclaim.copy import CopyExecutor
from trtllm_vtoken.reclaim.rerotate import KeyRerotation
from trtllm_vtoken.step.background import BackgroundCompaction
from trtllm_vtoken.step.checks import StepChecks
from trtllm_vtoken.step.config import StepConfig, StepStats
from trtllm_vtoken.step.core import TableCore, make_core
from trtllm_vtoken.step.decide import BadMass, BatchDecision
from trtllm_vtoken.step.io import StepInput, StepOutput
from trtllm_vtoken.step.slots import SlotMap

DEFAULT = object()
"""``add_request``'s policy argument: the step's default policy."""


class DecodeStep:
    """One step for every host. See the module docstring.

    Args:
        num_blocks: Blocks in the host's pool (block ids lie in [0, num_blocks)).
        policy: The default policy (None: requests never evict unless given one).
        executor: Copies KV for the moves; None for metadata-only hosts (no KV tensors).
        is_shared / shared_blocks: Prefix caching: whether a block is shared, and the set of shared
            blocks now. Default: nothing is ever shared.
        reduce_mass: Applied to the batch's mass [B, L] before any policy sees it: tensor /
            pipeline parallelism sums it over the ranks here, so every rank decides alike.
        rerotation: Position-shift mode's pass over the same KV pools (None: keep positions).
        on_victims: Called with (req_ids, victim_offsets, victim_ids) (the ``StepOutput`` CSR form)
            after the batch's decision, before the token table evicts and compacts; for prefix
            caching's cut. It must not change the shared blocks.
    """

    def __init__(self, config: StepConfig, num_blocks: int, tokens_per_block: int,
                 policy: EvictionPolicy | None = None, executor: CopyExecutor | None = None,
                 is_shared: Callable[[int], bool] | None = None,
                 shared_blocks: Callable[[], Collection[int]] | None = None,
                 reduce_mass: Callable[[np.ndarray], np.ndarray] | None = None,
                 rerotation: KeyRerotation | None = None,
                 on_victims: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None) -> None:
        self.config = config
        self.on_victims = on_victims
        self.rerotation = rerotation
        self.tokens_per_block = tokens_per_block
        self.is_shared = is_shared or (lambda block_id: False)
        self.shared_blocks = shared_blocks or (lambda: ())
        self.core: TableCore = make_core(config.impl, tokens_per_block, self.is_shared)
        self.impl = self.core.impl
        self.slots = SlotMap(num_blocks, tokens_per_block, load_native() if self.impl == "cpp" else None)
        self.executor = executor
        self.policy = policy
        self.stats = StepStats()
        self.checks = StepChecks(self) if config.check_invariants else None
        self.background = BackgroundCompaction(self) if config.background else None
        self._policies: list[EvictionPolicy] = []
        self.decision = BatchDecision(self.slots, self._policies, tokens_per_block,
                                      self.core.table if self.impl == "cpp" else None, reduce_mass, self.stats)
        self._policy_of: dict[int, int] = {}  # request -> index into _policies (absent: never evicts)
        self._pushed_shared: frozenset[int] = frozenset()
        self._broken: str | None = None
        if policy is not None:
            self._policy_index(policy)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, req_id: int, policy: Any = DEFAULT) -> None:
        """A new request, with no tokens yet (its first ``run`` registers its prompt)."""
        chosen = self.policy if policy is DEFAULT else policy
        self.core.add_request(req_id)
        row = self.slots.add_request(req_id)
        if chosen is not None:
            self._policy_of[req_id] = self.slots.policy[row] = self._policy_index(chosen)

    def remove_request(self, req_id: int) -> list[int]:
        """Forgets the request; returns its block list, which the host frees in its pool."""
        if self.background is not None:
            self.background.drop(req_id)
        blocks = self.core.remove_request(req_id)
        self.slots.remove_request(req_id, blocks, self.is_shared)
        index = self._policy_of.pop(req_id, None)
        if index is not None:
            self._policies[index].forget(req_id)
        return blocks

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.slots.row_of

    def request_ids(self) -> list[int]:
        return self.core.request_ids()

    def relocating_blocks(self) -> set[int]:
        """Blocks that background compactions in flight read, write or will release: a prefix
        cache must not share them until they commit."""
        return self.background.blocks(self.tokens_per_block) if self.background is not None else set()

    def policy_of(self, req_id: int) -> EvictionPolicy | None:
        index = self._policy_of.get(req_id)
        return None if index is None else self._policies[index]

    def observes_attention(self, req_ids: Collection[int] | None = None) -> bool:
        """Does any of these requests' policies (default: any policy) need the attention mass?"""
        if req_ids is None:
            return any(p.observes_attention() for p in self._policies)
        return any(self._policies[self._policy_of[r]].observes_attention() for r in req_ids if r in self._policy_of)

    # ---- queries (the table's) ---------------------------------------------------------------------
    def kv_len(self, req_id: int) -> int:
        return int(self.slots.kv_len[self.slots.row_of[req_id]])

    def num_tokens(self, req_id: int) -> int:
        return int(self.slots.num_tokens[self.slots.row_of[req_id]])

    def num_live(self, req_id: int) -> int:
        return int(self.slots.num_live[self.slots.row_of[req_id]])

    def num_blocks(self, req_id: int) -> int:
        return int(self.slots.num_blocks_of[self.slots.row_of[req_id]])

    def counters(self, req_ids: Collection[int]) -> tuple[list[int], list[int], list[int]]:
        """(logical lengths, live tokens, blocks held) of the requests, read at once."""
        rows = self.slots.rows(req_ids)
        slots = self.slots
        return slots.num_tokens[rows].tolist(), slots.num_live[rows].tolist(), slots.num_blocks_of[rows].tolist()

    def block_ids(self, req_id: int) -> list[int]:
        row = self.slots.row_of[req_id]
        return self.slots.block_table[row, : self.slots.num_blocks_of[row]].tolist()

    def block_rows(self, req_ids: Collection[int]) -> np.ndarray:
        """[B, nb] int32: the requests' block lists, padded with ``num_blocks`` (a scratch id)."""
        return self.slots.block_rows(self.slots.rows(req_ids))

    def batch_tokens(self, req_ids: Collection[int]) -> np.ndarray:
        """[B, L] int32: the live logical id at each physical position of each request, -1 where
        none (what the attention of a masked kernel may read)."""
        return self.slots.gather(self.slots.tokens, self.block_rows(req_ids))

    def live_tokens(self, req_id: int) -> np.ndarray:
        """The request's live logical ids, ascending (int64)."""
        return self.core.live_slots(req_id)[0]

    def token_stats(self, req_id: int, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(live ids ascending, the per-slot statistic ``name`` of each): what a policy has
        accumulated for the request's tokens (e.g. H2O's "mass")."""
        ids, slots = self.core.live_slots(req_id)
        return ids, self.slots.stats[name][slots]

    def metadata_bytes_per_token(self) -> float:
        return self.core.metadata_bytes_per_token()

    # ---- the step ------------------------------------------------------------------------------
    def run(self, inp: StepInput) -> StepOutput:
        """One iteration of the batch. Raises ValueError/KeyError for bad input (nothing changed);
        RuntimeError if the token table refused the step midway (the step is then unusable)."""
        if self._broken:
            raise RuntimeError(f"the step is unusable after an earlier failure: {self._broken}")
        clock, seconds = time.perf_counter, self.stats.seconds
        t0 = clock()
        req_ids, rows, num_new, block_offsets, new_blocks = self._validated(inp)
        self._push_shared()
        length = self.slots.kv_len[rows] + num_new
        background = self.background
        new_slots = self.slots.add_tokens(rows, block_offsets, new_blocks, num_new, req_ids, self.core.table)
        t1, mass_seconds = clock(), self.stats.mass_seconds
        try:
            victim_index, victim_pos = self.decision.victims(req_ids, rows, inp.mass, self.shared_blocks())
        except BadMass as exc:  # the new tokens are registered already: the step cannot go on
            self._broken = str(exc)
            raise
        victim_rows = rows[victim_index]
        if len(victim_index):
            victim_slots = self.slots.slots_at(victim_rows, victim_pos)
            victim_ids = self.slots.tokens[victim_slots].astype(np.int64)
            victim_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum(np.bincount(victim_index, minlength=len(rows)), out=victim_offsets[1:])
            if self.on_victims is not None:
                self.on_victims(req_ids, victim_offsets, victim_ids)
        else:  # nothing evicted (e.g. every request within its budget)
            victim_slots = victim_ids = victim_index
            victim_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        t2 = clock()
        before = self.checks.before(req_ids, new_slots, num_new) if self.checks else None
        t3 = clock()
        try:
            result = self.core.step(req_ids, num_new, block_offsets, new_blocks, victim_offsets, victim_ids,
                                    "lazy-deferred" if background else self.config.compaction,
                                    self.config.fragmentation_threshold, inp.pressure,
                                    background.may_plan(req_ids) if background else None)
        except (KeyError, ValueError) as exc:
            self._broken = f"the token table refused a step: {exc}"
            raise RuntimeError(self._broken) from exc
        t4 = clock()
        if background is not None:
            self.slots.evict(victim_rows, victim_slots)
            # Plans whose copies finished commit now, after this iteration's mass was credited to
            # the layout the forward read; the new plans' copies start, to commit at a later step.
            self.slots.kv_len[rows] = result.kv_lens
            committed = background.finish(req_ids, rows)
            t5 = clock()
            copied = len(result.move_src)
            handle = background.start(req_ids, result, self.checks is not None)
            result = committed  # what this step committed
        else:
            self.slots.apply_step(victim_rows, victim_slots, result.move_src, result.move_dst, rows, req_ids,
                                  result.kv_lens, result.freed_offsets, self.config.compaction == "dense",
                                  self.core.table)
            t5 = clock()
            copied = len(result.move_src)
            handle = None
            if copied and self.executor is not None:
                handle = self.executor.submit_slots(result.move_src, result.move_dst)
                if inp.stream is not None:
                    handle.make_stream_wait(inp.stream)  # the next forward runs after the copy (I3)
                else:
                    handle.synchronize()
        t6 = clock()
        lost = length - result.kv_lens
        out = StepOutput(req_ids, victim_offsets, victim_ids, result, lost, self.slots.num_tokens[rows].copy(), handle)
        # A request's layout changed where it moved tokens, released blocks or got shorter (each >= 0).
        changed = np.diff(result.move_offsets) + np.diff(result.freed_offsets) + lost > 0
        if self.checks:
            self.checks.after(out, before, changed)  # I1 on the relocated keys, before they turn
        if self.rerotation is not None and lost.any():
            self.rerotation.shift_requests(self.core, dict(zip(req_ids.tolist(), lost.tolist())), inp.stream)
        t7 = clock()
        stats = self.stats
        stats.steps += 1
        stats.tokens_evicted += len(victim_ids)
        stats.compactions += int(np.count_nonzero(changed))
        stats.moves += len(result.move_src)
        stats.blocks_freed += len(result.freed)
        if self.executor is not None:
            stats.bytes_copied += copied * self.executor.bytes_per_move()
        seconds["table"] += (t1 - t0) + (t5 - t4)
        seconds["policy"] += t2 - t1 - (stats.mass_seconds - mass_seconds)  # not the simulated attention
        seconds["core"] += t4 - t3
        seconds["copy"] += t6 - t5
        seconds["checks"] += (t3 - t2) + (t7 - t6)
        return out

    def check_integrity(self) -> None:
        """I2 over every request, and the batch layout against the table. RuntimeError if broken."""
        StepChecks(self).layout(self.request_ids())

    def table_digest(self, req_ids: Collection[int] | None = None) -> str:
        """SHA-256 of the requests' tables (lengths, block lists, logical id per position, liveness):
        equal on every tensor/pipeline-parallel rank when their decisions agreed."""
        digest = hashlib.sha256()
        for req_id in sorted(self.request_ids() if req_ids is None else req_ids):
            seq = self.core.sequence(req_id)
            digest.update(np.array([req_id, seq.kv_len, seq.num_tokens, seq.num_live], dtype="<i8").tobytes())
            digest.update(np.asarray(seq.block_ids, dtype="<i8").tobytes())
            digest.update(seq.token_at[: seq.kv_len].astype("<i4").tobytes())
            digest.update(seq.live[: seq.num_tokens].tobytes())
        return digest.hexdigest()

    # ---- private -------------------------------------------------------------------------------
    def _policy_index(self, policy: EvictionPolicy) -> int:
        for i, known in enumerate(self._policies):
            if known is policy:
                return i
        for name, dtype in policy.slot_stats.items():
            self.slots.add_stat(name, dtype)
        self._policies.append(policy)
        return len(self._policies) - 1

    def _validated(self, inp: StepInput) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(req_ids, their rows, num_new, block offsets, new blocks) as int64 arrays, checked as the
        token table would check them, so that a bad batch changes nothing: the sizes, known
        requests (KeyError), the mass, then ``_check_new`` (the C++ core runs it, in the same
        words, in its registration call: ``SlotMap.add_tokens``)."""
        req_ids = np.asarray(inp.req_ids, dtype=np.int64).reshape(-1)
        num_new = np.asarray(inp.num_new, dtype=np.int64).reshape(-1)
        offsets = np.asarray(inp.new_block_offsets, dtype=np.int64).reshape(-1)
        blocks = np.asarray(inp.new_blocks, dtype=np.int64).reshape(-1)
        batch = len(req_ids)
        if len(num_new) != batch or len(offsets) != batch + 1:
            raise ValueError(f"step: {batch} requests need {batch} num_new and {batch + 1} block offsets, "
                             f"got {len(num_new)} and {len(offsets)}")
        rows = self.slots.rows(req_ids.tolist())
        self._check_mass(inp.mass, rows, num_new)
        if self.impl == "python":
            self._check_new(req_ids, rows, num_new, offsets, blocks)
        return req_ids, rows, num_new, offsets, blocks

    def _check_new(self, req_ids: np.ndarray, rows: np.ndarray, num_new: np.ndarray, offsets: np.ndarray,
                   blocks: np.ndarray) -> None:
        """The batch's new blocks and tokens: each request once, CSR offsets, counts >= 0, block
        ids in the pool (twice only if shared), every request's tokens within its blocks. The
        specification of ``cpp/core/slots.h`` ``check_new``. ValueError naming the first problem."""
        if len(set(req_ids.tolist())) != len(req_ids):
            raise ValueError("step: a request appears twice in the batch")
        counts = offsets[1:] - offsets[:-1]
        if offsets[0] != 0 or offsets[-1] != len(blocks) or counts.min(initial=0) < 0:
            raise ValueError("step: new_block_offsets must start at 0, never decrease and end at len(new_blocks)")
        if num_new.min(initial=0) < 0:
            raise ValueError(f"step: num_new must be >= 0, got {num_new[num_new < 0][:4].tolist()}")
        if len(blocks):
            if blocks.min() < 0 or blocks.max() >= self.slots.num_blocks:
                raise ValueError(f"step: new block ids must lie in [0, {self.slots.num_blocks})")
            listed = blocks.tolist()
            if len(set(listed)) != len(listed):
                unique, times = np.unique(blocks, return_counts=True)
                if not all(self.is_shared(int(b)) for b in unique[times > 1]):
                    raise ValueError("step: a new block is given twice (only a shared block may join several requests)")
        capacity = (self.slots.num_blocks_of[rows] + counts) * self.tokens_per_block
        short = np.flatnonzero(self.slots.kv_len[rows] + num_new > capacity)
        if len(short):
            i = int(short[0])
            raise ValueError(f"step: request {req_ids[i]}'s {num_new[i]} new tokens do not fit its blocks")

    def _check_mass(self, mass: Any, rows: np.ndarray, num_new: np.ndarray) -> None:
        """The mass a batch needs, checked before anything changes (a function's result is
        checked when it comes)."""
        if mass is None:
            if any(self._policies[i].observes_attention() for i in set(self.slots.policy[rows].tolist()) - {-1}):
                raise ValueError("a policy of this batch observes attention: pass the mass per position")
            return
        if callable(mass) or not len(rows):
            return
        shape = tuple(mass.shape)
        longest = int((self.slots.kv_len[rows] + num_new).max())
        if len(shape) != 2 or shape[0] != len(rows) or shape[1] < longest:
            raise ValueError(f"mass must be [{len(rows)}, >= {longest}] (the batch's longest request after its new "
                             f"tokens), got {list(shape)}")

    def _push_shared(self) -> None:
        """The C++ table keeps its own set of shared blocks: send it what changed."""
        if self.impl != "cpp":
            return
        shared = frozenset(self.shared_blocks())
        if shared != self._pushed_shared:
            for block_id in shared - self._pushed_shared:
                self.core.set_shared(block_id, True)
            for block_id in self._pushed_shared - shared:
                self.core.set_shared(block_id, False)
            self._pushed_shared = shared
