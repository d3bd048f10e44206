# SPDX-License-Identifier: Apache-2.0
"""Comparing runs whose difference is smaller than one machine's run-to-run noise: every row is
run several times in alternating order (forward, backward, ...), so drift over the benchmark
(thermal, other tenants) hits all rows alike, and the median run is reported with the spread."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def run_alternating(rows: Sequence[tuple[str, Any]], repeats: int, run: Callable[[str, Any], dict[str, Any]],
                    progress=None) -> list[dict[str, Any]]:
    """Calls ``run(label, spec)`` ``repeats`` times per row; returns, in row order, each row's
    median run (by ``tokens_per_s``) with ``label``, ``tokens_per_s_min`` and ``tokens_per_s_max``."""
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
        ordered = sorted(samples[label], key=lambda r: r["tokens_per_s"])
        summary.append(dict(ordered[len(ordered) // 2], label=label, tokens_per_s_min=ordered[0]["tokens_per_s"],
                            tokens_per_s_max=ordered[-1]["tokens_per_s"]))
    return summary
