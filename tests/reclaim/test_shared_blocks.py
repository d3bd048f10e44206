# SPDX-License-Identifier: Apache-2.0
"""A request never writes into a shared block: its length never ends inside one, and a request
whose tail block is shared continues in a fresh block. Python and C++ cores, one KV memory."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import make_kv, result_lists, table_fingerprint
from trtllm_vtoken.core import BlockPool, TokenTable
from trtllm_vtoken.core.native import load, native_table
from trtllm_vtoken.reclaim import ReclaimBackend, ReclaimConfig
from trtllm_vtoken.reclaim.copy import TorchCopyExecutor
from trtllm_vtoken.reclaim.planner import plan_dense
from trtllm_vtoken.reclaim.step_batch import step_batch

needs_cpp = pytest.mark.skipif(load() is None, reason="the C++ token table is not built")


def parent_and_child(table, pool: BlockPool, share) -> tuple[int, int]:
    """tokens_per_block 2. The parent writes tokens 0, 1 into block b and evicts token 1; b then
    becomes the prefix of a child, which reads both tokens. Returns (b, the child's own block)."""
    block = pool.allocate(1)[0]
    table.add_request(0)
    table.append_tokens(0, [block], 2)
    table.evict_tokens(0, [1])
    pool.share([block])
    share(block)
    child_block = pool.allocate(1)[0]
    table.add_request(1)
    table.sync_new_tokens(1, [block, child_block], 3)
    return block, child_block


def test_parent_whose_tail_block_became_shared_continues_in_a_fresh_block():
    pool = BlockPool(8, 2)
    table = TokenTable(2, pool.is_shared)
    kv = make_kv(pool)
    backend = ReclaimBackend(table, pool, TorchCopyExecutor([kv]), ReclaimConfig(mode="dense"))
    block, _ = parent_and_child(table, pool, lambda b: None)
    child_token_1 = kv[block, :, :, :, 1].clone()
    assert backend.reclaim([0]) == 0
    assert table.kv_len(0) == 2  # stays at the shared block's end, above its dead token
    with pytest.raises(ValueError, match=r"total_len 3 must lie in \[2, 2\]"):
        table.append_tokens(0, [], 1)  # the next token needs a fresh block
    [fresh] = pool.allocate(1)
    table.append_tokens(0, [fresh], 1)
    assert table.lookup(0, 2) == (fresh, 0) and table.lookup(1, 1) == (block, 1)
    assert torch_equal(kv[block, :, :, :, 1], child_token_1)
    table.check_integrity()


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


def test_truncate_and_append_refuse_to_end_inside_a_shared_block():
    pool = BlockPool(8, 2)
    table = TokenTable(2, pool.is_shared)
    block, _ = parent_and_child(table, pool, lambda b: None)
    before = table_fingerprint(table)
    with pytest.raises(ValueError, match=f"new length 1 would end inside shared block {block}"):
        table.truncate(0, 1)
    assert plan_dense(table, 0) is None
    [fresh] = pool.allocate(1)
    table.add_request(2)
    with pytest.raises(ValueError, match=f"length 1 would end inside shared block {block}"):
        table.append_tokens(2, [block], 1)  # a shared block is registered whole, never half
    table.remove_request(2)
    assert table_fingerprint(table) == before


def test_python_step_batch_keeps_the_parent_out_of_the_shared_block():
    pool = BlockPool(8, 2)
    table = TokenTable(2, pool.is_shared)
    block, _ = parent_and_child(table, pool, lambda b: None)
    result = step_batch(table, [0], [0], [0, 0], [], [0, 0], [], "dense")
    assert result_lists(result) == ([[]], [[]]) and result.kv_lens.tolist() == [2]
    [fresh] = pool.allocate(1)
    step_batch(table, [0], [1], [0, 1], [fresh], [0, 0], [], "dense")
    assert table.lookup(0, 2) == (fresh, 0) and table.kv_len(0) == 3


@needs_cpp
def test_cpp_core_keeps_the_parent_out_of_the_shared_block():
    pool = BlockPool(8, 2)
    table = native_table(2)
    block, _ = parent_and_child(table, pool, lambda b: table.set_shared(b, True))
    assert table.plan_dense(0) is None
    with pytest.raises(ValueError, match=f"new length 1 would end inside shared block {block}"):
        table.truncate(0, 1)
    empty = np.zeros(0, dtype=np.int64)
    one = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    result = table.step_batch(one(0), one(0), one(0, 0), empty, one(0, 0), empty, 0)  # dense
    assert [r.tolist() for r in result] == [[0, 0], [], [], [], [0, 0], [], [2]]
    [fresh] = pool.allocate(1)
    table.step_batch(one(0), one(1), one(0, 1), one(fresh), one(0, 0), empty, 0)
    assert table.kv_len(0) == 3 and table.state(0)[5][2] == fresh * 2  # token 2's slot


class SharedPrefixes:
    """Requests over one pool, some reading others' leading blocks, in the Python and (if built)
    C++ cores in lockstep. ``memory`` is the KV: slot -> what was last written there; every live
    token must keep reading what it read when it was registered."""

    def __init__(self, tpb: int, dense: bool) -> None:
        self.tpb, self.dense = tpb, dense
        self.pool = BlockPool(128, tpb)
        self.tables = [TokenTable(tpb, self.pool.is_shared)]
        if load() is not None:
            self.tables.append(native_table(tpb))
        self.memory: dict[int, tuple[int, int]] = {}
        self.expected: dict[tuple[int, int], tuple[int, int]] = {}
        self.next_req = 0

    @property
    def py(self) -> TokenTable:
        return self.tables[0]

    def slot(self, req: int, token: int) -> int:
        block, offset = self.py.lookup(req, token)
        return block * self.tpb + offset

    def sync_shared(self) -> None:
        for table in self.tables[1:]:
            for block in range(self.pool.num_blocks):
                table.set_shared(block, self.pool.is_shared(block))

    def register(self, req: int, added: list[int], num_new: int, written_from: int) -> None:
        """Appends in every table; tokens from logical position ``written_from`` on are written
        by the engine (earlier ones are a shared prefix, read as they are)."""
        first = [table.append_tokens(req, added, num_new) for table in self.tables][0]
        first = first.start if isinstance(first, range) else first
        for token in range(first, first + num_new):
            slot = self.slot(req, token)
            if token >= written_from:
                assert not self.pool.is_shared(slot // self.tpb), f"request {req} writes into a shared block"
                self.memory[slot] = (req, token)
            self.expected[(req, token)] = self.memory[slot]

    def arrive(self, length: int, parent: int | None, prefix_blocks: int) -> None:
        prefix: list[int] = []
        if parent is not None:
            full = self.py.kv_len(parent) // self.tpb
            prefix = self.py.block_ids(parent)[: min(prefix_blocks, full)]
        fresh = self.pool.allocate(-(-length // self.tpb))
        if fresh is None:
            return
        self.pool.share(prefix)
        self.sync_shared()
        req, self.next_req = self.next_req, self.next_req + 1
        for table in self.tables:
            table.add_request(req)
        self.register(req, prefix + fresh, len(prefix) * self.tpb + length, len(prefix) * self.tpb)

    def decode(self, req: int) -> None:
        added = []
        if self.py.kv_len(req) == self.py.num_blocks(req) * self.tpb:
            added = self.pool.allocate(1)
            if added is None:
                return
        self.register(req, added, 1, 0)

    def evict(self, req: int, rng: np.random.Generator) -> None:
        """1-2 unprotected live tokens: random ones, or those at the highest positions (which
        leaves the request's new length inside its last blocks, where prefixes get shared)."""
        protected = set(self.py.protected_ids(req).tolist())
        live = self.py.position_live_mask(req)
        by_position = [self.py.token_at_slot(req, self.slot_of_position(req, p))
                       for p in np.flatnonzero(live)[::-1].tolist()]
        candidates = [t for t in by_position if t not in protected]
        k = min(len(candidates), int(rng.integers(1, 3)))
        if not k:
            return
        victims = candidates[:k] if rng.random() < 0.7 else rng.choice(candidates, size=k, replace=False).tolist()
        for table in self.tables:
            table.evict_tokens(req, victims)

    def slot_of_position(self, req: int, position: int) -> int:
        return self.py.block_ids(req)[position // self.tpb] * self.tpb + position % self.tpb

    def step(self, req: int) -> None:
        """Plan and commit through ``step_batch`` (no new token, no eviction). The KV moves as
        every live token's slot changed, which must be the moves the step returned (dead tokens
        may move too: their KV is no longer read)."""
        live = self.py.live_ids(req).tolist()
        before = {t: self.slot(req, t) for t in live}
        args = [np.array(v, dtype=np.int64) for v in ([req], [0], [0, 0], [], [0, 0], [])]
        results = [step_batch(table, *args, "dense" if self.dense else "lazy") if table is self.py
                   else table.step_batch(*args, 0 if self.dense else 1) for table in self.tables]
        results = [[array.tolist() for array in result] for result in results]
        assert all(r == results[0] for r in results)
        moved = {before[t]: self.slot(req, t) for t in live if self.slot(req, t) != before[t]}
        _, tokens, sources, destinations, *_ = results[0]
        returned = {src: dst for token, src, dst in zip(tokens, sources, destinations) if token in before}
        assert returned == moved
        values = {src: self.memory[src] for src in moved}
        for src, dst in moved.items():
            self.memory[dst] = values[src]
        self.pool.free(results[0][5])  # the freed blocks
        self.sync_shared()

    def finish(self, req: int) -> None:
        blocks = [table.remove_request(req) for table in self.tables][0]
        self.pool.free(blocks)
        self.sync_shared()

    def check(self) -> None:
        py, tpb = self.py, self.tpb
        py.check_integrity()
        self.pool.check_integrity()
        for req in py.request_ids():
            kv_len = py.kv_len(req)
            assert kv_len % tpb == 0 or not self.pool.is_shared(py.block_ids(req)[kv_len // tpb]), (
                f"request {req}'s length {kv_len} ends inside a shared block")
            for token in py.live_ids(req).tolist():
                assert self.memory[self.slot(req, token)] == self.expected[(req, token)], (
                    f"request {req}, token {token}: its KV was overwritten")
            for table in self.tables[1:]:
                assert table.kv_len(req) == kv_len and table.block_ids(req) == py.block_ids(req)
                assert table.state(req)[5] == py.seq(req).slot_of[: py.num_tokens(req)].tolist()


@settings(max_examples=150, deadline=None)
@given(tpb=st.sampled_from([1, 2, 4]), dense=st.booleans(),
       ops=st.lists(st.tuples(st.sampled_from(["arrive", "child", "child", "decode", "evict", "evict", "step",
                                               "step", "finish"]), st.integers(0, 2**16)), min_size=4, max_size=40))
def test_no_request_writes_into_a_block_another_reads(tpb, dense, ops):
    model = SharedPrefixes(tpb, dense)
    rng = np.random.default_rng(len(ops))
    for op, arg in ops:
        running = model.py.request_ids()
        req = running[arg % len(running)] if running else None
        if op == "arrive" or req is None:  # half of them fill whole blocks, whose tail may be shared
            model.arrive(1 + arg % 9 if arg % 2 else tpb * (1 + arg % 3), None, 0)
        elif op == "child":
            model.arrive(1 + arg % 5, req, 1 + arg % 3)
        elif op == "evict":
            model.evict(req, rng)
        else:
            getattr(model, op)(req)
        model.check()


@settings(max_examples=100, deadline=None)
@given(tpb=st.sampled_from([2, 4]), shared=st.integers(1, 3), extra=st.integers(0, 3), dense=st.booleans(),
       cut=st.integers(0, 15), dead=st.lists(st.booleans(), min_size=16, max_size=16))
def test_a_request_never_writes_into_the_prefix_it_shares(tpb, shared, extra, dense, cut, dead):
    """A request's tokens die (from position ``cut`` on, and some below); then its leading
    ``shared`` full blocks become another request's prefix. Its steps and next tokens leave the
    other request's KV intact."""
    model = SharedPrefixes(tpb, dense)
    length = shared * tpb + extra % tpb
    model.arrive(length, None, 0)
    victims = [t for t in range(length) if t >= cut or dead[t]]
    for table in model.tables:
        table.evict_tokens(0, victims)
    model.arrive(1, 0, shared)
    model.check()
    for _ in range(tpb + 1):
        model.step(0)
        model.check()
        model.decode(0)
        model.check()
