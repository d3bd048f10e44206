# SPDX-License-Identifier: Apache-2.0
"""Invariant checks around every relocation (design §2).

- I1 token conservation: the live ids and their K/V bytes hash the same before and after
  (``snapshot_live`` + ``check_conservation``).
- I2 unique mapping: ``TokenTable.check_integrity`` (every live id -> one slot, no slot twice).
- I4 layout-aware planning: ``validate_plan`` (consistent snapshot, no overlap with an in-flight
  plan, no shared block, lazy plans strictly shrink the request).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from trtllm_vtoken.core.token_table import TokenTable
from trtllm_vtoken.reclaim.plan import RelocationPlan

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LiveSnapshot:
    """Live ids of one request and each one's K/V bytes (all layers, heads, pools)."""

    num_tokens: int
    ids: np.ndarray
    """Shape: (num_live,), int64, ascending."""
    kv: np.ndarray
    """Shape: (num_live, bytes_per_token), uint8, row i belongs to ids[i]."""

    def digest(self, keep: np.ndarray | None = None) -> str:
        """SHA-256 over ids and KV bytes, optionally of the rows where ``keep`` is True only."""
        ids, kv = (self.ids, self.kv) if keep is None else (self.ids[keep], self.kv[keep])
        digest = hashlib.sha256(ids.astype("<i8").tobytes())
        digest.update(np.ascontiguousarray(kv).tobytes())
        return digest.hexdigest()


def snapshot_live(table: TokenTable, req_id: int, pools: Sequence[torch.Tensor]) -> LiveSnapshot:
    """Reads every live token's KV back to the host: a check, never on the decode hot path."""
    ids = table.live_ids(req_id)
    return snapshot_slots(table.num_tokens(req_id), ids, table.slots_of(req_id, ids), pools)


def snapshot_slots(num_tokens: int, ids: np.ndarray, slots: np.ndarray, pools: Sequence[torch.Tensor]) -> LiveSnapshot:
    """The snapshot of live ``ids`` (ascending) stored at flat ``slots``, KV read from ``pools``."""
    import torch

    rows = [np.zeros((len(ids), 0), dtype=np.uint8)]
    if len(ids) and pools:
        where = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(pools[0].device)
        tpb = pools[0].shape[4]
        for pool in pools:
            values = pool[where // tpb, :, :, :, where % tpb].contiguous().cpu()
            rows.append(values.view(torch.uint8).reshape(len(ids), -1).numpy())
    return LiveSnapshot(num_tokens, np.asarray(ids, dtype=np.int64), np.concatenate(rows, axis=1))


def check_conservation(req_id: int, before: LiveSnapshot, after: LiveSnapshot) -> str:
    """I1 across one relocation; returns the digest. Raises RuntimeError on a violation.

    Tokens evicted while the copy was in flight (lazy mode) leave the live set legitimately, and
    tokens written meanwhile join it; neither is compared. Everything else must hash identically.
    """
    existed = after.ids < before.num_tokens
    resurrected = np.setdiff1d(after.ids[existed], before.ids)
    if len(resurrected):
        raise RuntimeError(f"I1 violated for request {req_id}: dead tokens {resurrected[:8]} came back")
    common = np.intersect1d(before.ids, after.ids[existed])
    want = before.digest(np.isin(before.ids, common))
    got = after.digest(np.isin(after.ids, common))
    if want != got:
        raise RuntimeError(f"I1 violated for request {req_id}: live ids or their KV bytes changed")
    return got


def validate_plan(
    table: TokenTable, plan: RelocationPlan, in_flight: Collection[int], full: bool = True
) -> None:
    """I4 for a plan about to be submitted. Raises ValueError naming the violation.

    The snapshot and in-flight checks always run (they are O(1)); ``full`` adds the O(moves)
    layout checks, which the planner guarantees by construction.
    """
    req_id, tpb = plan.req_id, table.tokens_per_block
    if req_id in in_flight:
        raise ValueError(f"request {req_id} already has a relocation in flight")
    version = table.version(req_id)
    if plan.version != version:
        raise ValueError(
            f"plan for request {req_id} was taken from table version {plan.version}, table is at {version}"
        )
    if plan.mode == "lazy" and plan.blocks_after >= plan.blocks_before:
        raise ValueError(f"lazy plan for request {req_id} does not reduce its {plan.blocks_before} blocks")
    if not full:
        return
    shared = sorted(b for b in plan.touched_blocks(tpb) if table.is_shared(b))
    if shared:
        raise ValueError(f"plan for request {req_id} touches shared blocks {shared}")
    if set(plan.src_slots) & set(plan.dst_slots):
        raise ValueError(f"plan for request {req_id}: a slot is both a source and a destination")
    if table.slots_of(req_id, list(plan.token_ids)).tolist() != list(plan.src_slots):
        raise ValueError(f"plan for request {req_id}: tokens are no longer at the planned sources")
