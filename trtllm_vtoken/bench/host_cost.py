# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench host``: what one operation costs the host's thread in warm caches, and right
after the thread slept 1 ms (its caches, TLB and branch history left to others, as an engine's own
work between two steps leaves them).

It shows why the step's host-thread work counts numpy calls and Python objects rather than
arithmetic: the step passes a batch's new blocks as the host's lists, makes its output's arrays
only when read, and repeats a decode loop's call with its arguments bound once. Where the C++
core is built it also times the core's registration call with the batch's arrays writeable and
read-only: nanobind takes a read-only array by a slower path, so the step passes its reused
arrays writeable.
"""

from __future__ import annotations

import gc
import time
import timeit
from collections.abc import Callable
from itertools import accumulate, chain
from typing import Any

import numpy as np

BATCH = 64
_LISTS = tuple([] for _ in range(BATCH))
_LISTS[5].append(3)
_LISTS[40].append(9)  # a decode step at batch 64: two requests cross into a new block
_FLAT = np.arange(1000, dtype=np.int64)


def _blocks_as_numpy_csr():
    """The batch's new blocks as CSR offsets and a flat array, built in numpy."""
    flat = list(chain.from_iterable(_LISTS))
    offsets = np.array(list(accumulate(map(len, _LISTS), initial=0)), dtype=np.int64)
    return offsets, np.asarray(flat, dtype=np.int64)


def _blocks_as_lists():
    """The batch's new blocks as the host holds them: one list per request (the C++ core takes them)."""
    return None, _LISTS


OPERATIONS: dict[str, Callable[[], Any]] = {
    "np.zeros(65)": lambda: np.zeros(BATCH + 1, dtype=np.int64),
    "np.cumsum of 65": lambda: np.cumsum(_FLAT[: BATCH + 1]),
    "np.array(a list of 65 ints)": lambda: np.array(list(range(BATCH + 1)), dtype=np.int64),
    "one slice of an array": lambda: _FLAT[3:9],
    "twelve slices of an array": lambda: [_FLAT[i : i + 5] for i in range(0, 60, 5)],
    "an empty Python call": lambda: None,
    "the batch's new blocks as numpy CSR": _blocks_as_numpy_csr,
    "the batch's new blocks as lists": _blocks_as_lists,
}


def run_host_bench(rounds: int = 400, warm_calls: int = 2000) -> dict[str, Any]:
    """Each operation warm (best of 5 x ``warm_calls``) and 1 ms after the thread slept (median of
    ``rounds``, the operations in alternating order). Returns ``{"rows": [...], "config": {...}}``."""
    if rounds < 1 or warm_calls < 1:
        raise ValueError(f"rounds and warm_calls must be >= 1, got {rounds} and {warm_calls}")
    cold: dict[str, list[float]] = {name: [] for name in OPERATIONS}
    gc.disable()  # as timeit does: no collection inside a timed operation
    try:
        for i in range(rounds):
            for name, op in (OPERATIONS.items() if i % 2 else reversed(OPERATIONS.items())):
                time.sleep(0.001)
                start = time.perf_counter()
                op()
                cold[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    rows = []
    for name, op in OPERATIONS.items():
        warm_us = min(timeit.repeat(op, number=warm_calls, repeat=5)) / warm_calls * 1e6
        cold_us = float(np.median(cold[name])) * 1e6
        rows.append({"operation": name, "warm_us": warm_us, "after_sleep_us": cold_us, "ratio": cold_us / warm_us})
    return {"rows": rows, "config": {"batch": BATCH, "rounds": rounds, "warm_calls": warm_calls}}


def time_registration(calls: int = 20000) -> list[dict[str, Any]] | None:
    """The C++ core's registration call (``slots_register``: five int64 arrays, ``BATCH`` requests,
    no new tokens) with its arrays writeable and read-only, microseconds per call, best of 5 x
    ``calls``; None where the C++ core is not built."""
    from trtllm_vtoken.core.native import load
    from trtllm_vtoken.step import DecodeStep, StepConfig, StepInput

    native = load()
    if native is None:
        return None
    req_ids = list(range(BATCH))
    step = DecodeStep(StepConfig("dense", impl="cpp"), 4 * BATCH, 32)
    for req in req_ids:
        step.add_request(req)
    step.run(StepInput(req_ids, [32] * BATCH, list(range(BATCH + 1)), req_ids))  # one full block each
    arrays = {"req_ids": np.arange(BATCH, dtype=np.int64), "rows": step.slots.rows(req_ids).copy(),
              "offsets": np.zeros(BATCH + 1, dtype=np.int64), "blocks": np.zeros(0, dtype=np.int64),
              "num_new": np.zeros(BATCH, dtype=np.int64)}
    layout, table = step.slots.native_layout(), step.core.table
    rows = []
    for writeable in (True, False):
        args = {name: values.copy() for name, values in arrays.items()}
        for values in args.values():
            values.flags.writeable = writeable
        call = lambda: native.slots_register(layout, args["req_ids"], args["rows"], args["offsets"],  # noqa: E731
                                             args["blocks"], args["num_new"], 4 * BATCH, table)
        best = min(timeit.repeat(call, number=calls, repeat=5)) / calls
        rows.append({"arrays": "writeable" if writeable else "read-only", "call_us": best * 1e6})
    return rows
