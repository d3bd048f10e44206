# SPDX-License-Identifier: Apache-2.0
"""What a host hands the step once per iteration, and what it gets back. B = requests in the
batch; lists per request come in CSR form (request i's entries are
``values[offsets[i]:offsets[i + 1]]``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from operator import index
from typing import Any

import numpy as np

from trtllm_vtoken.reclaim.copy import CopyHandle
from trtllm_vtoken.reclaim.step_batch import StepBatchResult

Mass = Callable[[np.ndarray], Any]
"""A function of the batch's token layout (int [B, L], the live logical id at each position or
-1) returning the attention mass per position [B, >= L]: for hosts whose attention is computed
from that layout (the simulated backend). Its time is not counted as the step's."""


@dataclass
class StepInput:
    """One iteration of a batch, after the forward wrote the new tokens' KV."""

    req_ids: Sequence[int]
    """[B] requests of the batch, each added to the step (``DecodeStep.add_request``) once."""
    num_new: Sequence[int]
    """[B] tokens each request wrote this iteration: 1 when decoding, the prompt at prefill."""
    new_block_offsets: Sequence[int] | None
    """[B + 1] CSR offsets into ``new_blocks``; None: ``new_blocks`` holds one sequence per request."""
    new_blocks: Sequence[int] | Sequence[Sequence[int]]
    """Blocks the host appended to each request's list for the new tokens (allocated by it): CSR
    values, or (``new_block_offsets`` None) request i's as ``new_blocks[i]``, a list or tuple, the
    form in which the C++ core takes them with no numpy call on the host's thread."""
    mass: Any = None
    """Attention each physical position received this iteration, summed over layers, heads and
    queries: [B, >= L] (numpy or torch; L covers every row's length after the new tokens), or a
    ``Mass`` function, or None when no policy of the batch observes attention."""
    unobserved: Sequence[int] | None = None
    """[B] how many of each request's new tokens the mass does not cover (the newest ones: a
    forward launched after the one the mass is of wrote them, as the overlap scheduler's step
    beside the next forward takes them in). Policies observe the tokens the forward attended
    only, so a token's statistics start with the first forward that saw it, as in the plain
    order. None: the mass covers every token."""
    pressure: bool = False
    """The pool is short of free blocks: lazy compaction runs whatever the fragmentation, and
    background compaction commits at once."""
    commit_at_once: bool = False
    """Background compaction commits the batch's plans in this step (their copies ordered before
    the next forward), as under pressure: a prompt prefilled in chunks has more to come, whose
    next chunk needs the blocks holes hold."""
    stream: Any = None
    """CUDA: the stream the next forward runs on; it is made to wait on the copy (I3). None: the
    host waits for the copy (CPU: it is synchronous)."""

    @classmethod
    def of_lists(cls, req_ids: Sequence[int], num_new: Sequence[int], new_blocks: Sequence[Sequence[int]],
                 **kwargs: Any) -> StepInput:
        """The batch with request i's new blocks as ``new_blocks[i]`` (a list or tuple)."""
        return cls(req_ids, num_new, None, new_blocks, **kwargs)

    def new_blocks_csr(self) -> tuple[np.ndarray, np.ndarray]:
        """The new blocks in CSR form, whichever form they came in: (offsets, blocks) int64."""
        if self.new_block_offsets is None:
            return csr_arrays(self.new_blocks)
        return int64_vector(self.new_block_offsets), int64_vector(self.new_blocks)

    @classmethod
    def decode(cls, req_ids: Sequence[int], new_blocks: Sequence[Sequence[int]] | None = None,
               **kwargs: Any) -> StepInput:
        """One new token per request; ``new_blocks[i]``: request i's new blocks (default none)."""
        lists = new_blocks if new_blocks is not None else [()] * len(req_ids)
        return cls.of_lists(list(req_ids), [1] * len(req_ids), lists, **kwargs)


def csr(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, list[int]]:
    """Per-request lists as (offsets int64 [B + 1], the values flat)."""
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum([len(values) for values in lists], out=offsets[1:])
    return offsets, [value for values in lists for value in values]


NEW_BLOCKS_REFUSED = "slots: new blocks must be one sequence of block ids per request"


def csr_arrays(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """A batch's new blocks given one list or tuple of ids per request, as ``csr`` with the values
    an int64 array too. Taken as the C++ core takes them (``cpp/core/slot_args.h``
    ``listed_blocks``): anything else per request (an array, a range), or an id that is no integer
    (``operator.index``) or lies outside int64, is a ValueError, before anything changed."""
    try:
        if not all(isinstance(values, (list, tuple)) for values in lists):
            raise TypeError(NEW_BLOCKS_REFUSED)
        offsets, flat = csr(lists)
        return offsets, np.array([index(block) for block in flat], dtype=np.int64)
    except (TypeError, OverflowError):
        raise ValueError(NEW_BLOCKS_REFUSED) from None


INT64 = np.dtype(np.int64)


def int64_vector(values: Any) -> np.ndarray:
    """``values`` as a 1-D int64 array: itself where it is one (``csr``'s offsets; no numpy call
    on the host's thread then), else converted."""
    if type(values) is np.ndarray and values.dtype is INT64 and values.ndim == 1:
        return values
    return np.asarray(values, dtype=np.int64).reshape(-1)


@dataclass
class StepOutput:
    """What the step did. int64 arrays; CSR as the input."""

    req_ids: np.ndarray
    """[B], read-only."""
    victim_offsets: np.ndarray
    """[B + 1] into ``victims``."""
    victims: np.ndarray
    """Logical ids evicted this step, each request's ascending."""
    table: StepBatchResult
    """The token table's step: moves (token, source slot, destination slot; already copied or
    the copy submitted), the blocks released request by request (the host frees them in its pool,
    or its allocator releases them: TensorRT-LLM's rewind_kv_cache by ``lost``), and each
    request's physical KV length after the step (the refreshed lengths for the kernels)."""
    lost: np.ndarray
    """[B] physical tokens each request's length lost this step (after its new tokens): what a
    position-shift pass rotates its surviving keys by (-lost), what TensorRT-LLM rewinds."""
    num_tokens: np.ndarray
    """[B] logical lengths (prompt + generated): the next token's position is this."""
    changed: np.ndarray
    """[B] true (nonzero) where the request's layout changed: it moved tokens, released blocks or
    got shorter."""
    copy: CopyHandle | None = None
    """The submitted copy, already ordered before the host's next forward (None: no moves)."""

    # The counts need no array made: the fused call's output sets them as it comes (``FusedOutput``).
    @cached_property
    def num_evicted(self) -> int:
        return len(self.victims)

    @cached_property
    def num_changed(self) -> int:
        return int(np.count_nonzero(self.changed))

    @cached_property
    def num_moves(self) -> int:
        return len(self.table.move_src)

    @cached_property
    def num_freed(self) -> int:
        """Blocks released: ``len(table.freed)``."""
        return len(self.table.freed)

    def moved_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(``table.move_src``, ``table.move_dst``): what the copy reads."""
        return self.table.move_src, self.table.move_dst

    def touched_blocks(self, tokens_per_block: int) -> set[int]:
        """Blocks the step's moves read or wrote, and the blocks it released: none of them may be
        shared (prefix caching) or cached."""
        table = self.table
        return {*(table.move_src // tokens_per_block).tolist(), *(table.move_dst // tokens_per_block).tolist(),
                *table.freed.tolist()}

    def victims_of(self, i: int) -> list[int]:
        return self.victims[self.victim_offsets[i] : self.victim_offsets[i + 1]].tolist()
