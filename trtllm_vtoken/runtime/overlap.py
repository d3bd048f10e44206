# SPDX-License-Identifier: Apache-2.0
"""The engine's overlap scheduler: the step of iteration N runs beside the forward of N+1.

With ``EngineConfig.overlap_scheduler`` the engine orders one iteration as TensorRT-LLM's
``_executor_loop_overlap`` does (docs/overlap.md):

    iteration N+1   reserve N+1's slots (after N's tokens, which no step has taken in yet)
                    set_batch(N+1)          forward N+1's layout is fixed here
                    start step N            its decision and tables beside the forward
                    forward N+1             reads the layout as it was before step N
                    finish step N           its copy after forward N+1 (CPU: the forward has
                                            returned; CUDA: the side stream waits for it)
                    sample N+1, release the requests that finished, defer step N+1

This is the order for rows whose policy observes attention (H2O, Scissorhands). Step N
registers every token reserved for its rows, N+1's included, so its plan counts them as present;
its decision reads forward N's attention mass; its evictions take effect in forward N+2: a
one-step lag, the same for naive-evict and vtoken, which therefore still decode alike. Rows whose
policy decides from counts (StreamingLLM, sliding window, Random) take step N at the end of
iteration N instead, before N+1's slots are reserved: no lag, the plain order's decisions.

Forward N's mass is laid out by the positions forward N saw, and step N-1 may have moved tokens
since (compaction, or a dead block dropped): ``DeferredStep`` keeps the logical id at each of
forward N's positions (``layout_ids``), and where step N-1 changed a layout ``remap_mass`` lays
the mass out again by the layout step N sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class DeferredStep:
    """A forward's rows, waiting for their step beside the next forward."""

    rows: list[int]
    mass: Any
    """[B, L] by the forward's positions (a host array), a function of the layout (the simulated
    backend's attention, evaluated when the step runs), or None."""
    ids: np.ndarray | None
    """[B, W] int64: the logical id at each position the forward saw (-1: none)."""
    queries: list[int]
    """Each row's new tokens (the queries whose attention the mass is)."""
    moved: bool
    """Whether the step that ran beside the forward changed a layout (evicted, moved or released):
    only then do the forward's positions differ from its step's, and its mass is laid out again."""


def rows_of(mass: Any, index: list[int], batch: int) -> Any:
    """The rows ``index`` of a batch's mass [B, L] (a host array); anything else as it is (None,
    or the simulated backend's function of the layout, evaluated when the step runs)."""
    if isinstance(mass, np.ndarray) and len(index) < batch:
        return mass[index]
    return mass


def pending_rows(layout: Any, writes: Any, req_ids: list[int]) -> list[tuple[int, int, int]]:
    """Per request: (kv_len, token count, tokens reserved and not yet taken in: a cached prefix,
    earlier forwards', this one's), the layout as a forward over it sees it now."""
    rows = []
    for req_id in req_ids:
        kv_len = layout.kv_len(req_id)
        written = writes.staged_blocks(req_id)[1] if req_id in writes.staged else kv_len + writes.cached_tokens(req_id)
        rows.append((kv_len, layout.num_tokens(req_id), written - kv_len))
    return rows


def layout_ids(layout: Any, writes: Any, req_ids: list[int]) -> np.ndarray:
    """[B, W] int64: the logical id at each position of each request's KV as a forward over it
    sees it now: the step's table (``batch_tokens``: live ids, -1 where none), then the tokens
    reserved and not yet taken in, in order."""
    table = layout.batch_tokens(req_ids).astype(np.int64)
    rows = pending_rows(layout, writes, req_ids)
    width = max([table.shape[1]] + [kv_len + pending for kv_len, _, pending in rows])
    ids = np.full((len(req_ids), width), -1, dtype=np.int64)
    ids[:, : table.shape[1]] = table
    for i, (kv_len, num_tokens, pending) in enumerate(rows):
        ids[i, kv_len : kv_len + pending] = np.arange(num_tokens, num_tokens + pending)
    return ids


def widened(mass: np.ndarray, layout: Any, writes: Any, req_ids: list[int]) -> np.ndarray:
    """``mass`` [B, W] of a forward whose positions the step beside it left as they were, with
    zero columns up to the longest request's KV now (the step registers the next forward's
    tokens, which this forward did not attend)."""
    width = max(kv_len + pending for kv_len, _, pending in pending_rows(layout, writes, req_ids))
    if mass.shape[1] >= width:
        return mass
    out = np.zeros((mass.shape[0], width), dtype=mass.dtype)
    out[:, : mass.shape[1]] = mass
    return out


def remap_mass(mass: np.ndarray, old_ids: np.ndarray, new_ids: np.ndarray) -> np.ndarray:
    """``mass`` [B, >= W_old] laid out by ``old_ids`` [B, W_old], laid out again by ``new_ids``
    [B, W_new]: each token's mass moves to its position now; positions of tokens the old layout
    did not have (or of no token) get 0. float32 [B, W_new]."""
    rows, width = new_ids.shape
    out = np.zeros((rows, width), dtype=np.float32)
    top = int(max(old_ids.max(initial=-1), new_ids.max(initial=-1))) + 1
    if top == 0:
        return out
    where = np.full((rows, top), -1, dtype=np.int64)  # logical id -> its position in the old layout
    r, c = np.nonzero(old_ids >= 0)
    where[r, old_ids[r, c]] = c
    r, c = np.nonzero(new_ids >= 0)
    source = where[r, new_ids[r, c]]
    found = (source >= 0) & (source < mass.shape[1])
    out[r[found], c[found]] = mass[r[found], source[found]]
    return out
