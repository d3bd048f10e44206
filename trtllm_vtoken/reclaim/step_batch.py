# SPDX-License-Identifier: Apache-2.0
"""``step_batch``: one decode step's host work for a whole batch, in the Python core.

Per request i of the batch, in order, it does exactly what this loop does (the specification,
shared with the C++ core's ``TokenTable.step_batch``, see ``cpp/core/batch.h``):

    table.append_tokens(req, new_blocks[i], num_new[i])
    table.evict_tokens(req, evict_ids[i])
    plan = plan_for_mode(table, req, "dense" if dense else "lazy", fragmentation_threshold, pressure)
    if plan: commit_plan(table, plan)        # apply_moves, then truncate / release_blocks

Metadata only: the caller copies the KV of plans it needs copied (use ``ReclaimBackend`` for
that) and frees the returned blocks in its pool. Lists of ids come in CSR form: request i's
entries are ``values[offsets[i]:offsets[i + 1]]``.

Dense requests whose one hole is their one eviction (most of a decode step) take
``TokenTable.fill_single_hole``, which leaves the table exactly as plan + commit would: a dense
step then costs ~5 us a request instead of ~30 us through the per-call API (``vtoken bench
core``, batch 256).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np

from trtllm_vtoken.core.token_table import TokenTable
from trtllm_vtoken.reclaim.planner import commit_plan, plan_for_mode

StepResult = tuple[list[int], list[int], list[int]]
"""(moves per request, freed_offsets [batch + 1], freed block ids request by request)."""


def step_batch(
    table: TokenTable,
    req_ids: SequenceOf[int],
    num_new: SequenceOf[int],
    new_block_offsets: SequenceOf[int],
    new_blocks: SequenceOf[int],
    evict_offsets: SequenceOf[int],
    evict_ids: SequenceOf[int],
    dense: bool,
    fragmentation_threshold: int = 1,
    pressure: bool = False,
) -> StepResult:
    """Registers, evicts, plans and commits for every request of the batch (see module doc).

    Raises ValueError if the arrays do not fit together (nothing changed) and, like the loop,
    KeyError/ValueError from the first request whose input is bad (earlier requests' steps stay
    done, that request's failing call changed nothing).
    """
    req_ids, num_new = _as_list(req_ids), _as_list(num_new)
    block_offsets, blocks = _as_list(new_block_offsets), _as_list(new_blocks)
    evict_offsets, evicts = _as_list(evict_offsets), _as_list(evict_ids)
    batch = len(req_ids)
    if len(num_new) != batch or len(block_offsets) != batch + 1 or len(evict_offsets) != batch + 1:
        raise ValueError("step_batch: num_new needs one entry per request and each offsets array one more")
    _check_csr(block_offsets, len(blocks), "new_block_offsets")
    _check_csr(evict_offsets, len(evicts), "evict_offsets")

    moves: list[int] = []
    freed_offsets = [0]
    freed: list[int] = []
    mode = "dense" if dense else "lazy"
    for i, req in enumerate(req_ids):
        table.append_tokens(req, blocks[block_offsets[i] : block_offsets[i + 1]], num_new[i])
        victims = evicts[evict_offsets[i] : evict_offsets[i + 1]]
        if len(victims) == 1:
            table.evict_token(req, victims[0])
        else:
            table.evict_tokens(req, victims)
        done = table.fill_single_hole(req) if dense else None
        if done is None:
            plan = plan_for_mode(table, req, mode, fragmentation_threshold, pressure)
            done = (plan.num_moves, commit_plan(table, plan)) if plan is not None else (0, [])
        moves.append(done[0])
        freed.extend(done[1])
        freed_offsets.append(len(freed))
    return moves, freed_offsets, freed


def _as_list(values: SequenceOf[int]) -> list[int]:
    return values.tolist() if isinstance(values, np.ndarray) else [int(v) for v in values]


def _check_csr(offsets: list[int], num_values: int, name: str) -> None:
    if offsets[0] != 0 or offsets[-1] > num_values or any(a > b for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"step_batch: {name} must start at 0, never decrease and stay within its values")
