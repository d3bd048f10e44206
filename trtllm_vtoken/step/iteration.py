# SPDX-License-Identifier: Apache-2.0
"""One iteration of a ``DecodeStep``: its batch, checked before anything changes (the step's first
act: a bad batch raises and leaves the step as it was), and what the step records about it
between its start and its end.

    sizes        one num_new per request, one block offset more          ValueError
    requests     every request added to the step                         KeyError
    mass         present when a policy of the batch observes attention,
                 [B, >= the longest length after the new tokens]         ValueError
    unobserved   none, or one count in [0, num_new] per request          ValueError
    new blocks   ``check_new`` (none held by a request already unless shared): the Python
                 core runs it; the C++ core runs its mirror
    and tokens   (``cpp/core/slots.h`` ``check_new``, the same words) in its registration
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from trtllm_vtoken.core.block_holders import BlockHolders
from trtllm_vtoken.policies import EvictionPolicy
from trtllm_vtoken.step.decide import Decision
from trtllm_vtoken.step.io import StepInput, csr_arrays, int64_vector
from trtllm_vtoken.step.slots import LISTS, SlotMap, copied


class Iteration:
    """A step between its start and its end. Arrays [B] unless said."""

    __slots__ = ("_index_of", "at_once", "before", "block_lists", "blocks", "decision", "host_ids", "num_new",
                 "offsets", "pressure", "registered", "req_ids", "rows", "stream", "unobserved")

    def __init__(self, req_ids: np.ndarray, rows: np.ndarray, num_new: np.ndarray, offsets: np.ndarray | None,
                 blocks: np.ndarray | Any, stream: Any, host_ids: np.ndarray | None = None,
                 pressure: bool = False, at_once: bool = False, unobserved: np.ndarray | None = None) -> None:
        """``offsets`` None: ``blocks`` holds the host's list of new blocks per request, which the
        C++ core takes as they are (``new_blocks_csr`` for the rest)."""
        self.req_ids, self.rows, self.num_new, self.offsets, self.blocks = req_ids, rows, num_new, offsets, blocks
        self.stream, self.pressure = stream, pressure  # pressure: the pool is short (``StepInput.pressure``)
        self.at_once = pressure or at_once  # background plans commit in this step (``StepInput.commit_at_once``)
        self.host_ids = host_ids  # the request ids as the output hands them over (read-only)
        self.decision: Decision | None = None  # what the call decides by (step/decide.py)
        self.registered = False  # the batch joined the layout on the host's thread (else the call registers it)
        self.before: Any = None  # the invariant checks' state before the call
        self.block_lists: tuple[np.ndarray, np.ndarray] | None = None  # rows' blocks, counts, before a worker's call
        self._index_of: dict[int, int] | None = None  # request id -> its index, made when first asked
        self.unobserved = unobserved  # [B] new tokens the mass does not cover, or None (``StepInput.unobserved``)

    def again(self, blocks: Any, stream: Any, block_lists: tuple[np.ndarray, np.ndarray] | None) -> Iteration:
        """This iteration once more, for a repeated call (``step/beside.py``): the same batch and
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
        if self._index_of is None:
            self._index_of = {req: i for i, req in enumerate(self.req_ids.tolist())}
        i = self._index_of[req_id]
        table, counts = self.block_lists
        blocks = table[i, : counts[i]].tolist()
        if not self.registered:
            offsets, new_blocks = self.new_blocks_csr()
            blocks += new_blocks[offsets[i] : offsets[i + 1]].tolist()
        return blocks


class InputChecks:
    """Checks a step's input against its batch layout, its policies and its shared blocks."""

    def __init__(self, slots: SlotMap, policies: list[EvictionPolicy], is_shared: Callable[[int], bool],
                 holders: BlockHolders | None) -> None:
        """``holders``: the Python core's table's count of each block's holders, for ``check_new``
        to run here (None where the C++ core runs it)."""
        self.slots, self.policies, self.is_shared, self.holders = slots, policies, is_shared, holders
        self.checks_new = holders is not None
        # A decode loop passes the same lists step after step: their arrays are reused.
        self._req_ids, self._num_new = LastList(), LastList()
        self._observing_of: tuple[int, list[int]] = (0, [])  # (policies seen, which of them observe)

    def validated(self, inp: StepInput) -> Iteration:
        """The iteration of a checked batch (int64 arrays), checked as the token table would check
        it: the sizes, known requests (KeyError), the mass, then ``check_new`` (Python core). New
        blocks given one list per request stay so (offsets None) where the C++ core checks them
        (``Iteration.new_blocks_csr``)."""
        (req_ids, listed), (num_new, _) = self._req_ids.convert(inp.req_ids), self._num_new.convert(inp.num_new)
        batch = len(req_ids)
        if inp.new_block_offsets is None:  # one list per request: the C++ core takes them so
            offsets, blocks = inp.new_block_offsets, inp.new_blocks
            if len(num_new) != batch or len(blocks) != batch:
                raise ValueError(f"step: {batch} requests need {batch} num_new and {batch} lists of new blocks, "
                                 f"got {len(num_new)} and {len(blocks)}")
            if self.checks_new:
                offsets, blocks = inp.new_blocks_csr()
        else:
            offsets, blocks = int64_vector(inp.new_block_offsets), int64_vector(inp.new_blocks)
            if len(num_new) != batch or len(offsets) != batch + 1:
                raise ValueError(f"step: {batch} requests need {batch} num_new and {batch + 1} block offsets, "
                                 f"got {len(num_new)} and {len(offsets)}")
        rows = self.slots.rows(listed)
        self.check_mass(inp.mass, rows, num_new)
        unobserved = None if inp.unobserved is None else int64_vector(inp.unobserved)
        if unobserved is not None and (len(unobserved) != batch or (unobserved < 0).any() or
                                       (unobserved > num_new).any()):
            raise ValueError(f"step: unobserved must give each of the {batch} requests a count in [0, num_new], "
                             f"got {unobserved.tolist()[:8]}")
        if self.checks_new:
            self.check_new(req_ids, rows, num_new, offsets, blocks)
        # The step may hand the same array to the next batch (``LastList``): the host gets a view.
        if unobserved is not None and not unobserved.any():
            unobserved = None  # the mass covers every new token: nothing for the decision to mask
        return Iteration(req_ids, rows, num_new, offsets, blocks, inp.stream, self._req_ids.read_only(req_ids),
                         inp.pressure, inp.commit_at_once, unobserved)

    def check_new(self, req_ids: np.ndarray, rows: np.ndarray, num_new: np.ndarray, offsets: np.ndarray,
                  blocks: np.ndarray) -> None:
        """The batch's new blocks and tokens: each request once, CSR offsets, counts >= 0, block
        ids in the pool (twice, or held by a request already, only if shared), every request's
        tokens within its blocks. The specification of ``cpp/core/slots.h`` ``check_new``.
        ValueError naming the first problem."""
        slots = self.slots
        if len(set(req_ids.tolist())) != len(req_ids):
            raise ValueError("step: a request appears twice in the batch")
        counts = offsets[1:] - offsets[:-1]
        if offsets[0] != 0 or offsets[-1] != len(blocks) or counts.min(initial=0) < 0:
            raise ValueError("step: new_block_offsets must start at 0, never decrease and end at len(new_blocks)")
        if num_new.min(initial=0) < 0:
            raise ValueError(f"step: num_new must be >= 0, got {num_new[num_new < 0][:4].tolist()}")
        if len(blocks):
            if blocks.min() < 0 or blocks.max() >= slots.num_blocks:
                raise ValueError(f"step: new block ids must lie in [0, {slots.num_blocks})")
            listed = blocks.tolist()
            if len(set(listed)) != len(listed):
                unique, times = np.unique(blocks, return_counts=True)
                if not all(self.is_shared(int(b)) for b in unique[times > 1]):
                    raise ValueError("step: a new block is given twice (only a shared block may join several requests)")
            held = self.holders.held_unshared(listed, self.is_shared)
            if held:
                raise ValueError(f"step: new block {held[0]} is held by a request already (only a shared block may "
                                 f"join several requests)")
        capacity = (slots.num_blocks_of[rows] + counts) * slots.tokens_per_block
        short = np.flatnonzero(slots.kv_len[rows] + num_new > capacity)
        if len(short):
            i = int(short[0])
            raise ValueError(f"step: request {req_ids[i]}'s {num_new[i]} new tokens do not fit its blocks")

    def check_mass(self, mass: Any, rows: np.ndarray, num_new: np.ndarray) -> None:
        """The mass a batch needs, checked before anything changes (a function's result is
        checked when it comes)."""
        if mass is None:
            observing = self._observing()
            if observing and np.isin(self.slots.policy[rows], observing).any():
                raise ValueError("a policy of this batch observes attention: pass the mass per position")
            return
        if callable(mass) or not len(rows):
            return
        shape = tuple(mass.shape)
        longest = int((self.slots.kv_len[rows] + num_new).max())
        if len(shape) != 2 or shape[0] != len(rows) or shape[1] < longest:
            raise ValueError(f"mass must be [{len(rows)}, >= {longest}] (the batch's longest request after its new "
                             f"tokens), got {list(shape)}")

    def _observing(self) -> list[int]:
        """Indices of the policies that observe attention (the step only ever adds policies)."""
        seen, observing = self._observing_of
        if seen != len(self.policies):
            observing = [i for i, p in enumerate(self.policies) if p.observes_attention()]
            self._observing_of = (len(self.policies), observing)
        return observing


class LastList:
    """A host's list (of request ids, token counts) as an int64 array and as a list of ints; a
    list equal to the last one converted gets the same array and the same list. The step never
    writes them, and hands a host only read-only views (``StepOutput.req_ids``): the native calls
    take a writeable array faster (nanobind takes a read-only one by a slower path:
    ``vtoken bench host``, ``benchmarks/RESULTS.md``)."""

    def __init__(self) -> None:
        self._last: tuple[list | tuple, np.ndarray, list[int], np.ndarray] | None = None

    def convert(self, listed: Any) -> tuple[np.ndarray, list[int]]:
        last = self._last
        if last is not None and type(listed) in LISTS and last[0] == listed:
            return last[1], last[2]
        values = np.asarray(listed, dtype=np.int64).reshape(-1)
        ints = values.tolist()
        if type(listed) in LISTS:
            self._last = (copied(listed), values, ints, read_only(values))
        return values, ints

    def read_only(self, values: np.ndarray) -> np.ndarray:
        """A read-only view of an array ``convert`` returned, made once for the reused one."""
        last = self._last
        return last[3] if last is not None and values is last[1] else read_only(values)


def read_only(values: np.ndarray) -> np.ndarray:
    view = values.view()
    view.flags.writeable = False
    return view
