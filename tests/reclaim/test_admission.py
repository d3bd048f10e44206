# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest

from trtllm_vtoken.core import BlockPool
from trtllm_vtoken.reclaim import AdmissionConfig, AdmissionController
from trtllm_vtoken.reclaim.admission import RequestState


@pytest.mark.parametrize(
    "variant, mode, expected",
    [("native", "dense", 7), ("naive-evict", "dense", 7), ("vtoken", "dense", 3), ("vtoken", "lazy", 5)],
)
def test_peak_blocks_per_variant(variant, mode, expected):
    pool = BlockPool(64, 4)
    ctl = AdmissionController(pool, AdmissionConfig(variant=variant, mode=mode, fragmentation_threshold=2))
    # 12 tokens so far, 8 live, 16 more to come, budget 10 live tokens
    state = RequestState(logical_len=12, live=8, remaining=16, budget=10)
    # native: ceil(28/4) = 7; vtoken dense: ceil(min(24, 11)/4) = 3; lazy: +2
    assert ctl.peak_blocks(state) == expected


def test_lazy_peak_never_exceeds_what_the_tokens_fill():
    # 12 tokens, all live, 2 more to come, budget 10: dense ceil(13/4) = 4 = native's ceil(14/4);
    # lazy's threshold of 2 would make 6, but compaction takes no block of its own
    state = RequestState(logical_len=12, live=12, remaining=2, budget=10)
    peaks = {mode: AdmissionController(BlockPool(64, 4), AdmissionConfig(mode=mode, fragmentation_threshold=2))
             .peak_blocks(state) for mode in ("dense", "lazy")}
    assert peaks == {"dense": 4, "lazy": 4}


def test_vtoken_admits_more_requests_than_native_in_the_same_pool():
    def count_admitted(variant: str) -> int:
        ctl = AdmissionController(BlockPool(40, 4), AdmissionConfig(variant=variant))
        n = 0
        while ctl.admit(n, prompt_len=8, max_new_tokens=32, budget=8):
            n += 1
        return n

    # native reserves ceil(40/4) = 10 blocks each; vtoken ceil(9/4) = 3 (prefill needs 2)
    assert (count_admitted("native"), count_admitted("vtoken")) == (4, 13)


def test_reclaimed_blocks_are_credited():
    pool = BlockPool(10, 4)
    ctl = AdmissionController(pool, AdmissionConfig(variant="vtoken", evacuation_headroom=1))
    assert ctl.admit(0, prompt_len=24, max_new_tokens=8, budget=8)  # prefill needs 6 of 10 - 1
    blocks = pool.allocate(6)
    ctl.update(0, logical_len=24, live=24, remaining=8, held=6)
    # Before eviction the next token makes 25 live: peak 7, so 1 more block is reserved.
    assert ctl.available_blocks() == 4 - 1 - 1
    assert not ctl.can_admit(12, 4, 8)  # needs 3
    pool.free(blocks[3:])  # eviction to 8 live + dense compaction keep ceil(8 / 4) = 2 (+1 spare)
    ctl.update(0, logical_len=24, live=8, remaining=8, held=3)
    # peak ceil(9 / 4) = 3 = held: the released blocks are available to others at once.
    assert ctl.available_blocks() == 7 - 0 - 1
    assert ctl.can_admit(12, 4, 8)
    ctl.finish(0)
    assert ctl.available_blocks() == 7 - 1


def test_bad_admission_input():
    ctl = AdmissionController(BlockPool(8, 4))
    with pytest.raises(ValueError, match="must be positive"):
        ctl.can_admit(0, 4, None)
    assert ctl.admit(1, 4, 4, None)
    with pytest.raises(ValueError, match="already admitted"):
        ctl.admit(1, 4, 4, None)
    with pytest.raises(KeyError, match="not admitted"):
        ctl.finish(2)
    with pytest.raises(ValueError, match="variant"):
        AdmissionConfig(variant="magic")
