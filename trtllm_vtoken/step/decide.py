# SPDX-License-Identifier: Apache-2.0
"""The batch's eviction decision, the step's second stage: every policy of the batch decides for
its rows at once, from the step's slot layout. What comes out is a ``Decision``, which the step's
call (``step/fused.py``, ``step/spec.py``) evicts by:

    C++ core, one policy (or none) for the whole batch, decided natively:
        the call decides itself (``native_decision``): H2O: one native pass over the slots
        (``cpp/core/select.h``); id-scored (StreamingLLM, sliding window): the lowest live ids,
        walked in the C++ table's liveness; the tokens of shared (protected) blocks kept on top
        of the budget, passed over
    otherwise (the Python core, several policies, a policy decided in Python):
        the victims, decided here (``victims``) and handed to the call (``given``), per policy p:
          p's score lives in the slot layout and the C++ core is built: the native pass for p's rows
          else: BatchView [rows, positions] -> p.observe_batch -> p.select_batch, shared blocks'
                tokens masked (H2O's observe: its mass added slot by slot, row after row, as the
                native pass adds it, so a shared slot gets every holder's mass)

Both give the same victims: (batch index, position) pairs sorted by index, then logical id.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import numpy as np

from trtllm_vtoken.core.native import load as load_native
from trtllm_vtoken.policies import EvictionPolicy, ScorePolicy
from trtllm_vtoken.policies.batch import BatchView
from trtllm_vtoken.policies.budget import BoundsRule, Budget
from trtllm_vtoken.step.config import StepStats
from trtllm_vtoken.step.slots import SlotMap


class Decision(NamedTuple):
    """A batch's decision as the step's call takes it (``cpp/core/decode_step.h`` Decision)."""

    selector: int
    """0: no victims; 1: the lowest live ids among the candidates; 2: the lowest ``stat``;
    ``GIVEN``: the victims decided here (``victim_index``, ``victim_pos``)."""
    rule: BoundsRule
    """The policy's ``bounds_rule``: the native call sizes each request's candidates from the
    layout's counters itself (``cpp/core/budget.h``), no numpy over the batch's rows here."""
    stat: np.ndarray | None
    """Selector 2: the per-slot score statistic (float32), which ``mass`` is added to first."""
    mass: np.ndarray | None
    """[B, >= each row's length] float32 or float64, C order; None: nothing observed."""
    skip_shared: bool = False
    """Tokens in shared blocks are no candidates (the bounds keep them on top of the budget)."""
    threads: int = 1
    """Selector 2: threads the pass may split the rows over (``cpp/core/select.h``)."""
    victim_index: np.ndarray | None = None
    """``GIVEN``: [V] int64 batch index of each victim, ascending."""
    victim_pos: np.ndarray | None = None
    """``GIVEN``: [V] int64 physical position of each victim in its request (ids ascending per request)."""

    @property
    def repeats(self) -> bool:
        """The call may repeat with this decision (``step/beside.py``): the call decides itself."""
        return self.selector in (1, 2)


GIVEN = 3
NO_RULE = BoundsRule.of(Budget(ratio=1.0), 0, 0)
NO_DECISION = Decision(0, NO_RULE, None, None)
"""No victims and nothing to observe (a batch no request of which evicts)."""


def given(victim_index: np.ndarray, victim_pos: np.ndarray) -> Decision:
    """The decision ``BatchDecision.victims`` made, as the call takes it."""
    return Decision(GIVEN, NO_RULE, None, None, victim_index=victim_index, victim_pos=victim_pos)


class BadMass(RuntimeError):
    """A mass function returned something that does not fit the batch (after the step began)."""


class BatchDecision:
    """Decides the victims of a batch over a step's slot layout.

    Args:
        policies: The step's policies, indexed as ``SlotMap.policy`` (shared with the step).
        native_table: The C++ core's token table when the C++ core serves the step (None: the
            Python core): score policies then decide natively, id-scored ones from its liveness.
        reduce_mass: Applied to the batch's mass before any policy sees it (tensor / pipeline
            parallelism sums it over the ranks).
        stats: Where the time spent in a mass function (simulated attention) is counted apart.
        threads: The native statistic pass's threads (``StepConfig.pass_threads``), and beside the
            host's thread (``beside_host``: the call runs on the step's worker).
    """

    def __init__(self, slots: SlotMap, policies: list[EvictionPolicy], tokens_per_block: int, native_table: Any,
                 reduce_mass: Callable[[np.ndarray], np.ndarray] | None, stats: StepStats, threads: int = 1,
                 threads_beside_host: int = 1) -> None:
        self.slots, self.policies, self.tokens_per_block, self.threads = slots, policies, tokens_per_block, threads
        self.threads_beside_host = threads_beside_host
        self.native_table = native_table
        self.native, self.reduce_mass, self.stats = native_table is not None, reduce_mass, stats
        self._selectors: dict[int, int] = {}  # policy index -> native_selector's answer
        self._last: Decision | None = None  # the last decision without mass, to reuse

    def victims(self, req_ids: np.ndarray, rows: np.ndarray, mass: Any,
                shared: Collection[int], unobserved: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Victims of the batch: (batch index, position) pairs sorted by index, then logical id.

        One call per policy of the batch: the policy's ``select_batch`` over the gathered batch
        layout, or, where the C++ core is built and the policy's score lives in the slot layout
        (``ScorePolicy.scores_are_ids`` / ``score_stat``), one native pass over the slots
        (``cpp/core/select.h``, the same victims, no copies). ``shared``: the blocks shared now
        (their tokens are protected). RuntimeError (``BadMass``) if a mass function's result does
        not fit the batch. ``unobserved``: [B] each request's newest tokens the mass does not
        cover (``StepInput.unobserved``): a policy's ``observe_batch`` sees them as not attended
        (``BatchView.observed``); the mass there is 0, so a policy that adds it needs nothing."""
        slots = self.slots
        index = slots.policy[rows]
        groups: dict[int, np.ndarray] = {}  # policy -> the batch rows it decides for
        present = set(index.tolist())
        one_policy = len(present) == 1  # one policy (or none) for the whole batch: its rows are all of them
        present.discard(-1)
        for policy_index in sorted(present):
            policy = self.policies[policy_index]
            group = np.arange(len(rows)) if one_policy else np.flatnonzero(index == policy_index)
            if not policy.observes_attention():  # nothing to learn: only the rows over budget
                mine = rows if one_policy else rows[group]
                group = group[policy.wants_to_evict(slots.num_tokens[mine], slots.num_live[mine])]
            if len(group):
                groups[policy_index] = group
        if not groups:  # e.g. every request within its budget: no layout is even looked at
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        blocks = slots.block_rows(rows)
        native = {i for i in groups if self.native_selection(self.policies[i])}
        layout: dict[str, np.ndarray] = {}  # the batch's token layout, gathered once if needed

        def tokens() -> np.ndarray:
            if "tokens" not in layout:
                layout["tokens"] = slots.gather(slots.tokens, blocks)
            return layout["tokens"]

        observing = [i for i in groups if self.policies[i].observes_attention()]
        mass_rows = self.batch_mass(mass, rows, blocks.shape[1] * self.tokens_per_block, tokens) if observing else None
        protected = None
        if len(shared) and len(native) < len(groups):  # the Python policies' view of the shared blocks
            protected = np.repeat(np.isin(blocks, list(shared)), self.tokens_per_block, axis=1)
        picked_index, picked_pos = [], []
        for policy_index, group in groups.items():
            policy = self.policies[policy_index]
            if policy_index in native:
                whole = len(group) == len(rows)  # the usual case: no copy of the batch's mass
                victim_rows, positions = self.select_native(
                    policy, req_ids if whole else req_ids[group], rows if whole else rows[group],
                    None if mass_rows is None else mass_rows if whole else mass_rows[group], bool(len(shared)))
            else:
                group_blocks = blocks[group]
                # H2O's observe added slot by slot, row after row, as the native pass adds it: a slot
                # several rows hold (a shared block) gets each one's mass, in batch order.
                adds_mass = policy_index in observing and isinstance(policy, ScorePolicy) and policy.observe_adds_mass
                added = policy.score_stat if adds_mass else None
                stats = {name: slots.gather(slots.stats[name], group_blocks) for name in policy.slot_stats
                         if name != added}
                if added is not None:
                    stats[added] = self.add_mass(slots.stats[added], group_blocks, slots.kv_len[rows[group]],
                                                 mass_rows[group])
                num_tokens = slots.num_tokens[rows[group]]
                view = BatchView(req_ids[group], num_tokens, slots.num_live[rows[group]],
                                 tokens()[group], None if protected is None else protected[group], stats,
                                 None if unobserved is None else num_tokens - unobserved[group])
                if policy_index in observing and not adds_mass:
                    policy.observe_batch(view, mass_rows[group])
                    for name, values in view.stats.items():
                        slots.scatter(slots.stats[name], group_blocks, values)
                victims = policy.select_batch(view)
                victim_rows, positions = victims.rows, victims.positions
            picked_index.append(group[victim_rows]), picked_pos.append(positions)
        victim_index = np.concatenate(picked_index)
        victim_pos = np.concatenate(picked_pos)
        if len(picked_index) > 1:
            ids = slots.tokens[slots.slots_at(rows[victim_index], victim_pos)]
            order = np.lexsort((ids, victim_index))
            victim_index, victim_pos = victim_index[order], victim_pos[order]
        return victim_index, victim_pos

    def native_decision(self, rows: np.ndarray, mass: Any, shared: Collection[int],
                        sole_policy: int | None = None, beside_host: bool = False) -> Decision | None:
        """The batch's decision for the C++ core's call to make itself, or None where ``victims``
        decides it here: the Python core, several policies in the batch, a policy the C++ core
        cannot decide or whose bounds have no ``bounds_rule``. The same victims as ``victims``: the call applies the
        policy's rule (``candidate_bounds``, zero excess where ``wants_to_evict`` says no; with
        shared blocks, their live tokens kept on top of the budget and never candidates, as the
        Python path's protected mask), the mass is this step's as ``batch_mass`` gives it. ``sole_policy``: the
        policy index (-1: none) every request of the step follows, when the step knows (the rows
        need no look); ``beside_host``: the call will run on the step's worker (its pass threads).
        Raises ``BadMass`` as ``victims`` does."""
        if not self.native:
            return None
        first = -1 if not len(rows) else sole_policy
        if first is None:
            index = self.slots.policy[rows]
            first = int(index[0])
            if np.count_nonzero(index != first):
                return None
        if first < 0:  # no request of the batch evicts (or no request at all)
            return NO_DECISION
        selector = self._selectors.get(first)
        if selector is None:  # once per policy: which native pass decides for it, if any
            selector = self._selectors[first] = self.native_selector(self.policies[first])
        policy = self.policies[first]
        rule = policy.bounds_rule() if selector else None  # each step: a budget may change between steps
        if rule is None:  # a policy whose bounds only its own code knows decides here (``victims``)
            return None
        slots, batch_mass = self.slots, None
        if selector == 2 and policy.observes_attention():  # as wide as it came
            batch_mass = self.batch_mass(mass, rows, None, lambda: slots.gather(slots.tokens, slots.block_rows(rows)))
        stat = slots.stats[policy.score_stat] if selector == 2 else None
        skip_shared, threads = bool(len(shared)), self.threads_beside_host if beside_host else self.threads
        last = self._last
        if batch_mass is None and last is not None and last.rule is rule and last.stat is stat and \
                last.selector == selector and last.skip_shared == skip_shared and last.threads == threads:
            return last  # nothing observed and nothing changed since the last step: its decision
        decision = Decision(selector, rule, stat, batch_mass, skip_shared, threads)
        self._last = decision if batch_mass is None else None
        return decision

    def native_bounds(self, policy: ScorePolicy, rows: np.ndarray, shared: bool) -> tuple[np.ndarray, ...]:
        """(excess, lo, hi) of a native pass over these rows, int64 (``candidate_bounds``); with
        shared blocks, the live tokens in them (counted from the layout, this step's new tokens
        included) kept on top of the budget, as the Python path's protected mask keeps them."""
        slots = self.slots
        kept = slots.native.slots_protected_live(slots.native_layout(), rows, self.native_table) if shared else 0
        bounds = policy.candidate_bounds(slots.num_tokens[rows], slots.num_live[rows], kept)
        return tuple(np.ascontiguousarray(b, dtype=np.int64) for b in bounds)

    def add_mass(self, stat: np.ndarray, blocks: np.ndarray, lengths: np.ndarray, mass: np.ndarray) -> np.ndarray:
        """``stat[slot] += mass`` at each row's positions [0, length), row after row (the order the
        native pass adds in, so a slot two rows hold sums alike: ``cpp/core/select.h``). Returns
        the statistic in the batch layout after the addition (``SlotMap.gather``'s [B, width]).

        Gathered and written back block by block; the slots of blocks several rows hold (shared)
        are then added again from their value before, holder after holder (``np.add.at`` adds
        repeated indices in order, but runs far slower per element than the block-wise add)."""
        slots, tpb = self.slots, self.tokens_per_block
        width = blocks.shape[1] * tpb
        held = np.arange(width) < lengths[:, None]  # [B, width]
        values = slots.gather(stat, blocks)
        ids, holders = np.unique(blocks[held[:, ::tpb]], return_counts=True)  # the blocks each row holds
        repeated = ids[holders > 1]
        if len(repeated):
            in_repeated = held & np.isin(blocks, repeated).repeat(tpb, axis=1)
            before = values[in_repeated]
        with np.errstate(invalid="ignore"):  # +inf and -inf (an overflowed attention) add to NaN
            np.add(values, mass[:, :width], out=values, where=held)
            slots.scatter(stat, blocks, values)
            if not len(repeated):
                return values
            flat = (blocks.astype(np.int64).repeat(tpb, axis=1) * tpb + np.arange(width) % tpb)[in_repeated]
            stat[flat] = before
            np.add.at(stat, flat, mass[:, :width][in_repeated])
        return slots.gather(stat, blocks)

    def native_selector(self, policy: EvictionPolicy) -> int:
        """The call's selector for a policy: 1 (lowest live ids), 2 (lowest statistic), or 0
        where ``victims`` decides for it (not decided natively, or an id-scored policy that
        observes attention)."""
        if not self.native_selection(policy):
            return 0
        if policy.scores_are_ids and not policy.observes_attention():
            return 1
        return 2 if policy.score_stat else 0

    def native_selection(self, policy: EvictionPolicy) -> bool:
        """Can the C++ core decide for this policy in one pass over the slot layout?"""
        if not self.native or not isinstance(policy, ScorePolicy):
            return False
        if not (policy.scores_are_ids or policy.score_stat):
            return False
        return not policy.observes_attention() or policy.observe_adds_mass

    def select_native(self, policy: ScorePolicy, req_ids: np.ndarray, rows: np.ndarray,
                      mass: np.ndarray | None, shared: bool) -> tuple[np.ndarray, np.ndarray]:
        """One native pass for a policy's rows; ``shared``: some block is shared now, its tokens
        kept on top of the budget and no candidates (as ``native_decision`` has them)."""
        slots, native = self.slots, load_native()
        excess, lo, hi = self.native_bounds(policy, rows, shared)
        if policy.scores_are_ids and not policy.observes_attention():
            # The lowest live ids: walked in the table's liveness, not scanned over every slot.
            layout = (slots.block_table, rows) if shared else (None, None)
            return native.lowest_live_ids(self.native_table, req_ids, lo, hi, excess, *layout)
        stat = slots.stats[policy.score_stat] if policy.score_stat else None
        add = mass if policy.observe_adds_mass else None
        return native.select_lowest(slots.tokens, slots.block_table, self.tokens_per_block, rows, slots.kv_len[rows],
                                    lo, hi, excess, stat, add, self.native_table if shared else None, self.threads)

    def batch_mass(self, mass: Any, rows: np.ndarray, width: int | None,
                   tokens: Callable[[], np.ndarray]) -> np.ndarray:
        """The batch's mass as float32 or float64 [B, width] (C order), reduced across ranks if
        asked; ``width`` None: as wide as it came (at least every row's length; no copy of a C-order
        array). float32 stays float32, float64 float64: each addition to the float32 statistic is
        rounded once, as the native pass rounds it (``cpp/core/spans.h`` accumulate)."""
        if callable(mass):  # the simulated attention: a function of the token layout, not timed as ours
            start = time.perf_counter()
            mass = mass(tokens())
            self.stats.mass_seconds += time.perf_counter() - start
        if not isinstance(mass, np.ndarray):  # a torch tensor (on any device)
            mass = mass.detach().float().cpu().numpy()
        longest = int(self.slots.kv_len[rows].max())
        if mass.ndim != 2 or mass.shape[0] != len(rows) or mass.shape[1] < longest:
            # only a mass function's result can get here (arrays are checked before any change)
            raise BadMass(f"the mass function returned {list(mass.shape)} for a batch of {len(rows)}")
        if width is not None and mass.shape[1] < width:
            mass = np.pad(mass, ((0, 0), (0, width - mass.shape[1])))
        if self.reduce_mass is not None:
            mass = self.reduce_mass(mass)
        dtype = np.float32 if mass.dtype == np.float32 else np.float64
        return np.ascontiguousarray(mass if width is None else mass[:, :width], dtype=dtype)
