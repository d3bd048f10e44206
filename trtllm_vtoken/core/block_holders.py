# SPDX-License-Identifier: Apache-2.0
"""How many requests of a token table hold each block.

The host allocates the blocks it appends; a block already in a request's list may join another
request only if it is shared (prefix caching). Given to a second request unshared, both would
write their KV into its slots and each would read the other's tokens as its own; nothing
downstream notices without the invariant checks. Counting the holders lets the table and the
step refuse such a block before anything changes, at one dictionary update per block that
joins or leaves a list (a decode step appends a block per request every ``tokens_per_block``
tokens). The count is the table's own: the host's pool (TensorRT-LLM's allocator, or
``PrefixCache``, whose references include the cache's) is not visible to it.

    block_ids of request 3: [7, 2]      request 5: [7, 4]      (7 shared: a cached prefix)
    holders:                {7: 2, 2: 1, 4: 1}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class BlockHolders:
    """Block id -> number of request block lists that hold it (absent: none)."""

    __slots__ = ("_count",)

    def __init__(self) -> None:
        self._count: dict[int, int] = {}

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._count

    def count(self, block_id: int) -> int:
        return self._count.get(block_id, 0)

    def counts(self) -> dict[int, int]:
        """A copy of the counts (for the integrity check)."""
        return dict(self._count)

    def held_unshared(self, block_ids: Iterable[int], is_shared: Callable[[int], bool]) -> list[int]:
        """The given blocks that a request holds already and that are not shared: the ones no
        further request may take (in the order given)."""
        count = self._count
        return [b for b in block_ids if b in count and not is_shared(b)]

    def hold(self, block_ids: Iterable[int]) -> None:
        """The blocks joined one request's list."""
        count = self._count
        for b in block_ids:
            count[b] = count.get(b, 0) + 1

    def let_go(self, block_ids: Iterable[int]) -> None:
        """The blocks left one request's list (each held before: the table's own bookkeeping)."""
        count = self._count
        for b in block_ids:
            left = count[b] - 1
            if left:
                count[b] = left
            else:
                del count[b]
