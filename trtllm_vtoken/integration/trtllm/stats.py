# SPDX-License-Identifier: Apache-2.0
"""vToken's counters from inside TensorRT-LLM's executor worker, for the Triton model's metrics.

The KV-cache manager lives in the worker (an MPI process TensorRT-LLM spawns even at TP=1); the
Triton model lives in the client process. The manager writes a snapshot, named as
``serving.metrics.METRICS``, to a JSON file (``VTokenSettings.stats_file``) at most every
``stats_interval_s`` and whenever a request leaves; the client's ``TRTLLMLoop`` polls it. A file
and not a pipe: it needs no handshake with TensorRT-LLM's process spawning, a reader never blocks
the worker, and the write is atomic (a temporary file renamed over the old one).

    worker:  update_resources / free_resources -> StatsFile.maybe_write(snapshot)  ->  stats.json
    client:  TRTLLMLoop, every poll_s           -> read_stats(stats.json) + its own counters
                                                -> on_stats(values) -> Triton metric families

What only the client knows (requests finished, waiting) it adds itself; preemptions happen in
TensorRT-LLM's scheduler, where vToken has no hook, so that metric is not exported on this path.
Beside the numbers, a snapshot may carry the worker's record (an object under
``arming.RECORD_KEY``: proof that vToken armed), which ``read_stats`` leaves out.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def state_snapshot(state, free_blocks: int, total_blocks: int) -> dict[str, float]:
    """The metrics a ``VTokenState`` and its manager's block counts give.

    Args:
        state: the manager's ``VTokenState``.
        free_blocks / total_blocks: the manager's ``get_num_free_blocks()`` and
            ``get_max_resource_count()``.
    """
    step, stats = state.step, state.step.stats
    requests = step.request_ids()
    held_slots = sum(step.num_blocks(r) for r in requests) * step.tokens_per_block
    live = sum(step.num_live(r) for r in requests)
    return {
        "vtoken_kv_blocks_retained": float(total_blocks - free_blocks),
        "vtoken_kv_blocks_total": float(total_blocks),
        "vtoken_kv_utilization": live / held_slots if held_slots else 0.0,
        "vtoken_admission_headroom_blocks": float(free_blocks),
        "vtoken_requests_running": float(len(requests)),
        "vtoken_tokens_evicted": float(stats.tokens_evicted),
        "vtoken_relocations": float(stats.compactions),
        "vtoken_tokens_relocated": float(stats.moves),
        "vtoken_bytes_copied": float(stats.bytes_copied),
        "vtoken_blocks_reclaimed": float(stats.blocks_freed),
    }


class StatsFile:
    """Writes snapshots to ``path``, at most one per ``interval_s`` unless forced."""

    def __init__(self, path: str | Path, interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"stats interval must be positive, got {interval_s}")
        self.path = Path(path)
        self.interval_s = interval_s
        self.clock = clock
        self.writes = 0
        self._last: float | None = None

    def maybe_write(self, snapshot: Callable[[], dict[str, Any]], force: bool = False) -> bool:
        """Writes ``snapshot()`` if forced or ``interval_s`` has passed; returns whether it did."""
        now = self.clock()
        if not force and self._last is not None and now - self._last < self.interval_s:
            return False
        values = snapshot()
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(values, sort_keys=True))
        os.replace(partial, self.path)  # readers see the old snapshot or the new one, never half
        self._last = now
        self.writes += 1
        return True


def read_stats(path: str | Path) -> dict[str, float] | None:
    """The latest snapshot, or None if there is none yet (or it cannot be read)."""
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(values, dict):
        return None
    return {str(k): float(v) for k, v in values.items() if isinstance(v, (int, float))}
