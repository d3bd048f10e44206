# SPDX-License-Identifier: Apache-2.0
"""The KV block allocator, in TensorRT-LLM's terms (block ids, ``tokens_per_block``).

A block holds ``tokens_per_block`` token slots in every layer. Slot ``s`` names offset
``s % tokens_per_block`` of block ``s // tokens_per_block``; that flat number is what the token
table stores. A block referenced by several requests (a shared prompt prefix) has a reference
count above one and is never written, relocated or freed by vToken while shared.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockPool:
    """Free list plus reference counts over ``num_blocks`` blocks of ``tokens_per_block`` slots."""

    def __init__(self, num_blocks: int, tokens_per_block: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
        if num_blocks * tokens_per_block > 2**31:
            raise ValueError(
                f"{num_blocks} blocks of {tokens_per_block} slots exceed 2**31 slots: a slot, block * "
                f"tokens_per_block + offset, is an int32 (the token table's and the kernels' block offsets)"
            )
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.shared: set[int] = set()
        """Blocks referenced by several requests now (``is_shared``), kept as the counts change."""

    # ---- queries ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def is_shared(self, block_id: int) -> bool:
        """True if several requests reference ``block_id`` (prefix caching)."""
        return self.ref_counts[block_id] > 1

    # ---- mutations ----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """Takes ``n`` free blocks (ref count 1 each), oldest-freed first.

        Returns None, changing nothing, when fewer than ``n`` blocks are free: "does not fit now"
        is an answer, not an error. Raises ValueError for negative ``n``.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self.free_ids):
            return None
        return [self._take() for _ in range(n)]

    def share(self, block_ids: Iterable[int]) -> None:
        """Adds one reference to each block (another request now reads it as its prefix).

        Raises ValueError, changing nothing, if a block id is out of range or not allocated.
        """
        ids = list(block_ids)
        for block_id in ids:
            self._check_allocated(block_id)
        for block_id in ids:
            self.ref_counts[block_id] += 1
            if self.ref_counts[block_id] == 2:
                self.shared.add(block_id)

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference from each block; a block whose count reaches 0 is free again.

        Raises ValueError, changing nothing, if a block is not allocated or is dropped more times
        than it is referenced.
        """
        ids = list(block_ids)
        drops: dict[int, int] = {}
        for block_id in ids:
            self._check_allocated(block_id)
            drops[block_id] = drops.get(block_id, 0) + 1
            if drops[block_id] > self.ref_counts[block_id]:
                raise ValueError(
                    f"block {block_id} freed {drops[block_id]} times but has "
                    f"{self.ref_counts[block_id]} reference(s)"
                )
        for block_id in ids:
            self._release(block_id)

    # ---- integrity ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raises RuntimeError, with the numbers, if free list and reference counts disagree."""
        free = set(self.free_ids)
        if len(free) != len(self.free_ids):
            raise RuntimeError(f"free list holds duplicates: {len(self.free_ids)} ids, {len(free)} unique")
        used = sum(1 for count in self.ref_counts if count > 0)
        if used + len(free) != self.num_blocks:
            raise RuntimeError(f"block leak: used({used}) + free({len(free)}) != total({self.num_blocks})")
        bad = [b for b in free if self.ref_counts[b] != 0]
        if bad or any(count < 0 for count in self.ref_counts):
            raise RuntimeError(f"blocks on the free list with references or negative counts: {bad[:8]}")

    # ---- private ------------------------------------------------------------------------------
    def _take(self) -> int:
        block_id = self.free_ids[0]
        if self.ref_counts[block_id] != 0:  # handing it out would give two owners one block's KV
            raise RuntimeError(f"block {block_id} is on the free list with {self.ref_counts[block_id]} reference(s)")
        self.free_ids.popleft()
        self.ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 1:
            self.shared.discard(block_id)
        if self.ref_counts[block_id] == 0:
            self.free_ids.append(block_id)

    def _check_allocated(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is not allocated")
