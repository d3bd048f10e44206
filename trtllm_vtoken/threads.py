# SPDX-License-Identifier: Apache-2.0
"""How many CPU threads torch's intra-op parallelism gets: the cores this process may use
(its affinity), one left to everything else.

Why not every core: torch's parallel operators end in a barrier where each thread waits for the
others. When another runnable process shares the cores and every core carries one of our
threads, the thread that gets descheduled holds up every operator of the forward, and decoding
slows down many times over (``vtoken bench threads`` measures it: tokens/s idle and with one core
kept busy by another process, for this choice and for torch's default). With one core left over,
a competing process takes that core instead of stalling the forward. Ranks of one model share
the cores: each takes its share of what is left.

    cores in the affinity mask   1   2   4   8   16
    threads, one process         1   1   3   7   15
    threads per rank, 2 ranks    1   1   1   3    7

An explicit setting (``threads=`` of ``LLM``, ``--threads`` of every ``vtoken`` command that
runs a model) always wins.
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask (``taskset``, cgroup cpusets), or
    every core where the platform has no affinity call."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_threads(processes: int = 1) -> int:
    """Intra-op threads of each of ``processes`` processes sharing this process's cores: the
    usable cores but one, split evenly, at least one each."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    return max(1, (usable_cores() - 1) // processes)


def set_threads(threads: int | None = None, processes: int = 1) -> int:
    """Sets torch's intra-op threads of this process: ``threads`` if given, else
    ``default_threads(processes)``. Returns the number set. Raises ValueError for threads < 1."""
    import torch

    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer (or None: chosen from the cores), got {threads!r}")
    chosen = threads if threads is not None else default_threads(processes)
    torch.set_num_threads(chosen)
    return chosen
