# SPDX-License-Identifier: Apache-2.0
"""Random workloads through every policy and both modes; invariants checked after every step.

Each example drives a small engine model: requests arrive (some sharing a prefix with a running
request, as prefix caching would), decode one token per step into newly allocated blocks when
needed, let the policy evict, reclaim (dense: at once; lazy: submitted, committed a step later),
and finish. After every operation: I2 on the table, the pool's integrity; I1 and I4 run inside
the backend (check_invariants=True) on every relocation; dense mode holds exactly
ceil(live / tokens_per_block) blocks after each reclaim.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import make_backend, make_table
from trtllm_vtoken.policies import POLICIES, make_policy, policy_view

OPS = st.lists(
    st.tuples(st.sampled_from(["arrive", "arrive_shared", "step", "step", "step", "decode", "evict",
                               "reclaim", "finish"]),
              st.integers(0, 1_000_000)),
    min_size=5, max_size=60,
)


class Model:
    def __init__(self, policy_name: str, mode: str, tpb: int, budget: float) -> None:
        self.pool, self.table = make_table(num_blocks=96, tokens_per_block=tpb)
        self.kv = torch.zeros(96, 1, 2, 1, tpb, 2)
        self.backend = make_backend(self.pool, self.table, self.kv, mode=mode)
        self.policy = make_policy(policy_name, budget)
        self.mode, self.tpb, self.next_id = mode, tpb, 0
        self.gen = torch.Generator().manual_seed(0)

    def write(self, req: int, new_ids: range) -> None:
        """Fills the new tokens' KV with random bytes so that I1 compares real data."""
        for token_id in new_ids:
            block, offset = self.table.lookup(req, token_id)
            self.kv[block, :, :, :, offset] = torch.randn(1, 2, 1, 2, generator=self.gen)

    def arrive(self, length: int, prefix: list[int] | None = None) -> None:
        blocks = list(prefix or [])
        need = -(-length // self.tpb) - len(blocks)
        fresh = self.pool.allocate(need)
        if fresh is None:
            return
        if prefix:
            self.pool.share(prefix)
        req, self.next_id = self.next_id, self.next_id + 1
        self.table.add_request(req)
        new_ids = self.table.sync_new_tokens(req, blocks + fresh, length)
        self.write(req, new_ids[len(blocks) * self.tpb :])

    def decode(self, req: int) -> None:
        if self.backend.in_flight(req) and self.mode == "dense":
            return
        blocks, kv_len = self.table.block_ids(req), self.table.kv_len(req)
        if kv_len == len(blocks) * self.tpb:
            fresh = self.pool.allocate(1)
            if fresh is None:
                return
            blocks += fresh
        self.write(req, self.table.sync_new_tokens(req, blocks, kv_len + 1))
        live = self.table.live_ids(req)
        self.policy.observe(req, live, np.linspace(0, 1, len(live)) ** 2)

    def evict(self, req: int) -> None:
        self.table.evict_tokens(req, self.policy.select(policy_view(self.table, req)))

    def reclaim(self, req: int) -> None:
        for other in self.table.request_ids():  # lazy plans left in flight commit now
            if self.backend.in_flight(other):
                self.backend.commit_blocking(other)
        plan = self.backend.plan(req, pressure=True)
        if plan is None:
            return
        self.backend.submit(plan)
        if self.mode == "dense":
            self.backend.commit_blocking(req)
            shared = self.table.protected_ids(req)
            if not len(shared) or self.table.num_live(req) > len(shared):
                assert len(self.table.block_ids(req)) == -(-self.table.num_live(req) // self.tpb)

    def step(self) -> None:
        """One engine step for every running request: write a token, evict, reclaim."""
        for req in self.table.request_ids():
            self.decode(req)
            self.evict(req)
            self.reclaim(req)

    def finish(self, req: int) -> None:
        if self.backend.in_flight(req):
            self.backend.commit_blocking(req)
        self.policy.forget(req)
        self.pool.free(self.table.remove_request(req))

    def shareable_prefix(self, req: int) -> list[int]:
        """Leading blocks of ``req`` whose tokens are all live: what prefix caching could reuse."""
        counts = self.table.live_counts_per_block(req)
        blocks = self.table.block_ids(req)
        full = self.table.kv_len(req) // self.tpb
        prefix = []
        for i in range(full):
            if counts[i] != self.tpb:
                break
            prefix.append(blocks[i])
        return prefix

    def check(self) -> None:
        self.table.check_integrity()
        self.pool.check_integrity()
        held = sum(len(self.table.block_ids(r)) for r in self.table.request_ids())
        assert self.pool.num_used <= held


@settings(max_examples=150, deadline=None)
@given(
    policy=st.sampled_from(POLICIES.names()),
    mode=st.sampled_from(["dense", "lazy"]),
    tpb=st.sampled_from([1, 2, 4, 8]),
    budget=st.sampled_from([0.3, 0.5, 0.7, 6, 12]),
    ops=OPS,
)
def test_random_workloads_keep_invariants(policy, mode, tpb, budget, ops):
    model = Model(policy, mode, tpb, budget)
    for op, arg in ops:
        running = model.table.request_ids()
        req = running[arg % len(running)] if running else None
        if op == "arrive" or req is None:
            model.arrive(1 + arg % 40)
        elif op == "step":
            model.step()
        elif op == "arrive_shared":
            prefix = model.shareable_prefix(req)[: 1 + arg % 3]
            model.arrive(len(prefix) * tpb + 1 + arg % 9, prefix)
        else:
            getattr(model, op)(req)
        model.check()
    stats = model.backend.stats
    assert stats.invariant_checks == stats.plans  # every relocation was checked
    for req in model.table.request_ids():
        model.finish(req)
    model.check()
    assert model.pool.num_free == model.pool.num_blocks
