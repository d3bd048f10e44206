# SPDX-License-Identifier: Apache-2.0
"""Position-shift mode inside the batched step: each surviving key is turned back by exactly the
tokens its request's physical length lost at every step since it was written, once per step
(compared with a step without re-rotation on an identical host), for every policy mixed in one
batch, both compactions and both table implementations; V never changes."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.step.drive import Host, make_step, random_batch, random_policies
from trtllm_vtoken.reclaim.rerotate import KeyRerotation, rerotate_slots
from trtllm_vtoken.reclaim.rope import RopeSpec
from trtllm_vtoken.step.core import IMPLS, resolve_impl

ROPE = RopeSpec(4, theta=100.0)


def write_new_tokens(step, inp, hosts, rng) -> None:
    """The forward's part: the same fresh K/V at each new token's slot (positions [kv_len,
    kv_len + n) of its request's blocks, new ones appended) in every host."""
    offsets, new_blocks = inp.new_blocks_csr()
    for i, (req, n) in enumerate(zip(inp.req_ids, inp.num_new)):
        blocks = step.core.block_ids(req) if req in step.core else []
        blocks = blocks + new_blocks[offsets[i]:offsets[i + 1]].tolist()
        start = step.kv_len(req) if req in step.core and step.core.num_tokens(req) else 0
        for pos in range(start, start + n):
            fresh = torch.from_numpy(rng.standard_normal(hosts[0].kv[0, :, :, :, 0].shape)).float()
            for host in hosts:
                host.kv[blocks[pos // 4], :, :, :, pos % 4] = fresh


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "auto"])
@pytest.mark.parametrize("compaction", ["dense", "lazy"])
def test_step_turns_each_survivor_back_by_the_length_its_request_lost(impl, compaction):
    if impl == "cpp" and resolve_impl("auto") != "cpp":
        pytest.skip("C++ core not built")
    rng = np.random.default_rng(11)
    plain_host, shifted_host = Host(96, 4), Host(96, 4)
    plain, shifted = make_step(plain_host, impl, compaction), make_step(shifted_host, impl, compaction)
    shifted.rerotation = KeyRerotation([shifted_host.kv], ROPE)
    total: dict[tuple[int, int], int] = {}  # (request, logical id) -> positions turned back so far
    next_id = 0
    for _ in range(25):
        joining = []
        if len(plain.request_ids()) < 6:
            policies = random_policies(rng)
            for _ in range(2):
                policy = policies[int(rng.integers(len(policies)))]
                plain.add_request(next_id, policy)
                shifted.add_request(next_id, copy.deepcopy(policy))
                joining.append(next_id)
                next_id += 1
        state = rng.bit_generator.state
        inp = random_batch(rng, plain, plain_host, joining)
        rng.bit_generator.state = state
        assert random_batch(rng, shifted, shifted_host, joining).new_blocks_csr()[1].tolist() == \
            inp.new_blocks_csr()[1].tolist()
        write_new_tokens(plain, inp, (plain_host, shifted_host), rng)
        out, shifted_out = plain.run(inp), shifted.run(inp)
        assert np.array_equal(out.lost, shifted_out.lost)
        for req, lost in zip(out.req_ids.tolist(), out.lost.tolist()):
            for token in plain.core.live_slots(req)[0].tolist():
                total[req, token] = total.get((req, token), 0) + lost
        for host, o in ((plain_host, out), (shifted_host, shifted_out)):
            host.release(o.table.freed)
        # Every live key of the shifted host is the plain host's, turned back by its total.
        for req in plain.request_ids():
            ids, slots = plain.core.live_slots(req)
            assert np.array_equal(slots, shifted.core.live_slots(req)[1])
            shifts = torch.tensor([total.get((req, t), 0) for t in ids.tolist()])
            expected = plain_host.kv.clone()
            rerotate_slots(expected, torch.as_tensor(slots), shifts, ROPE)
            blocks, offsets = torch.as_tensor(slots) // 4, torch.as_tensor(slots) % 4
            torch.testing.assert_close(shifted_host.kv[blocks, :, 0, :, offsets], expected[blocks, :, 0, :, offsets],
                                       rtol=0, atol=1e-5)
            assert torch.equal(shifted_host.kv[blocks, :, 1, :, offsets], plain_host.kv[blocks, :, 1, :, offsets])
    assert shifted.rerotation.stats.passes > 10
