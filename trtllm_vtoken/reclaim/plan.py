# SPDX-License-Identifier: Apache-2.0
"""The one plan form both compaction modes produce and the copy executor consumes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RelocationPlan:
    """Moves for one request, taken from one snapshot of its token table (I4).

    ``token_ids[i]`` moves from ``src_slots[i]`` to ``dst_slots[i]``; slots are flat
    (``block_id * tokens_per_block + offset``). Sources and destinations are disjoint, so the copy
    may gather all sources and then scatter. Plain int tuples: most decode-step plans hold one or
    two moves, where building arrays would cost more than the moves themselves.
    """

    req_id: int
    mode: str
    """"dense" (keep a dense prefix, release the tail) or "lazy" (empty the emptiest blocks)."""
    version: int
    """Token-table version of the snapshot; committing against a newer version is refused."""
    token_ids: tuple[int, ...]
    src_slots: tuple[int, ...]
    dst_slots: tuple[int, ...]
    blocks_to_free: tuple[int, ...]
    blocks_before: int
    new_kv_len: int | None
    """Dense: the length to truncate to after the moves. Lazy: None (blocks leave mid-list)."""

    @property
    def num_moves(self) -> int:
        return len(self.token_ids)

    @property
    def blocks_after(self) -> int:
        return self.blocks_before - len(self.blocks_to_free)

    @classmethod
    def from_native(cls, plan) -> RelocationPlan:
        """The Python form of a C++ core plan (``trtllm_vtoken._native._core.Plan``)."""
        return cls(req_id=plan.req_id, mode="dense" if plan.dense else "lazy", version=plan.version,
                   token_ids=tuple(plan.token_ids), src_slots=tuple(plan.src_slots), dst_slots=tuple(plan.dst_slots),
                   blocks_to_free=tuple(plan.blocks_to_free), blocks_before=plan.blocks_before,
                   new_kv_len=None if plan.new_kv_len < 0 else plan.new_kv_len)

    def touched_blocks(self, tokens_per_block: int) -> set[int]:
        """Blocks read or written by the copy, plus those released."""
        slots = self.src_slots + self.dst_slots
        return {s // tokens_per_block for s in slots} | set(self.blocks_to_free)
