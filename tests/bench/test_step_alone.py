# SPDX-License-Identifier: Apache-2.0
"""``bench/step_alone.py``: the step alone runs every pass of ``CACHES`` on one prefilled step, so
a request that evicts nothing (indirection-only) grows by a token a step over all of them; its
pool must hold that, where the bench's engine pool holds one pass (``StepBenchConfig.max_seq_len``)."""

from __future__ import annotations

import pytest

from trtllm_vtoken.bench.step_config import StepBenchConfig
from trtllm_vtoken.bench.step_alone import CACHES, ROWS, time_step_alone
from trtllm_vtoken.core.native import load


@pytest.mark.parametrize("impl", ["cpp", "python"])
def test_every_pass_fits_when_more_steps_run_than_the_engine_pool_holds(impl):
    if impl == "cpp" and load() is None:
        pytest.skip("the C++ core is not built")
    cfg = StepBenchConfig(batches=(4,), context=96, tokens_per_block=8, steps=20, warmup=3, impls=(impl,))
    # the engine's pool: ceil(max_seq_len / tpb) + 1 blocks a request, fewer than the passes need
    assert len(CACHES) * (cfg.warmup + cfg.steps) > (-(-cfg.max_seq_len() // 8) + 1) * 8 - cfg.context
    rows = time_step_alone(cfg, 4, impl)
    assert [(r["label"], r["caches"]) for r in rows] == [(label, c) for label, _ in ROWS for c in CACHES]
    for r in rows:
        assert r["evicted_per_step"] == (0 if r["label"] == "indirection-only" else 4)
