# SPDX-License-Identifier: Apache-2.0
"""The C++ token table (``cpp/core``), when the package was built with it.

It mirrors ``TokenTable`` and the planners exactly (same state, plans and error messages; a
parity test drives both with the same random operation sequences) and adds ``step_batch``: a whole
decode step's host work for every request of the batch in one call (register the new token,
evict, plan, commit). The Python classes stay the specification and the fallback when the
extension is absent; ``vtoken info`` shows which is active.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import ModuleType
from typing import Any


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or None if the package was built without it."""
    try:
        from trtllm_vtoken._native import _core
    except ImportError:
        return None
    return _core


class _NotBuilt(ValueError):
    """Stands in for ``BatchRefused`` where the C++ core is not built: nothing raises it."""


def batch_refused() -> type[ValueError]:
    """The C++ core's ``BatchRefused``: a ValueError its registration's checks raise for a bad
    batch before anything changed, told apart from a refusal by the token table halfway."""
    core = load()
    return _NotBuilt if core is None else core.BatchRefused


def describe() -> str:
    """One line for ``vtoken info``."""
    if load() is None:
        return "python (numpy reference; the C++ core is not built)"
    return "cpp (trtllm_vtoken._native._core; the Python classes remain the specification)"


def native_table(tokens_per_block: int) -> Any:
    """A C++ ``TokenTable``. Raises RuntimeError if the extension is not built."""
    core = load()
    if core is None:
        raise RuntimeError("the C++ token table is not built (install the package with its cpp/ build)")
    return core.TokenTable(tokens_per_block)


@contextlib.contextmanager
def compaction_timed() -> Iterator[None]:
    """Inside the block the C++ core times each compaction's plan and commit (process-wide,
    ``set_compaction_timed`` in ``cpp/core/batch.h``): the fused call's "plan" and "commit"
    seconds (``StepStats.core_parts``), 0 outside it. A diagnostic for benchmarks: its per-request
    marks cost the table's loop ~10-15% in the step alone. Nothing happens without the C++ core."""
    core = load()
    if core is None:
        yield
        return
    was = core.compaction_is_timed()
    core.set_compaction_timed(True)
    try:
        yield
    finally:
        core.set_compaction_timed(was)
