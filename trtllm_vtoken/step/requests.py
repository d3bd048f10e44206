# SPDX-License-Identifier: Apache-2.0
"""The requests of a ``DecodeStep``: joining (with a policy each, or none) and leaving, which
policy each follows, and the step's integrity check. A base of ``DecodeStep``, which sets the
state it reads; every method that touches the tables first waits for a step in flight
(``settle``)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from trtllm_vtoken.policies import EvictionPolicy
from trtllm_vtoken.step.checks import StepChecks
from trtllm_vtoken.step.config import StepStats
from trtllm_vtoken.step.queries import TableQueries

DEFAULT = object()
"""``add_request``'s policy argument: the step's default policy."""


class StepRequests(TableQueries):
    """Requests joining and leaving a step, and the policies they follow."""

    policy: EvictionPolicy | None
    background: Any
    executor: Any
    stats: StepStats
    is_shared: Callable[[int], bool]
    tokens_per_block: int
    _policies: list[EvictionPolicy]
    _policy_of: dict[int, int]  # request -> index into _policies (absent: never evicts)
    _following: dict[int, int]  # policy index (-1: none) -> requests that follow it

    def add_request(self, req_id: int, policy: Any = DEFAULT) -> None:
        """A new request, with no tokens yet (its first ``run`` registers its prompt)."""
        self.settle()
        chosen = self.policy if policy is DEFAULT else policy
        self.core.add_request(req_id)
        row = self.slots.add_request(req_id)
        if chosen is not None:
            self._policy_of[req_id] = self.slots.policy[row] = self.policy_index(chosen)
        key = self._policy_of.get(req_id, -1)
        self._following[key] = self._following.get(key, 0) + 1

    def remove_request(self, req_id: int) -> list[int]:
        """Forgets the request; returns its block list, which the host frees in its pool."""
        self.settle()
        if self.background is not None:
            self.background.drop(req_id)
        blocks = self.core.remove_request(req_id)
        self.slots.remove_request(req_id, blocks, self.is_shared)
        index = self._policy_of.pop(req_id, None)
        key = -1 if index is None else index
        self._following[key] -= 1
        if not self._following[key]:
            del self._following[key]
        if index is not None:
            self._policies[index].forget(req_id)
        return blocks

    def forget_blocks(self, block_ids: Sequence[int]) -> None:
        """Blocks a leaving request held outside its table row (a cached prefix, reservations its
        first step never took in), before it drops its references: their slots are emptied but
        for those another request holds. A cached block may carry the slots of a request that
        left while this one shared it; reused later as a partly written block, it would show
        that request's tokens."""
        self.settle()
        self.slots.empty_blocks(block_ids, self.is_shared)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.slots.row_of

    def request_ids(self) -> list[int]:
        self.settle()
        return self.core.request_ids()

    def relocating_blocks(self) -> set[int]:
        """Blocks that background compactions in flight read, write or will release: a prefix
        cache must not share them until they commit."""
        self.settle()
        return self.background.blocks(self.tokens_per_block) if self.background is not None else set()

    def policy_of(self, req_id: int) -> EvictionPolicy | None:
        index = self._policy_of.get(req_id)
        return None if index is None else self._policies[index]

    def observes_attention(self, req_ids: Collection[int] | None = None) -> bool:
        """Does any of these requests' policies (default: any policy) need the attention mass?"""
        if req_ids is None:
            return any(p.observes_attention() for p in self._policies)
        return any(self._policies[self._policy_of[r]].observes_attention() for r in req_ids if r in self._policy_of)

    def may_evict(self, req_ids: Sequence[int], num_new: Sequence[int]) -> np.ndarray:
        """[B] bool: could each request's next step evict once ``num_new`` more tokens have joined
        its table? Its policy's ``wants_to_evict`` over the counters after them (a superset of the
        rows whose step evicts: False means it evicts nothing); False for a request without a
        policy. A host that learns a forward's mass late takes the step at once where this says
        True (``EngineConfig.decode_decision``)."""
        self.settle()
        rows = self.slots.rows(req_ids)
        extra = np.asarray(num_new, dtype=np.int64)
        num_tokens, num_live = self.slots.num_tokens[rows] + extra, self.slots.num_live[rows] + extra
        index = self.slots.policy[rows]
        out = np.zeros(len(rows), dtype=bool)
        for policy_index in set(index.tolist()) - {-1}:
            mine = np.flatnonzero(index == policy_index)
            out[mine] = self._policies[policy_index].wants_to_evict(num_tokens[mine], num_live[mine])
        return out

    def check_integrity(self, idle_blocks: Sequence[int] = ()) -> None:
        """I2 over every request, and the batch layout against the table; the slots of
        ``idle_blocks`` (blocks no request holds: free, or cached and unheld) are empty.
        RuntimeError if broken."""
        self.settle()
        StepChecks(self.core, self.slots, self.executor, self.is_shared, self.stats).layout(self.request_ids())
        self.slots.check_empty(idle_blocks)

    def policy_index(self, policy: EvictionPolicy) -> int:
        """The policy's index in this step, registered (its per-slot statistics kept) the first time."""
        for i, known in enumerate(self._policies):
            if known is policy:
                return i
        for name, dtype in policy.slot_stats.items():
            self.slots.add_stat(name, dtype)
        self._policies.append(policy)
        return len(self._policies) - 1

    def sole_policy(self) -> int | None:
        """The policy index (-1: none) every request of the step follows, None if they differ."""
        return next(iter(self._following)) if len(self._following) == 1 else None
