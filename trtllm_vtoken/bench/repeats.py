# SPDX-License-Identifier: Apache-2.0
"""Comparing runs whose difference is smaller than one machine's run-to-run noise: every row is
run several times in alternating order (forward, backward, ...), so drift over the benchmark
(thermal, other tenants) hits all rows alike, and the median run is reported with the spread."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def run_alternating(rows: Sequence[tuple[str, Any]], repeats: int, run: Callable[[str, Any], dict[str, Any]],
                    progress=None, key: str = "tokens_per_s", spread: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Calls ``run(label, spec)`` ``repeats`` times per row; returns, in row order, each row's
    median run (by ``key``) with ``label``, ``{key}_min`` and ``{key}_max``, and the same range
    over the runs for each of the values named in ``spread``."""
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    samples: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in rows}
    for repeat in range(repeats):
        for label, spec in (rows if repeat % 2 == 0 else rows[::-1]):
            samples[label].append(run(label, spec))
            if progress is not None:
                progress.update(1)
    summary = []
    for label, _ in rows:
        ordered = sorted(samples[label], key=lambda r: r[key])
        ranges = {}
        for name in (key, *spread):
            values = [r[name] for r in ordered]
            ranges[f"{name}_min"], ranges[f"{name}_max"] = min(values), max(values)
        summary.append(dict(ordered[len(ordered) // 2], label=label, **ranges))
    return summary


def at_most_verdict(low: float, high: float, target: float, unit: str = "") -> str:
    """Whether a value whose runs span ``[low, high]`` is at most ``target``: said only outside
    the spread ("<= target" when every run is, "> target" when none is), else "within the spread"."""
    if high <= target:
        return f"<= {target:g}{unit}"
    if low > target:
        return f"> {target:g}{unit}"
    return "within the spread"
