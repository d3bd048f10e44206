# SPDX-License-Identifier: Apache-2.0
"""Prefix caching meets eviction and relocation: random workloads, checked after every operation.

Requests draw their prompts from a few system prompts plus private suffixes, so they share
cached chains; they decode, evict (the cut first), compact (dense or lazy), and finish. Each
token's KV is a value that names its whole prefix (what a real model's KV depends on), so a
cached block whose bytes changed is caught. Checked throughout:

- no relocation plan reads, writes or frees a block that is shared or holds a key;
- every cached block's KV equals the KV a fresh prefill of its key's tokens would write;
- table, pool and cache agree (I2, reference counts, LRU);
- at the end, with every request gone and the cache cleared, the pool is full again.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import make_backend
from trtllm_vtoken.core import BlockPool, TokenTable
from trtllm_vtoken.core.block_key import ROOT_KEY, block_keys, chain_key
from trtllm_vtoken.core.prefix_cache import PrefixCache
from trtllm_vtoken.policies import make_policy, policy_view

SYSTEM_PROMPTS = [[7, 7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16], [30 + i % 5 for i in range(13)],
                  [50, 51, 52, 53, 54, 55]]

OPS = st.lists(
    st.tuples(st.sampled_from(["arrive", "arrive", "decode", "decode", "evict", "reclaim", "finish"]),
              st.integers(0, 1_000_000)),
    min_size=5, max_size=50,
)


def prefill_kv(tokens: list[int]) -> list[float]:
    """KV value of each position: a 64-bit chain over the tokens up to it, folded to a float32
    that is exact (below 2**24). Two prefixes differing anywhere give different values."""
    values, key = [], ROOT_KEY
    for token in tokens:
        key = chain_key(key, [token])
        values.append(float(key % 16_777_213))
    return values


class Model:
    def __init__(self, mode: str, tpb: int, policy: str, budget: float) -> None:
        self.pool = BlockPool(40, tpb)
        self.cache = PrefixCache(self.pool)
        self.table = TokenTable(tpb, self.cache.is_shared)
        self.kv = torch.zeros(40, 1, 2, 1, tpb, 1)
        self.backend = make_backend(self.pool, self.table, self.kv, mode=mode)
        self.policy = make_policy(policy, budget)
        self.mode, self.tpb, self.next_id = mode, tpb, 0
        self.tokens: dict[int, list[int]] = {}
        self.prefix_of_key: dict[int, list[int]] = {}
        self.plans_checked = 0

    def write(self, req: int, first: int) -> None:
        """The forward writes KV for the request's tokens from logical id ``first`` on."""
        tokens = self.tokens[req]
        values = prefill_kv(tokens)
        for token_id in range(first, len(tokens)):
            block, offset = self.table.lookup(req, token_id)
            self.kv[block, :, :, :, offset] = values[token_id]
        keys = block_keys(tokens, self.tpb)
        for i, key in enumerate(keys):
            self.prefix_of_key.setdefault(key, tokens[: (i + 1) * self.tpb])

    def arrive(self, arg: int) -> None:
        system = SYSTEM_PROMPTS[arg % len(SYSTEM_PROMPTS)]
        prompt = system[: len(system) - arg % 4] + [100 + (arg // 7 + i) % 40 for i in range(arg % 6)]
        req, self.next_id = self.next_id, self.next_id + 1
        blocks = self.cache.begin(req, prompt)
        fresh = self.cache.allocate(-(-len(prompt) // self.tpb) - len(blocks))
        if fresh is None:
            self.cache.end(req, blocks)
            return
        self.table.add_request(req)
        self.tokens[req] = prompt
        self.table.sync_new_tokens(req, blocks + fresh, len(prompt))
        self.write(req, len(blocks) * self.tpb)  # the cached part is not prefilled
        self.cache.extend(req, self.table.block_ids(req), prompt)

    def decode(self, req: int) -> None:
        blocks, kv_len = self.table.block_ids(req), self.table.kv_len(req)
        if kv_len == len(blocks) * self.tpb:
            fresh = self.cache.allocate(1)
            if fresh is None:
                return
            blocks += fresh
        self.tokens[req].append(200 + len(self.tokens[req]) % 17)
        self.table.sync_new_tokens(req, blocks, kv_len + 1)
        self.write(req, len(self.tokens[req]) - 1)
        self.cache.extend(req, self.table.block_ids(req), self.tokens[req])

    def evict(self, req: int) -> None:
        victims = self.policy.select(policy_view(self.table, req))
        if len(victims):
            self.cache.cut(req, self.table.block_ids(req), int(victims.min()))
            self.table.evict_tokens(req, victims)

    def reclaim(self, req: int) -> None:
        plan = self.backend.plan(req, pressure=True)
        if plan is None:
            return
        touched = plan.touched_blocks(self.tpb)
        assert not [b for b in touched if self.cache.is_shared(b) or self.cache.is_cached(b)], plan
        self.plans_checked += 1
        self.backend.submit(plan)
        self.backend.commit_blocking(req)

    def finish(self, req: int) -> None:
        self.policy.forget(req)
        self.cache.end(req, self.table.remove_request(req))
        del self.tokens[req]

    def check(self) -> None:
        self.table.check_integrity()
        self.pool.check_integrity()
        self.cache.check_integrity()
        tpb = self.tpb
        for block, key in self.cache.key_of.items():
            prefix = self.prefix_of_key[key]
            expected = torch.tensor(prefill_kv(prefix)[-tpb:])
            assert torch.equal(self.kv[block, 0, 0, 0, :, 0], expected), f"cached block {block} changed"
        held = {b for r in self.table.request_ids() for b in self.table.block_ids(r)}
        assert held | set(self.cache.key_of) | set(self.pool.free_ids) == set(range(self.pool.num_blocks))


@settings(max_examples=120, deadline=None)
@given(
    mode=st.sampled_from(["dense", "lazy"]),
    tpb=st.sampled_from([1, 2, 4]),
    policy=st.sampled_from(["random", "streaming_llm", "sliding_window"]),
    budget=st.sampled_from([0.4, 0.7, 5]),
    ops=OPS,
)
def test_cached_blocks_are_never_moved_and_keep_their_kv(mode, tpb, policy, budget, ops):
    model = Model(mode, tpb, policy, budget)
    for op, arg in ops:
        running = model.table.request_ids()
        if op == "arrive" or not running:
            model.arrive(arg)
        else:
            getattr(model, op)(running[arg % len(running)])
        model.check()
    for req in model.table.request_ids():
        model.finish(req)
    model.check()
    model.cache.clear()
    assert model.pool.num_free == model.pool.num_blocks


def test_the_workload_reuses_evicts_and_relocates():
    """The property above is not vacuous: a fixed run hits the cache, cuts chains and moves KV."""
    model = Model("dense", 2, "sliding_window", 0.8)
    for arg in (0, 3, 0):
        model.arrive(arg)
    for _ in range(4):
        for req in model.table.request_ids():
            model.decode(req)
            model.evict(req)
            model.reclaim(req)
            model.check()
    assert model.cache.stats.hit_tokens > 0 and model.cache.stats.dropped_keys > 0
    assert model.plans_checked > 0 and model.backend.stats.moves > 0
    assert any(model.cache.is_shared(b) for r in model.table.request_ids() for b in model.table.block_ids(r))
