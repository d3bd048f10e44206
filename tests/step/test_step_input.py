# SPDX-License-Identifier: Apache-2.0
"""A host's new blocks, one list per request or in CSR form (``step/io.py``): ``csr`` gives the
running sums of the lists' lengths and their concatenation, whatever mix of empty and filled
lists (a decode step: mostly empty), lists or tuples; the C++ core's conversion of the lists
(``cpp/core/slot_args.h`` ``listed_blocks``) is held to the same, and refuses what is not one."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from trtllm_vtoken.step import StepInput
from trtllm_vtoken.step.io import csr

LISTS = st.lists(st.one_of(st.lists(st.integers(0, 1000), max_size=4), st.just([])), max_size=70)


@given(LISTS, st.booleans())
def test_csr_is_running_lengths_and_concatenation(lists, as_tuples):
    given_lists = tuple(tuple(values) for values in lists) if as_tuples else lists
    offsets, flat = csr(given_lists)
    assert offsets.dtype == np.int64
    assert offsets.tolist() == [0, *np.cumsum([len(values) for values in lists]).tolist()]
    assert flat == [b for values in lists for b in values]
    assert isinstance(flat, list)


def test_of_lists_and_decode_pass_one_list_per_request_and_csr_gives_them_back():
    inp = StepInput.of_lists([4, 5, 6], [1, 3, 1], [[], [7, 8], []], pressure=True)
    assert inp.req_ids == [4, 5, 6] and inp.num_new == [1, 3, 1] and inp.pressure
    assert inp.new_block_offsets is None and inp.new_blocks == [[], [7, 8], []]
    offsets, blocks = inp.new_blocks_csr()
    assert offsets.tolist() == [0, 0, 2, 2] and blocks.tolist() == [7, 8] and blocks.dtype == np.int64
    decode = StepInput.decode([4, 5], [(), (9,)])
    assert decode.num_new == [1, 1] and [a.tolist() for a in decode.new_blocks_csr()] == [[0, 0, 1], [9]]
    assert [a.tolist() for a in StepInput.decode([]).new_blocks_csr()] == [[0], []]
    csr_given = StepInput([4], [1], [0, 1], [3])
    assert [a.tolist() for a in csr_given.new_blocks_csr()] == [[0, 1], [3]]
