# SPDX-License-Identifier: Apache-2.0
"""What the reference runtime's KV-cache manager reports: its counters and its current usage."""

from __future__ import annotations

from dataclasses import dataclass, field


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
