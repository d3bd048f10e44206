# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest

from trtllm_vtoken.core import BlockPool


def test_allocate_takes_lowest_ids_then_reuses_in_free_order():
    pool = BlockPool(6, 4)
    assert pool.allocate(3) == [0, 1, 2]
    pool.free([1, 0])
    # Freed blocks go to the back of the free list: 3, 4, 5 first, then 1, 0.
    assert pool.allocate(5) == [3, 4, 5, 1, 0]
    assert pool.num_free == 0
    pool.check_integrity()


def test_allocate_returns_none_when_it_does_not_fit_and_changes_nothing():
    pool = BlockPool(4, 4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.num_free == 1 and list(pool.free_ids) == [3]
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(-1)


def test_shared_blocks_are_freed_after_last_reference():
    pool = BlockPool(4, 4)
    blocks = pool.allocate(2)
    pool.share(blocks[:1])
    assert pool.is_shared(0) and not pool.is_shared(1)
    pool.free(blocks)
    assert pool.ref_counts[:2] == [1, 0] and list(pool.free_ids) == [2, 3, 1]
    pool.free([0])
    assert pool.num_free == 4
    pool.check_integrity()


@pytest.mark.parametrize("bad, match", [([9], "out of range"), ([3], "not allocated"), ([0, 0], "freed 2 times")])
def test_free_rejects_bad_ids_and_changes_nothing(bad, match):
    pool = BlockPool(4, 4)
    pool.allocate(2)
    before = (list(pool.ref_counts), list(pool.free_ids))
    with pytest.raises(ValueError, match=match):
        pool.free(bad)
    assert (pool.ref_counts, list(pool.free_ids)) == before


def test_share_rejects_free_block():
    pool = BlockPool(4, 4)
    with pytest.raises(ValueError, match="not allocated"):
        pool.share([2])


def test_check_integrity_reports_leak():
    pool = BlockPool(4, 4)
    pool.allocate(1)
    pool.free_ids.popleft()  # lose block 1 without a reference: a leak
    with pytest.raises(RuntimeError, match=r"block leak: used\(1\) \+ free\(2\) != total\(4\)"):
        pool.check_integrity()


@pytest.mark.parametrize("num_blocks, tpb", [(0, 4), (4, 0)])
def test_constructor_rejects_non_positive_sizes(num_blocks, tpb):
    with pytest.raises(ValueError):
        BlockPool(num_blocks, tpb)


def test_slots_must_fit_an_int32():
    """Slot = block * tokens_per_block + offset, an int32 in the token table and the kernels."""
    with pytest.raises(ValueError, match=r"3 blocks of 1073741824 slots exceed 2\*\*31 slots"):
        BlockPool(3, 2**30)
    assert BlockPool(2, 2**30).num_blocks == 2
