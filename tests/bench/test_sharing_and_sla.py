# SPDX-License-Identifier: Apache-2.0
"""Prefix sharing (simulated, exact block counts) and the SLA selection rule."""

from __future__ import annotations

import pytest

from trtllm_vtoken.bench.sharing import SharingBenchConfig, run_sharing_bench
from trtllm_vtoken.bench.sla import SlaBenchConfig, select


def test_sharing_never_moves_shared_blocks_and_reaches_the_ideal():
    result = run_sharing_bench(SharingBenchConfig(requests=4, decode_tokens=24, degrees=(1, 2, 4)))
    rows = {(r["degree"], r["variant"]): r for r in result["rows"]}
    for degree in (1, 2, 4):
        vtoken, naive = rows[degree, "vtoken"], rows[degree, "naive-evict"]
        assert vtoken["plans_touching_shared"] == 0
        assert vtoken["invariant_checks"] == vtoken["relocations"] > 0
        assert vtoken["blocks_end"] == vtoken["ideal_blocks_end"] <= naive["blocks_end"]
        assert vtoken["shared_blocks"] == naive["shared_blocks"] == (0 if degree == 1 else 4 // degree * 8)


def test_sharing_config_rejects_degrees_that_do_not_divide_the_requests():
    with pytest.raises(ValueError, match="must divide requests"):
        SharingBenchConfig(requests=6, degrees=(4,))


def test_sla_selects_the_highest_level_within_the_sla():
    levels = [{"clients": c, "latency_p95_s": p} for c, p in ((1, 1.0), (2, 1.2), (4, 1.9), (8, 1.4))]
    assert select(levels, 1.5)["clients"] == 8
    assert select(levels, 0.5) is None
    with pytest.raises(ValueError, match="ascending"):
        SlaBenchConfig(concurrency=(4, 2))
