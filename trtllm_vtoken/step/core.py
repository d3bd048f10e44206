# SPDX-License-Identifier: Apache-2.0
"""The token table behind the step, in one of two implementations with the same behaviour:

    "cpp"     the C++ core (``trtllm_vtoken._native._core.TokenTable``): the step's one native
              call (``step/fused.py``) runs the whole batch's table work (append, evict, plan,
              commit) with the decision and the layout's update
    "python"  ``core.TokenTable``, which the Python core's call (``step/spec.py``) drives through
              ``reclaim.step_batch``: the specification, and the fallback where the C++ core is
              not built

"auto" picks "cpp" when it is built. ``TableCore`` holds either table: the few queries hosts make
(lengths, block lists), what the invariant checks read, and background compaction's late commit.
A parity test drives both with the same batches (``tests/step/test_step_parity.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable
from typing import Any

import numpy as np

from trtllm_vtoken.core.integrity import check_blocks_disjoint, check_sequence
from trtllm_vtoken.core.native import load as load_native
from trtllm_vtoken.core.sequence import Sequence
from trtllm_vtoken.core.token_table import TokenTable
from trtllm_vtoken.reclaim.plan import RelocationPlan
from trtllm_vtoken.reclaim.planner import commit_plan

IMPLS = ("auto", "cpp", "python")


def resolve_impl(impl: str) -> str:
    """"cpp" or "python" for a requested implementation. Raises ValueError for an unknown name,
    RuntimeError for "cpp" where the C++ core is not built."""
    if impl not in IMPLS:
        raise ValueError(f"step implementation must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "cpp" if load_native() is not None else "python"
    if impl == "cpp" and load_native() is None:
        raise RuntimeError("the C++ core is not built (install the package with its cpp/ build)")
    return impl


class TableCore(ABC):
    """The token tables of one step. Not thread-safe (one host thread drives a step).

    Both implementations' tables answer the same queries (``TokenTable``'s names), so they are
    forwarded as they are; what differs is a lazy plan's late commit and reading a request's arrays."""

    impl: str
    table: Any

    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block

    @abstractmethod
    def commit_lazy(self, req_id: int, token_ids: list[int], src_slots: list[int], dst_slots: list[int],
                    blocks_to_free: list[int]) -> list[int]:
        """Commits a lazy plan of a "lazy-deferred" step once its copy has finished; returns the
        released blocks. ValueError, changing nothing, if it no longer applies."""

    @abstractmethod
    def sequence(self, req_id: int) -> Sequence:
        """The request's arrays (a copy for the C++ table): checks and tests read them."""

    def sync_shared(self, shared: Collection[int]) -> None:
        """Before a step: the blocks shared now (prefix caching). Default: the table asks itself."""

    # ---- the table's own calls -------------------------------------------------------------------
    def add_request(self, req_id: int) -> None:
        self.table.add_request(req_id)

    def remove_request(self, req_id: int) -> list[int]:
        """Forgets the request; returns its block list."""
        return list(self.table.remove_request(req_id))

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.table

    def request_ids(self) -> list[int]:
        return list(self.table.request_ids())

    def num_tokens(self, req_id: int) -> int:
        return self.table.num_tokens(req_id)

    def kv_len(self, req_id: int) -> int:
        return self.table.kv_len(req_id)

    def block_ids(self, req_id: int) -> list[int]:
        return list(self.table.block_ids(req_id))

    def metadata_bytes_per_token(self) -> float:
        return self.table.metadata_bytes_per_token()

    # ---- checks --------------------------------------------------------------------------------
    def live_slots(self, req_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(live ids ascending, their flat slots): what the I1 hash reads. int64 arrays."""
        seq = self.sequence(req_id)
        ids = np.flatnonzero(seq.live[: seq.num_tokens])
        return ids, seq.slot_of[ids].astype(np.int64)

    def check_integrity(self, req_ids: Iterable[int], is_shared: Callable[[int], bool]) -> None:
        """I2 for these requests (every live id -> one slot, no slot twice, counters) and block
        disjointness among them. Raises RuntimeError naming the first violation."""
        lists = {}
        for req_id in req_ids:
            seq = self.sequence(req_id)
            check_sequence(req_id, seq, self.tokens_per_block)
            lists[req_id] = seq.block_ids
        check_blocks_disjoint(lists, is_shared)


class PythonCore(TableCore):
    impl = "python"

    def __init__(self, tokens_per_block: int, is_shared: Callable[[int], bool] | None = None) -> None:
        super().__init__(tokens_per_block)
        self.table = TokenTable(tokens_per_block, is_shared)

    def commit_lazy(self, req_id, token_ids, src_slots, dst_slots, blocks_to_free) -> list[int]:
        table = self.table
        plan = RelocationPlan(req_id, "lazy", table.version(req_id), tuple(token_ids), tuple(src_slots),
                              tuple(dst_slots), tuple(blocks_to_free), table.num_blocks(req_id), None)
        return commit_plan(table, plan)

    def sequence(self, req_id: int) -> Sequence:
        return self.table.seq(req_id)


class NativeCore(TableCore):
    impl = "cpp"

    def __init__(self, tokens_per_block: int) -> None:
        super().__init__(tokens_per_block)
        core = load_native()
        if core is None:
            raise RuntimeError("the C++ core is not built (install the package with its cpp/ build)")
        self.table = core.TokenTable(tokens_per_block)
        self._shared: frozenset[int] = frozenset()  # what the table was told is shared

    def commit_lazy(self, req_id, token_ids, src_slots, dst_slots, blocks_to_free) -> list[int]:
        return list(self.table.commit_lazy(req_id, token_ids, src_slots, dst_slots, blocks_to_free))

    def sync_shared(self, shared: Collection[int]) -> None:
        """The C++ table keeps its own set of shared blocks: it is sent what changed."""
        if not shared and not self._shared:  # nothing shared before or now (no prefix caching)
            return
        now, known = frozenset(shared), self._shared
        if now == known:
            return
        for block_id in now - known:
            self.table.set_shared(block_id, True)
        for block_id in known - now:
            self.table.set_shared(block_id, False)
        self._shared = now

    def sequence(self, req_id: int) -> Sequence:
        blocks, kv_len, num_tokens, num_live, version, slot_of, live, token_at, live_per_block, pending = \
            self.table.state(req_id)
        seq = Sequence()
        seq.block_ids, seq.block_index = list(blocks), {b: i for i, b in enumerate(blocks)}
        seq.num_tokens, seq.kv_len, seq.num_live, seq.version = num_tokens, kv_len, num_live, version
        seq.slot_of = np.array(slot_of, dtype=np.int32)
        seq.live = np.array(live, dtype=np.uint8)
        seq.token_at = np.array(token_at, dtype=np.int32)
        seq.live_per_block = np.array(live_per_block, dtype=np.int32)
        seq.pending_dead = list(pending)
        seq.reserve_tokens(0)  # rebinds the memoryviews to the arrays
        return seq


def make_core(impl: str, tokens_per_block: int, is_shared: Callable[[int], bool] | None = None) -> TableCore:
    """The table implementation ``impl`` ("auto", "cpp", "python") resolves to."""
    if resolve_impl(impl) == "cpp":
        return NativeCore(tokens_per_block)
    return PythonCore(tokens_per_block, is_shared)
