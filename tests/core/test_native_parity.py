# SPDX-License-Identifier: Apache-2.0
"""The C++ token table against the Python specification: the same random operation sequences
(valid and invalid) give identical state, identical plans and identical errors, step by step."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import as_csr, py_commit, random_step, result_lists, step_loop
from trtllm_vtoken.core import TokenTable
from trtllm_vtoken.core.native import load, native_table
from trtllm_vtoken.reclaim.planner import fragmentation, plan_dense, plan_lazy
from trtllm_vtoken.reclaim.plan import RelocationPlan
from trtllm_vtoken.reclaim.step_batch import COMPACTIONS, StepBatchResult, step_batch

pytestmark = pytest.mark.skipif(load() is None, reason="the C++ token table is not built")

OPS = ["add", "sync", "sync", "append", "evict", "evict", "dense", "lazy", "step", "moves", "truncate",
       "release", "holes", "share", "remove", "odd"]
# Values the cores must take or refuse alike: not integers, outside int64, the C++ request index's
# empty-entry marker (-2**63), integer-likes, a block id past the int32 slot encoding (set per table).
ODD_VALUES = [1.5, "3", None, np.float64(2.0), 2**63, -(2**63) - 1, -(2**63), True, np.int64(1), "max_block"]


class Pair:
    """A Python and a C++ table driven together; every call must agree."""

    def __init__(self, tpb: int) -> None:
        self.tpb = tpb
        self.shared: set[int] = set()
        self.py = TokenTable(tpb, lambda b: b in self.shared)
        self.cpp = native_table(tpb)
        self.next_block = 0
        self.next_req = 0

    def both(self, py_call, cpp_call):
        """Runs both; returns the common result, or the common exception (type and message)."""
        outcomes = []
        for call in (py_call, cpp_call):
            try:
                outcomes.append(("ok", call()))
            except (ValueError, KeyError, TypeError) as exc:
                outcomes.append((type(exc).__name__, str(exc)))
        assert outcomes[0] == outcomes[1], f"python {outcomes[0]} != cpp {outcomes[1]}"
        return outcomes[0]

    def state(self, req: int) -> tuple:
        s, tpb = self.py.seq(req), self.tpb
        nb = len(s.block_ids)
        return (list(s.block_ids), s.kv_len, s.num_tokens, s.num_live, s.version,
                s.slot_of[: s.num_tokens].tolist(), s.live[: s.num_tokens].tolist(),
                s.token_at[: nb * tpb].tolist(), s.live_per_block[:nb].tolist(), list(s.pending_dead))

    def check(self) -> None:
        assert self.py.request_ids() == self.cpp.request_ids()
        for req in self.py.request_ids():
            assert self.state(req) == tuple(self.cpp.state(req)), f"request {req} differs"
        assert self.py.metadata_bytes_per_token() == pytest.approx(self.cpp.metadata_bytes_per_token())
        blocks = range(-1, self.next_block + 1)
        assert [self.py.holders_of(b) for b in blocks] == [self.cpp.holders_of(b) for b in blocks]
        self.py.check_integrity()


def plan_and_commit(pair: Pair, req: int, mode: str) -> None:
    planner = plan_dense if mode == "dense" else plan_lazy
    try:
        py_plan = planner(pair.py, req)
    except KeyError:
        with pytest.raises(KeyError):
            getattr(pair.cpp, f"plan_{mode}")(req)
        return
    cpp_plan = getattr(pair.cpp, f"plan_{mode}")(req)
    assert (py_plan is None) == (cpp_plan is None)
    if py_plan is None:
        return
    assert RelocationPlan.from_native(cpp_plan) == py_plan
    pair.both(lambda: py_commit(pair.py, py_plan), lambda: pair.cpp.commit(cpp_plan))
    # A plan commits once: the second commit is refused by both, changing nothing.
    pair.both(lambda: py_commit(pair.py, py_plan), lambda: pair.cpp.commit(cpp_plan))


def step_both(pair: Pair, r: np.random.Generator) -> None:
    """Python and C++ ``step_batch`` on 1-3 requests, sometimes unknown or with bad victims:
    same results, or the same error after the same partial progress."""
    reqs = pair.py.request_ids()
    batch = [int(r.choice(reqs)) if reqs and r.random() < 0.9 else int(r.integers(0, 50))
             for _ in range(int(r.integers(1, 4)))]
    batch = list(dict.fromkeys(batch))
    num_new = [int(r.integers(0, 3)) for _ in batch]
    new_blocks, victims = [], []
    for req, n in zip(batch, num_new):
        known = req in pair.py
        need = max(-(-(pair.py.kv_len(req) + n) // pair.tpb) - pair.py.num_blocks(req), 0) if known else 1
        new_blocks.append(list(range(pair.next_block, pair.next_block + need)))
        pair.next_block += need
        live = pair.py.live_ids(req).tolist() if known else []
        pick = r.choice(live, size=min(len(live), int(r.integers(0, 3))), replace=False).tolist() if live else []
        victims.append(pick if r.random() < 0.9 else pick + [int(r.integers(-1, 70))])
    args = (np.array(batch, dtype=np.int64), np.array(num_new, dtype=np.int64), *as_csr(new_blocks),
            *as_csr(victims))
    compaction, rest = str(r.choice(COMPACTIONS)), (int(r.integers(1, 3)), r.random() < 0.2)
    pair.both(lambda: [a.tolist() for a in step_batch(pair.py, *args, compaction, *rest)],
              lambda: [a.tolist() for a in pair.cpp.step_batch(*args, COMPACTIONS.index(compaction), *rest)])


def apply(pair: Pair, op: str, r: np.random.Generator) -> None:
    reqs = pair.py.request_ids()
    req = int(r.choice(reqs)) if reqs and r.random() < 0.95 else int(r.integers(0, 50))
    tpb = pair.tpb
    if op == "add" or not reqs:
        target = req if r.random() < 0.1 else pair.next_req  # sometimes a duplicate id
        pair.next_req += 1
        pair.both(lambda: pair.py.add_request(target), lambda: pair.cpp.add_request(target))
    elif op == "sync":
        current = pair.py.block_ids(req) if req in pair.py else []
        fresh = list(range(pair.next_block, pair.next_block + int(r.integers(0, 3))))
        pair.next_block += len(fresh)
        blocks = current + fresh
        if r.random() < 0.1 and blocks:  # invalid: a repeated block, or a rewritten prefix
            blocks = blocks + [blocks[0]] if r.random() < 0.5 else [blocks[-1]] + blocks[1:]
        kv = pair.py.kv_len(req) if req in pair.py else 0
        total = kv + int(r.integers(0, 2 * tpb)) if r.random() < 0.9 else len(blocks) * tpb + 1
        total = min(total, len(blocks) * tpb) if r.random() < 0.9 else total
        pair.both(lambda: pair.py.sync_new_tokens(req, blocks, total).start,
                  lambda: pair.cpp.sync_new_tokens(req, blocks, total))
    elif op == "append":
        fresh = list(range(pair.next_block, pair.next_block + int(r.integers(0, 3))))
        pair.next_block += len(fresh)
        if r.random() < 0.1:  # invalid: a block the request holds, or a negative one
            fresh.append(pair.py.block_ids(req)[0] if req in pair.py and pair.py.num_blocks(req) else -1)
        elif r.random() < 0.15:  # another request's block: taken only where it is shared
            others = [q for q in reqs if q != req and pair.py.num_blocks(q)]
            fresh += [pair.py.block_ids(int(r.choice(others)))[-1]] if others else []
        num_new = int(r.integers(-1, 2 * tpb))
        pair.both(lambda: pair.py.append_tokens(req, fresh, num_new).start,
                  lambda: pair.cpp.append_tokens(req, fresh, num_new))
    elif op == "step":
        step_both(pair, r)
    elif op == "evict":
        n = pair.py.num_tokens(req) if req in pair.py else 3
        ids = r.integers(-1, n + 1, size=int(r.integers(0, 4))).tolist()
        if r.random() < 0.7 and req in pair.py:  # mostly valid: live ids
            live = pair.py.live_ids(req).tolist()
            ids = r.choice(live, size=min(len(live), int(r.integers(1, 4))), replace=False).tolist() if live else ids
        pair.both(lambda: pair.py.evict_tokens(req, ids), lambda: pair.cpp.evict_tokens(req, ids))
    elif op in ("dense", "lazy"):
        plan_and_commit(pair, req, op)
    elif op == "moves":
        n = pair.py.num_tokens(req) if req in pair.py else 3
        k = int(r.integers(0, 3))
        ids = r.integers(0, max(n, 1), size=k).tolist()
        dsts = r.integers(-1, pair.next_block * tpb + 1, size=k if r.random() < 0.9 else k + 1).tolist()
        pair.both(lambda: pair.py.apply_moves(req, ids, dsts), lambda: pair.cpp.apply_moves(req, ids, dsts))
    elif op == "truncate":
        kv = pair.py.kv_len(req) if req in pair.py else 0
        new = int(r.integers(-1, kv + 2))
        if r.random() < 0.5 and req in pair.py:  # the longest valid truncation: after the last live
            live = pair.py.position_live_mask(req)
            new = int(np.flatnonzero(live)[-1] + 1) if live.any() else 0
        pair.both(lambda: pair.py.truncate(req, new), lambda: pair.cpp.truncate(req, new))
    elif op == "release":
        blocks = pair.py.block_ids(req) if req in pair.py else [0]
        counts = pair.py.live_counts_per_block(req).tolist() if req in pair.py else [1]
        empty = [b for b, c in zip(blocks, counts) if c == 0]
        pick = empty[: int(r.integers(0, 3))] if empty and r.random() < 0.7 else \
            r.integers(0, pair.next_block + 1, size=int(r.integers(0, 3))).tolist()
        pair.both(lambda: pair.py.release_blocks(req, pick), lambda: pair.cpp.release_blocks(req, pick))
    elif op == "holes":
        pair.both(lambda: pair.py.hole_positions(req), lambda: pair.cpp.hole_positions(req))
        token = int(r.integers(-1, 70))
        pair.both(lambda: pair.py.is_live(req, token), lambda: pair.cpp.is_live(req, token))
    elif op == "share":
        block = int(r.integers(0, pair.next_block + 1))
        flag = block not in pair.shared
        pair.shared.add(block) if flag else pair.shared.discard(block)
        pair.cpp.set_shared(block, flag)
    elif op == "remove":
        pair.both(lambda: pair.py.remove_request(req), lambda: pair.cpp.remove_request(req))
    elif op == "odd":
        value = ODD_VALUES[int(r.integers(len(ODD_VALUES)))]
        value = 2**31 // tpb if isinstance(value, str) and value == "max_block" else value
        calls = [
            lambda t: t.evict_tokens(req, [value]), lambda t: t.append_tokens(req, [value], 1),
            lambda t: t.append_tokens(req, [], value), lambda t: t.sync_new_tokens(req, [value], 1),
            lambda t: t.truncate(req, value), lambda t: t.release_blocks(req, [value]),
            lambda t: t.apply_moves(req, [value], [0]), lambda t: t.add_request(value),
            lambda t: t.kv_len(value), lambda t: value in t, lambda t: t.is_live(req, value),
            lambda t: t.evict_tokens(value, [0]),
        ]
        call = calls[int(r.integers(len(calls)))]
        first_id = lambda result: result.start if isinstance(result, range) else result  # noqa: E731
        pair.both(lambda: first_id(call(pair.py)), lambda: call(pair.cpp))
        pair.next_req = max(pair.next_req, *pair.py.request_ids(), 0) + 1  # an id may have been added
    if op in ("dense", "lazy") and req in pair.py:
        assert fragmentation(pair.py, req) == pair.cpp.fragmentation(req)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=80), tpb=st.sampled_from([1, 2, 4, 5]),
       seed=st.integers(0, 2**31))
def test_random_operation_sequences_agree(ops, tpb, seed):
    pair, rng = Pair(tpb), np.random.default_rng(seed)
    for op in ops:
        apply(pair, op, rng)
        pair.check()


@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(COMPACTIONS), tpb=st.sampled_from([2, 4, 8]), batch=st.integers(1, 6),
       steps=st.integers(1, 25), threshold=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_step_batch_equals_the_python_loop(mode, tpb, batch, steps, threshold, seed):
    rng = np.random.default_rng(seed)
    pair = Pair(tpb)
    next_block = 0
    for req in range(batch):
        n = int(rng.integers(1, 5 * tpb))
        blocks = list(range(next_block, next_block + -(-n // tpb)))
        next_block += len(blocks)
        pair.py.add_request(req), pair.cpp.add_request(req)
        pair.py.sync_new_tokens(req, blocks, n), pair.cpp.sync_new_tokens(req, blocks, n)
    for _ in range(steps):
        step, next_block = random_step(rng, pair.py, next_block)
        pressure = bool(rng.random() < 0.2)
        want = step_loop(pair.py, step, mode, threshold, pressure)
        result = StepBatchResult(*pair.cpp.step_batch(*step["csr"], COMPACTIONS.index(mode), threshold, pressure))
        assert result_lists(result) == want
        assert result.kv_lens.tolist() == [pair.py.kv_len(r) for r in step["req_ids"]]
        pair.check()


def test_step_batch_rejects_inconsistent_arrays():
    table = native_table(4)
    table.add_request(0)
    one = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="one more"):
        table.step_batch(one, one, one, one, one, one, 0)
    with pytest.raises(ValueError, match="new_block_offsets must start at 0"):
        table.step_batch(one, one, np.array([0, 5], dtype=np.int64), one, np.zeros(2, dtype=np.int64), one, 0)
    with pytest.raises(ValueError, match="compaction must be 0"):
        table.step_batch(one, one, np.zeros(2, dtype=np.int64), one, np.zeros(2, dtype=np.int64), one, 4)
    with pytest.raises(KeyError, match="unknown request 3"):
        table.step_batch(np.array([3]), one, np.zeros(2, dtype=np.int64), one, np.zeros(2, dtype=np.int64), one, 0)



def test_a_lazy_plan_commits_after_changes_while_its_sources_hold():
    """Background compaction: a lazy plan commits after evictions and appends made while its copy
    ran, in both cores alike, and is refused by both, whole, once a token left its source."""
    pair = Pair(4)
    for table in (pair.py, pair.cpp):
        table.add_request(0)
        table.sync_new_tokens(0, [0, 1, 2, 3], 14)
        table.evict_tokens(0, [1, 2, 3, 6, 8, 10])
    py_plan, cpp_plan = plan_lazy(pair.py, 0), pair.cpp.plan_lazy(0)
    assert RelocationPlan.from_native(cpp_plan) == py_plan and py_plan.num_moves
    pair.both(lambda: pair.py.evict_tokens(0, [py_plan.token_ids[0]]), lambda: pair.cpp.evict_tokens(0, [cpp_plan.token_ids[0]]))
    pair.both(lambda: pair.py.append_tokens(0, [], 1).start, lambda: pair.cpp.append_tokens(0, [], 1))
    pair.both(lambda: py_commit(pair.py, py_plan), lambda: pair.cpp.commit(cpp_plan))
    pair.check()
    for table in (pair.py, pair.cpp):  # a second plan, whose first token then moves elsewhere
        table.evict_tokens(0, [t for t in (4, 5, 9) if table.is_live(0, t)])
    py_plan, cpp_plan = plan_lazy(pair.py, 0), pair.cpp.plan_lazy(0)
    assert py_plan is not None and RelocationPlan.from_native(cpp_plan) == py_plan
    hole = next(p for p in pair.py.hole_positions(0) if p // 4 not in {s // 4 for s in py_plan.src_slots})
    dst = pair.py.block_ids(0)[hole // 4] * 4 + hole % 4
    token = py_plan.token_ids[0]
    pair.both(lambda: pair.py.apply_moves(0, [token], [dst]), lambda: pair.cpp.apply_moves(0, [token], [dst]))
    outcome = pair.both(lambda: py_commit(pair.py, py_plan), lambda: pair.cpp.commit(cpp_plan))
    assert outcome[0] == "ValueError" and "no longer at its planned source" in outcome[1]
    pair.check()


def test_a_lazy_plan_without_moves_is_refused_alike_the_second_time():
    """A block whose tokens all died is released by a lazy plan that moves nothing; committing it
    again reaches the release check itself, which both cores word as release_blocks does (the
    random sequences above found the C++ core's words differing here)."""
    pair = Pair(2)
    pair.both(lambda: pair.py.add_request(0), lambda: pair.cpp.add_request(0))
    pair.both(lambda: pair.py.sync_new_tokens(0, [0], 2).start, lambda: pair.cpp.sync_new_tokens(0, [0], 2))
    pair.both(lambda: pair.py.evict_tokens(0, [0, 1]), lambda: pair.cpp.evict_tokens(0, [0, 1]))
    plan = plan_lazy(pair.py, 0)
    assert plan is not None and plan.token_ids == () and plan.blocks_to_free == (0,)
    plan_and_commit(pair, 0, "lazy")  # commits, then both refuse the same plan again alike
    pair.check()
    cpp_plan = pair.cpp.plan_lazy(0)
    assert cpp_plan is None and plan_lazy(pair.py, 0) is None


@pytest.mark.parametrize("impl", ["python", "cpp"])
def test_a_block_another_request_holds_joins_it_only_when_shared(impl):
    """Two requests writing one unshared block would read each other's KV: the table refuses the
    second, changing nothing; a shared block (a cached prefix) joins both; a block its holders
    gave back joins anyone."""
    shared: set[int] = set()
    table = TokenTable(4, shared.__contains__) if impl == "python" else load().TokenTable(4)
    share = shared.add if impl == "python" else (lambda b: table.set_shared(b, True))
    for req in (0, 1, 2):
        table.add_request(req)
    table.sync_new_tokens(0, [5, 6], 5)
    with pytest.raises(ValueError, match=r"^request 1: new blocks \[6\] are held by another request"):
        table.append_tokens(1, [3, 6], 8)
    with pytest.raises(ValueError, match="held by another request"):
        table.sync_new_tokens(1, [6], 1)
    assert (table.block_ids(1), table.kv_len(1), table.holders_of(3), table.holders_of(6)) == ([], 0, 0, 1)
    share(5)
    table.append_tokens(1, [5], 4)  # block 5 whole: a shared prefix
    assert [table.holders_of(b) for b in (5, 6)] == [2, 1]
    table.evict_tokens(0, [4])
    assert table.truncate(0, 4) == [6]  # request 0 gives block 6 back: anyone may take it
    table.append_tokens(2, [6], 1)
    assert [table.holders_of(b) for b in (5, 6)] == [2, 1]
    assert table.remove_request(0) == [5]
    assert [table.holders_of(b) for b in (5, 6)] == [1, 1]
    if impl == "python":
        table.check_integrity()  # the count agrees with the block lists
