# SPDX-License-Identifier: Apache-2.0
"""The step's batch layout: per physical slot of the pool, which live logical id it holds and the
policies' per-token statistics; per request, a row of a block table and its counters.

    tokens  int32 [(num_blocks + 1) * B]     slot -> live logical id, -1 if none (the last block is
                                             a scratch block that padding reads)
    stats   name -> [(num_blocks + 1) * B]   e.g. H2O's accumulated mass, beside the KV
    block_table  int32 [rows, max_blocks]    row r = one request's block list, scratch-padded

A batch's view is one gather through its rows of the block table, block by block:

    block_table[rows]       [[7, 2, 9, S], [4, 1, S, S]]           (S: the scratch block)
    tokens.reshape(-1, B)[that]  -> [2, 4, B] -> [2, 4 * B]        positions of each request

The step keeps both in step with the token table: new tokens write their ids (statistics start at
0), evictions clear them, relocations move ids and statistics from source to destination slot,
released blocks leave the rows. Every slot that does not hold a live token holds -1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

NO_TOKEN = -1


LISTS = (list, tuple)
"""The host containers (of request ids, token counts) whose contents, equal to the last batch's,
let the step reuse that batch's arrays: a decode loop passes the same ones step after step."""


def copied(values: list | tuple) -> list | tuple:
    """A snapshot of a host's list to compare the next one with (a tuple is one already)."""
    return values if type(values) is tuple else list(values)


class SlotMap:
    """Batch-layout state of one step over a pool of ``num_blocks`` blocks."""

    def __init__(self, num_blocks: int, tokens_per_block: int, native: Any = None) -> None:
        """``native``: the C++ core's module, which then registers a batch (``add_tokens``) in one
        call (``cpp/core/slots.h``, the same effects as the methods it combines); the rest of the
        layout's updates are then made by the step's native call (``step/fused.py``)."""
        if num_blocks <= 0 or tokens_per_block <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and tokens_per_block ({tokens_per_block}) must be positive")
        self.num_blocks, self.tokens_per_block = num_blocks, tokens_per_block
        self.native = native
        self._bound: Any = None  # native_layout's binding of the buffers below
        self.scratch = num_blocks
        self.tokens = np.full((num_blocks + 1) * tokens_per_block, NO_TOKEN, dtype=np.int32)
        self.stats: dict[str, np.ndarray] = {}
        self.row_of: dict[int, int] = {}
        self.membership = 0
        """Counts the requests that gained or lost a row: equal, the rows of the same requests are
        the same."""
        self._free_rows: list[int] = []
        self._last_rows: tuple[int, list, np.ndarray] | None = None  # rows(): (membership, ids, rows)
        self.block_table = np.full((8, 8), self.scratch, dtype=np.int32)
        self.num_blocks_of = np.zeros(8, dtype=np.int64)
        self.kv_len = np.zeros(8, dtype=np.int64)
        self.num_tokens = np.zeros(8, dtype=np.int64)
        self.num_live = np.zeros(8, dtype=np.int64)
        self.policy = np.full(8, -1, dtype=np.int64)
        """Per row: the index of the request's policy in its step (-1: it never evicts)."""

    # ---- requests ------------------------------------------------------------------------------
    def add_stat(self, name: str, dtype: type) -> None:
        """Keeps a per-slot statistic (0 everywhere to start), once per name."""
        if name in self.stats:
            if self.stats[name].dtype != np.dtype(dtype):
                raise ValueError(f"slot statistic {name!r} is {self.stats[name].dtype}, asked again as {dtype}")
            return
        self.stats[name] = np.zeros(len(self.tokens), dtype=dtype)
        self._bound = None

    def add_request(self, req_id: int) -> int:
        """A row for a new request (no blocks, no tokens); returns it."""
        if req_id in self.row_of:
            raise ValueError(f"request {req_id} already has a row")
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = len(self.row_of)
            if row >= len(self.kv_len):
                self._grow_rows(2 * len(self.kv_len))
        self.row_of[req_id] = row
        self.membership += 1
        self.num_blocks_of[row] = self.kv_len[row] = self.num_tokens[row] = self.num_live[row] = 0
        self.policy[row] = -1
        self.block_table[row] = self.scratch
        return row

    def remove_request(self, req_id: int, block_ids: Sequence[int], is_shared: Callable[[int], bool]) -> None:
        """Frees the request's row; its blocks' slots are emptied unless another request shares them."""
        row = self.row_of.pop(req_id)
        self.membership += 1
        self.empty_blocks(block_ids, is_shared)
        self.block_table[row] = self.scratch
        self._free_rows.append(row)

    def empty_blocks(self, block_ids: Sequence[int], is_shared: Callable[[int], bool]) -> None:
        """Empties the slots of the blocks a leaving request held, but of those another request
        still holds (they are shared until the leaving request drops its references)."""
        own = [b for b in block_ids if not is_shared(b)]
        if own:
            self.tokens.reshape(-1, self.tokens_per_block)[own] = NO_TOKEN

    def check_empty(self, block_ids: Sequence[int]) -> None:
        """RuntimeError naming the blocks (no request holds them) whose slots still name a token:
        a request given such a block would find those tokens beside its own."""
        blocks = np.asarray(list(block_ids), dtype=np.int64)
        if not len(blocks):
            return
        stale = blocks[(self.tokens.reshape(-1, self.tokens_per_block)[blocks] != NO_TOKEN).any(axis=1)]
        if len(stale):
            raise RuntimeError("blocks no request holds still name tokens in the step's slots: "
                               f"{sorted(stale.tolist())}")

    def rows(self, req_ids: Iterable[int]) -> np.ndarray:
        """[B] int64 rows of the requests. KeyError names an unknown request. A host asks for the
        same batch several times a step and step after step: a list equal to the last one asked
        for, no request having joined or left since, gets the same array (never to be written)."""
        last = self._last_rows
        if last is not None and type(req_ids) in LISTS and last[0] == self.membership and last[1] == req_ids:
            return last[2]
        try:
            rows = np.fromiter(map(self.row_of.__getitem__, req_ids), dtype=np.int64)
        except KeyError as err:
            raise KeyError(f"unknown request {err.args[0]}") from None
        if type(req_ids) in LISTS:
            self._last_rows = (self.membership, copied(req_ids), rows)
        return rows

    # ---- the step's updates -----------------------------------------------------------------------
    def add_tokens(self, rows: np.ndarray, offsets: np.ndarray | None, blocks: Any, num_new: np.ndarray,
                   req_ids: np.ndarray, table: Any, want_slots: bool = True) -> np.ndarray | None:
        """``append_blocks`` then ``register``: the batch's new blocks and tokens (request i:
        ``req_ids[i]`` at ``rows[i]``; blocks in CSR form, or with the C++ core, ``offsets`` None,
        one list per request as the host passed them). Returns the new tokens' slots (row by
        row; with the C++ core None unless ``want_slots``: no array made). The C++ core first
        checks them as ``InputChecks.check_new`` does (ValueError in its words, nothing changed;
        ``table``: the step's token table, whose C++ form knows the shared blocks); the Python
        path takes checked input."""
        if self.native is None:
            self.append_blocks(rows, offsets, blocks)
            return self.register(rows, num_new)
        needed, slots = self.native.slots_register(self.native_layout(), req_ids, rows, offsets, blocks, num_new,
                                                   self.num_blocks, table, want_slots)
        if needed:  # the rows' lists outgrow the block table: widen it, then register
            self.fit_columns(needed)
            needed, slots = self.native.slots_register(self.native_layout(), req_ids, rows, offsets, blocks, num_new,
                                                       self.num_blocks, table, want_slots)
        return slots

    def apply_step(self, victim_rows: np.ndarray, victim_slots: np.ndarray, move_src: np.ndarray,
                   move_dst: np.ndarray, rows: np.ndarray, req_ids: np.ndarray, kv_lens: np.ndarray,
                   freed_offsets: np.ndarray, tail_only: bool, table: Any) -> None:
        """``evict``, ``move`` and ``set_rows`` after the table's step; a row that released a block
        in the middle is rebuilt from ``table``'s block list of its request (the specification of
        ``cpp/core/slots.h`` ``apply_step``, which the C++ core's call makes)."""
        self.evict(victim_rows, victim_slots)
        self.move(move_src, move_dst)
        self.set_rows(rows, kv_lens, lambda i: table.block_ids(int(req_ids[i])), np.diff(freed_offsets), tail_only)

    def append_blocks(self, rows: np.ndarray, offsets: np.ndarray, blocks: np.ndarray) -> None:
        """Appends CSR ``blocks`` (request i: blocks[offsets[i]:offsets[i + 1]]) to the rows."""
        counts = np.diff(offsets)
        if not len(blocks):
            return
        self._fit_rows(rows, counts)
        owner = np.repeat(rows, counts)
        columns = self.num_blocks_of[owner] + (np.arange(len(blocks)) - np.repeat(offsets[:-1], counts))
        self.block_table[owner, columns] = blocks
        self.num_blocks_of[rows] += counts

    def register(self, rows: np.ndarray, num_new: np.ndarray) -> np.ndarray:
        """New tokens at positions [kv_len, kv_len + num_new) of each row get the next logical ids;
        their statistics start at 0. Returns their slots (row by row)."""
        total = int(num_new.sum())
        if not total:
            return np.zeros(0, dtype=np.int64)
        tpb = self.tokens_per_block
        if total == len(rows) and int(num_new.max()) == 1:  # a decode step: one token each (0 + 2 also sums to 2)
            positions = self.kv_len[rows]
            slots = self.block_table[rows, positions // tpb].astype(np.int64) * tpb + positions % tpb
            self.tokens[slots] = self.num_tokens[rows]
        else:
            owner = np.repeat(rows, num_new)
            step = np.arange(total) - np.repeat(np.cumsum(num_new) - num_new, num_new)
            positions = self.kv_len[owner] + step
            slots = self.block_table[owner, positions // tpb].astype(np.int64) * tpb + positions % tpb
            self.tokens[slots] = self.num_tokens[owner] + step
        for values in self.stats.values():
            values[slots] = 0
        self.kv_len[rows] += num_new
        self.num_tokens[rows] += num_new
        self.num_live[rows] += num_new
        return slots

    def slots_at(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Flat slots of (row, position) pairs. int64."""
        tpb = self.tokens_per_block
        return self.block_table[rows, positions // tpb].astype(np.int64) * tpb + positions % tpb

    def evict(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """The tokens at ``slots`` (of ``rows``, one entry per victim) died."""
        if not len(slots):
            return
        self.tokens[slots] = NO_TOKEN
        self.num_live -= np.bincount(rows, minlength=len(self.num_live))

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Relocations: ids and statistics go from ``src`` to ``dst`` slots (disjoint sets)."""
        if not len(src):
            return
        self.tokens[dst] = self.tokens[src]
        self.tokens[src] = NO_TOKEN
        for values in self.stats.values():
            values[dst] = values[src]

    def set_rows(self, rows: np.ndarray, kv_lens: np.ndarray, blocks: Callable[[int], list[int]],
                 freed_counts: np.ndarray, tail_only: bool) -> None:
        """After the table step: new physical lengths, and released blocks leave the rows (the tail
        in dense mode; any block otherwise, where ``blocks(row index)`` rebuilds the row)."""
        self.kv_len[rows] = kv_lens
        shrunk = np.flatnonzero(freed_counts)
        if not len(shrunk):
            return
        if tail_only:
            r, k = rows[shrunk], freed_counts[shrunk]
            kept = self.num_blocks_of[r] - k
            owner = np.repeat(r, k)
            self.block_table[owner, np.repeat(kept, k) + (np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k))] = \
                self.scratch
            self.num_blocks_of[r] = kept
            return
        for i in shrunk.tolist():
            row, listed = int(rows[i]), blocks(i)
            self.block_table[row] = self.scratch
            self.block_table[row, : len(listed)] = listed
            self.num_blocks_of[row] = len(listed)

    def native_layout(self) -> Any:
        """The layout's arrays as the C++ core's calls take them (``cpp/core/slot_args.h``
        BoundLayout: tokens, block table, tokens_per_block, the four counters, the statistics),
        bound once and again after a buffer was replaced (``_grow_rows``, ``fit_columns``,
        ``add_stat``)."""
        if self._bound is None:
            self._bound = self.native.BoundLayout(self.tokens, self.block_table, self.tokens_per_block,
                                                  self.num_blocks_of, self.kv_len, self.num_tokens, self.num_live,
                                                  list(self.stats.values()))
        return self._bound

    # ---- batch views ---------------------------------------------------------------------------
    def block_rows(self, rows: np.ndarray) -> np.ndarray:
        """[B, nb] the rows of the block table, nb = the longest list (scratch-padded)."""
        width = int(self.num_blocks_of[rows].max()) if len(rows) else 0
        return self.block_table[rows, : max(width, 1)]

    def gather(self, values: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Per-slot ``values`` in the batch layout [B, nb * tokens_per_block] (a copy)."""
        tpb = self.tokens_per_block
        return values.reshape(-1, tpb)[blocks].reshape(len(blocks), blocks.shape[1] * tpb)

    def scatter(self, values: np.ndarray, blocks: np.ndarray, batch: np.ndarray) -> None:
        """Writes a batch-layout array back to its slots (scratch and shared blocks: any writer)."""
        tpb = self.tokens_per_block
        values.reshape(-1, tpb)[blocks] = batch.reshape(*blocks.shape, tpb)

    # ---- private -------------------------------------------------------------------------------
    def _grow_rows(self, capacity: int) -> None:
        extra = capacity - len(self.kv_len)
        self.block_table = np.vstack([self.block_table,
                                      np.full((extra, self.block_table.shape[1]), self.scratch, dtype=np.int32)])
        for name in ("num_blocks_of", "kv_len", "num_tokens", "num_live"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(extra, dtype=np.int64)]))
        self.policy = np.concatenate([self.policy, np.full(extra, -1, dtype=np.int64)])
        self._bound = None

    def _fit_rows(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Widens the block table if the rows' lists, ``counts`` blocks longer, would not fit."""
        if counts.any():
            self.fit_columns(int((self.num_blocks_of[rows] + counts).max()))

    def fit_columns(self, needed: int) -> None:
        """Widens the block table (doubling) to at least ``needed`` columns."""
        width = self.block_table.shape[1]
        if width >= needed:
            return
        while width < needed:
            width *= 2
        grown = np.full((self.block_table.shape[0], width), self.scratch, dtype=np.int32)
        grown[:, : self.block_table.shape[1]] = self.block_table
        self.block_table = grown
        self._bound = None
