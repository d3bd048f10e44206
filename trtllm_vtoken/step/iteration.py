# SPDX-License-Identifier: Apache-2.0
"""One iteration of ``DecodeStep`` between its start and its end: the checked batch and what the
decision left for the table's step and the output (``step.py``: ``_begin`` makes it, the table's
step and ``_end`` read it; with the call on the worker it waits there in between)."""

from __future__ import annotations

from typing import Any

import numpy as np

from trtllm_vtoken.step.decide import NativeDecision
from trtllm_vtoken.step.io import csr_arrays


class Iteration:
    """A step between its start and its end. Arrays [B] unless said."""

    __slots__ = (
        "_index_of",
        "before",
        "block_lists",
        "blocks",
        "length",
        "native",
        "num_new",
        "offsets",
        "registers",
        "req_ids",
        "rows",
        "stream",
        "victims",
    )

    def __init__(self, req_ids: np.ndarray, rows: np.ndarray, num_new: np.ndarray, offsets: np.ndarray | None,
                 blocks: np.ndarray | Any, stream: Any) -> None:
        """``offsets`` None: ``blocks`` holds the host's list of new blocks per request, which the
        fused call takes as they are (``new_blocks_csr`` for the rest)."""
        self.req_ids, self.rows, self.num_new, self.offsets, self.blocks = req_ids, rows, num_new, offsets, blocks
        self.stream = stream
        self.native: NativeDecision | None = None  # the fused call's decision (None: the general path)
        self.length: np.ndarray | None = None  # kv_len after the new tokens (general path, background)
        self.victims: tuple[np.ndarray, ...] | None = None  # general path: rows, slots, CSR offsets, ids
        self.before: Any = None  # the invariant checks' state before the table's step
        self.block_lists: tuple[np.ndarray, np.ndarray] | None = None  # rows' blocks, counts, before the call
        self.registers = False  # the fused call registers the batch (on the worker)
        self._index_of: dict[int, int] | None = None  # request id -> its index, made when first asked

    def again(self, blocks: Any, stream: Any, block_lists: tuple[np.ndarray, np.ndarray] | None) -> Iteration:
        """This iteration once more, for a repeated call (``step/repeat.py``): the same batch and
        decision, this step's new blocks (one list per request), stream and block lists. Only a
        call on the worker repeats, with no checks or background compaction: nothing else of
        the last step's is read again."""
        self.offsets, self.blocks, self.stream, self.block_lists = None, blocks, stream, block_lists
        return self

    def new_blocks_csr(self) -> tuple[np.ndarray, np.ndarray]:
        """The batch's new blocks in CSR form (offsets, blocks int64), put in it once where the
        host passed one list per request (``offsets`` None until then)."""
        if self.offsets is None:
            self.offsets, self.blocks = csr_arrays(self.blocks)
        return self.offsets, self.blocks

    def listed_before(self, req_id: int) -> list[int]:
        """A request's block list as the decision saw it, from the rows copied before the call
        (``block_lists``), with its new blocks where the call registered them."""
        i = self._index()[req_id]
        table, counts = self.block_lists
        blocks = table[i, : counts[i]].tolist()
        if self.registers:
            offsets, new_blocks = self.new_blocks_csr()
            blocks += new_blocks[offsets[i] : offsets[i + 1]].tolist()
        return blocks

    def _index(self) -> dict[int, int]:
        if self._index_of is None:
            self._index_of = {req: i for i, req in enumerate(self.req_ids.tolist())}
        return self._index_of
