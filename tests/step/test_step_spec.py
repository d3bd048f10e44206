# SPDX-License-Identifier: Apache-2.0
"""The step against its specification, the per-request loop every host used to run:

    per request: sync_new_tokens; policy.observe(live ids in position order, their mass);
                 policy.select(policy_view) -> evict_tokens; plan (dense / lazy) -> copy -> commit,
                 or release the fully dead blocks

with its own policy objects fed through ``observe``/``select`` (statistics by logical id). The step
decides with ``observe_batch``/``select_batch`` over per-slot statistics that move with the KV:
the same victims, tables, freed blocks and KV prove both the vectorised selection and the slot
bookkeeping, for every policy, mixed in one batch."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.step.drive import Host, make_step, random_batch, random_policies
from trtllm_vtoken.core import TokenTable
from trtllm_vtoken.policies import policy_view
from trtllm_vtoken.reclaim.copy import relocate_slots
from trtllm_vtoken.reclaim.dead_blocks import fully_dead_blocks
from trtllm_vtoken.reclaim.planner import commit_plan, plan_for_mode


class Spec:
    """The per-request loop over a Python table, its own KV and its own policy objects."""

    def __init__(self, host: Host, compaction: str, threshold: int) -> None:
        self.host, self.compaction, self.threshold = host, compaction, threshold
        self.table = TokenTable(host.tpb, host.shared.__contains__)
        self.policy = {}

    def run(self, inp) -> tuple[list[list[int]], list[list[int]]]:
        table, victims, freed = self.table, [], []
        offsets, new_blocks = inp.new_blocks_csr()
        for i, req in enumerate(inp.req_ids):
            blocks = new_blocks[offsets[i]: offsets[i + 1]].tolist()
            table.sync_new_tokens(req, table.block_ids(req) + blocks, table.kv_len(req) + inp.num_new[i])
            policy, seq = self.policy[req], table.seq(req)
            doomed = []
            if policy is not None:
                live = table.position_live_mask(req)
                tokens = seq.token_at[: seq.kv_len].astype(np.int64)
                policy.observe(req, tokens[live], inp.mass[i, : seq.kv_len][live])
                doomed = policy.select(policy_view(table, req)).tolist()
            table.evict_tokens(req, doomed)
            victims.append(doomed)
            if self.compaction == "dead-blocks":
                dead = fully_dead_blocks(table, req)
                table.release_blocks(req, dead)
                freed.append(dead)
                continue
            plan = plan_for_mode(table, req, self.compaction, self.threshold, inp.pressure)
            if plan is None:
                freed.append([])
                continue
            relocate_slots(self.host.kv, torch.tensor(plan.src_slots, dtype=torch.int64),
                           torch.tensor(plan.dst_slots, dtype=torch.int64))
            freed.append(commit_plan(table, plan))
        return victims, freed


@settings(max_examples=80, deadline=None)
@given(compaction=st.sampled_from(["dense", "lazy", "dead-blocks"]), tpb=st.sampled_from([2, 4, 8]),
       steps=st.integers(1, 25), threshold=st.integers(1, 3), impl=st.sampled_from(["python", "auto"]),
       seed=st.integers(0, 2**31))
def test_step_equals_the_per_request_loop(compaction, tpb, steps, threshold, impl, seed):
    rng = np.random.default_rng(seed)
    host, spec_host = Host(256, tpb, seed), Host(256, tpb, seed)
    step = make_step(host, impl, compaction, threshold)
    spec = Spec(spec_host, compaction, threshold)
    step_policies, spec_policies = random_policies(np.random.default_rng(seed)), random_policies(np.random.default_rng(seed))
    next_req, evicted = 0, 0
    for _ in range(steps):
        joining = list(range(next_req, next_req + int(rng.integers(0, 3))))
        next_req += len(joining)
        for req in joining:
            k = int(rng.integers(0, len(step_policies)))
            step.add_request(req, step_policies[k])
            spec.table.add_request(req)
            spec.policy[req] = spec_policies[k]
        if rng.random() < 0.2 and step.request_ids():
            req = int(rng.choice(step.request_ids()))
            if step.kv_len(req) >= host.tpb:  # a full block: prefix caching shares no other
                host.shared.add(step.block_ids(req)[0]), spec_host.shared.add(step.block_ids(req)[0])
        state = rng.bit_generator.state
        inp = random_batch(rng, step, host, joining)
        rng.bit_generator.state = state
        spec_inp = random_batch(rng, step, spec_host, joining)  # same draws, the spec host's blocks
        victims, freed = spec.run(spec_inp)
        out = step.run(inp)
        assert [out.victims_of(i) for i in range(len(victims))] == victims
        assert [out.table.freed_of(i) for i in range(len(freed))] == freed
        evicted += sum(map(len, victims))
        host.release(out.table.freed), spec_host.release(b for f in freed for b in f)
        for req in step.request_ids():
            seq = spec.table.seq(req)
            assert (step.kv_len(req), step.num_tokens(req), step.num_live(req), step.block_ids(req)) == \
                (seq.kv_len, seq.num_tokens, seq.num_live, seq.block_ids)
        assert torch.equal(host.kv, spec_host.kv)
    assert evicted == step.stats.tokens_evicted
