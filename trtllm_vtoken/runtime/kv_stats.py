# SPDX-License-Identifier: Apache-2.0
"""What the reference runtime's KV-cache manager reports: its counters and its current usage."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class KVStats:
    tokens_evicted: int = 0
    tokens_evicted_by_policy: dict[str, int] = field(default_factory=dict)
    """The same, by the policy's name (requests may follow different ones)."""
    peak_blocks_used: int = 0
    mask_seconds: float = 0.0
    """Host time building the validity mask (naive-evict, lazy mode)."""
    lists_seconds: float = 0.0
    """native: host time appending the new tokens to the block lists."""


@dataclass(frozen=True)
class KVUsage:
    blocks_used: int
    live_tokens: int
    slots_held: int

    @property
    def utilization(self) -> float:
        """Live tokens over slots in allocated blocks: the memory doing useful work."""
        return self.live_tokens / self.slots_held if self.slots_held else 0.0


class EvictionCounter:
    """Counts a step's evictions into ``KVStats``, in total and by the evicting request's policy
    name; with one policy among the admitted requests (the usual engine) that is one addition
    per step, else one per evicting request."""

    def __init__(self, stats: KVStats) -> None:
        self.stats = stats
        self._name_of: dict[int, str] = {}  # request -> its policy's name ("native": none)
        self._admitted: dict[str, int] = {}  # policy name -> requests admitted with it

    def admit(self, req_id: int, name: str) -> None:
        self._name_of[req_id] = name
        self._admitted[name] = self._admitted.get(name, 0) + 1

    def release(self, req_id: int) -> None:
        name = self._name_of.pop(req_id, None)
        if name is None:
            return
        self._admitted[name] -= 1
        if not self._admitted[name]:
            del self._admitted[name]

    def count(self, req_ids: np.ndarray, victim_offsets: np.ndarray) -> None:
        """A step's victims in CSR form: request ``req_ids[i]`` evicted
        ``victim_offsets[i + 1] - victim_offsets[i]`` tokens."""
        total = int(victim_offsets[-1]) if len(victim_offsets) else 0
        self.stats.tokens_evicted += total
        if not total:
            return
        counts = np.diff(victim_offsets)
        by_policy = self.stats.tokens_evicted_by_policy
        if len(self._admitted) == 1:
            name = next(iter(self._admitted))
            by_policy[name] = by_policy.get(name, 0) + total
            return
        for i in np.flatnonzero(counts).tolist():
            name = self._name_of[int(req_ids[i])]
            by_policy[name] = by_policy.get(name, 0) + int(counts[i])
