# SPDX-License-Identifier: Apache-2.0
"""The H2O-pass-alone benchmark's layout (``bench/h2o_pass.py``): every request's ids live in its
own blocks, placed contiguously or scattered, and the pass picks one candidate per request."""

from __future__ import annotations

import numpy as np
import pytest

from trtllm_vtoken.bench.h2o_pass import pass_layout
from trtllm_vtoken.core.native import load


@pytest.mark.parametrize("placement", ["contiguous", "scattered"])
def test_the_layout_holds_each_request_and_the_pass_picks_one_candidate_each(placement):
    batch, context, tpb = 6, 100, 8
    a = pass_layout(batch, context, tpb, placement)
    blocks = a["block_table"]
    assert len(np.unique(blocks)) == blocks.size  # no block twice
    assert (np.diff(blocks, axis=1) == 1).all() == (placement == "contiguous")
    positions = np.arange(context)
    for row in range(batch):
        slots = blocks[row, positions // tpb].astype(np.int64) * tpb + positions % tpb
        np.testing.assert_array_equal(a["tokens"][slots], positions)
    assert (a["tokens"] >= 0).sum() == batch * context
    with pytest.raises(ValueError, match="placement"):
        pass_layout(batch, context, tpb, "random")
    native = load()
    if native is None:
        pytest.skip("the C++ core is not built")
    rows, picked = native.select_lowest(a["tokens"], blocks, tpb, a["rows"], a["kv_len"], a["lo"], a["hi"],
                                        a["excess"], a["stat"], a["mass"], None, 1)
    np.testing.assert_array_equal(rows, np.arange(batch))
    lowest = [a["lo"][i] + int(np.argmin(a["mass"][i, a["lo"][i]:a["hi"][i]])) for i in range(batch)]
    np.testing.assert_array_equal(picked, lowest)  # ids are positions here: the lowest mass in [lo, hi)
