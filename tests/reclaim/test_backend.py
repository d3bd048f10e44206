# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest
import torch

from tests.helpers import add_sequence, kv_of, make_backend, make_kv, make_table
from trtllm_vtoken.reclaim import ReclaimConfig
from trtllm_vtoken.reclaim.copy import TorchCopyExecutor, relocate_slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dense_reclaim_moves_kv_and_frees_tail(dtype):
    pool, table = make_table()
    kv = make_kv(pool, dtype=dtype)
    add_sequence(pool, table, 0, 12)
    expected = {t: kv_of(table, kv, 0, t) for t in range(12)}
    backend = make_backend(pool, table, kv)
    table.evict_tokens(0, [2, 4, 10, 11])
    assert backend.reclaim([0]) == 1
    assert table.block_ids(0) == [0, 1] and pool.num_free == 14
    for t in table.live_ids(0).tolist():
        assert torch.equal(kv_of(table, kv, 0, t), expected[t])
    assert backend.stats.moves == 2 and backend.stats.invariant_checks == 1
    assert backend.stats.bytes_copied == 2 * kv[0, :, :, :, 0].numel() * kv.element_size()


def test_lazy_reclaim_respects_threshold_and_pressure():
    pool, table = make_table()
    kv = make_kv(pool)
    add_sequence(pool, table, 0, 14)
    backend = make_backend(pool, table, kv, mode="lazy", threshold=3)
    table.evict_tokens(0, [1, 2, 3, 6, 8, 10])  # 4 blocks for 8 live: fragmentation 2 (< 3)
    assert backend.plan(0) is None
    assert backend.reclaim([0], pressure=True) == 1
    assert table.block_ids(0) == [1, 2, 3] and table.kv_len(0) == 10


def test_plan_in_flight_and_stale_plans_are_refused():
    pool, table = make_table()
    add_sequence(pool, table, 0, 12)
    backend = make_backend(pool, table, make_kv(pool), mode="lazy")
    table.evict_tokens(0, [0, 1, 2, 5])
    plan = backend.plan(0)
    backend.submit(plan)
    assert backend.plan(0) is None  # not eligible while in flight
    with pytest.raises(ValueError, match="already has a relocation in flight"):
        backend.submit(plan)
    backend.commit_blocking(0)
    table.evict_token(0, 6)
    with pytest.raises(ValueError, match="taken from table version"):
        backend.submit(plan)
    with pytest.raises(KeyError, match="no relocation in flight"):
        backend.commit_blocking(0)


def test_lazy_commit_tolerates_evictions_and_appends_while_in_flight():
    pool, table = make_table()
    kv = make_kv(pool)
    blocks = add_sequence(pool, table, 0, 14)
    backend = make_backend(pool, table, kv, mode="lazy")
    table.evict_tokens(0, [1, 2, 3, 6, 8, 10])
    backend.submit(backend.plan(0))
    table.evict_token(0, 0)  # the token being moved dies meanwhile
    table.sync_new_tokens(0, blocks, 15)  # and the engine writes the next token
    assert backend.commit_blocking(0).req_id == 0
    assert table.num_live(0) == 8 and backend.stats.invariant_checks == 1


def test_i1_detects_a_corrupted_copy():
    pool, table = make_table()
    kv = make_kv(pool)
    add_sequence(pool, table, 0, 9)
    backend = make_backend(pool, table, kv)
    table.evict_token(0, 3)
    plan = backend.plan(0)
    backend.submit(plan)
    kv[2, :, :, :, 0] += 1.0  # token 8's source was copied already; corrupt its destination
    kv[0, :, :, :, 3] += 1.0
    with pytest.raises(RuntimeError, match="I1 violated for request 0"):
        backend.commit_blocking(0)


def test_shared_blocks_are_never_planned():
    pool, table = make_table()
    blocks = add_sequence(pool, table, 0, 8)
    backend = make_backend(pool, table, make_kv(pool))
    table.evict_token(0, 1)
    pool.share(blocks[:1])  # the block became shared after the eviction
    assert backend.plan(0) is None


def test_relocate_reference_gathers_before_scattering():
    kv = torch.arange(4 * 1 * 2 * 1 * 2 * 1, dtype=torch.float32).reshape(4, 1, 2, 1, 2, 1)
    before = kv.clone()
    relocate_slots(kv, torch.tensor([1, 6]), torch.tensor([2, 0]))
    assert torch.equal(kv[1, :, :, :, 0], before[0, :, :, :, 1])
    assert torch.equal(kv[0, :, :, :, 0], before[3, :, :, :, 0])


def test_executor_rejects_bad_pools():
    with pytest.raises(ValueError, match="6-D"):
        TorchCopyExecutor([torch.zeros(4, 4)])
    with pytest.raises(ValueError, match="at least one"):
        TorchCopyExecutor([])


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match=r"unknown ReclaimConfig key\(s\) \['mdoe'\]"):
        ReclaimConfig.from_dict({"mdoe": "lazy"})
    with pytest.raises(ValueError, match="mode must be"):
        ReclaimConfig(mode="eager")
    assert ReclaimConfig.from_dict({"mode": "lazy"}).mode == "lazy"


@pytest.mark.cuda
def test_cuda_side_stream_copy_matches_cpu():
    pool, table = make_table()
    kv_cpu = make_kv(pool)
    kv_gpu = kv_cpu.cuda()
    add_sequence(pool, table, 0, 12)
    table.evict_tokens(0, [2, 4, 10, 11])
    from trtllm_vtoken.reclaim.planner import plan_dense

    plan = plan_dense(table, 0)
    TorchCopyExecutor([kv_cpu]).submit(plan)
    handle = TorchCopyExecutor([kv_gpu]).submit(plan)
    handle.make_stream_wait(torch.cuda.current_stream())
    assert torch.equal(kv_gpu.cpu(), kv_cpu)
    assert all(s >= 0 for s in plan.dst_slots)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["torch", "auto"])
def test_delayed_side_stream_copy_is_waited_on(kernel):
    """I3: the side stream sleeps before copying; work queued on the compute stream after
    ``commit_ordered`` must still see the moved KV. The control read, queued without the event
    wait, sees the old (stale) destination, which proves the delay was real."""
    pool, table = make_table()
    kv = make_kv(pool).cuda()
    add_sequence(pool, table, 0, 12)
    table.evict_tokens(0, [2, 4, 10, 11])
    from trtllm_vtoken.reclaim.planner import plan_dense

    plan = plan_dense(table, 0)
    dst_block, dst_offset = plan.dst_slots[0] // 4, plan.dst_slots[0] % 4
    src_value = kv[plan.src_slots[0] // 4, :, :, :, plan.src_slots[0] % 4].clone()
    stale_value = kv[dst_block, :, :, :, dst_offset].clone()
    executor = TorchCopyExecutor([kv], kernel=kernel, copy_delay_cycles=200_000_000)  # ~0.1 s
    backend = make_backend(pool, table, None)
    backend.executor = executor
    compute = torch.cuda.current_stream()
    backend.submit(plan)
    unordered = kv[dst_block, :, :, :, dst_offset].clone()  # queued before the wait: a race
    backend.commit_ordered(0, compute)
    ordered = kv[dst_block, :, :, :, dst_offset].clone()
    torch.cuda.synchronize()
    assert torch.equal(unordered, stale_value), "the delayed copy finished before the control read"
    assert torch.equal(ordered, src_value)


def test_several_requests_relocate_in_one_copy():
    """One executor call carries every request's moves; each request commits on its own."""
    pool, table = make_table(num_blocks=16)
    kv = make_kv(pool)
    add_sequence(pool, table, 0, 12)
    add_sequence(pool, table, 1, 10)
    expected = {(r, t): kv_of(table, kv, r, t) for r, n in ((0, 12), (1, 10)) for t in range(n)}
    backend = make_backend(pool, table, kv)
    calls = []
    submit_many = backend.executor.submit_many
    backend.executor.submit_many = lambda plans: calls.append(len(plans)) or submit_many(plans)
    table.evict_tokens(0, [1, 5])
    table.evict_tokens(1, [0, 3, 4])
    assert backend.reclaim([0, 1]) == 1  # request 1: 7 live in blocks [3, 4], block 5 freed
    assert calls == [2] and backend.stats.plans == 2 and backend.stats.invariant_checks == 2
    for (r, t), value in expected.items():
        if table.seq(r).live[t]:
            assert torch.equal(kv_of(table, kv, r, t), value)
    plan = backend.plan(0)
    assert plan is None
    from trtllm_vtoken.reclaim.planner import plan_dense

    table.evict_tokens(0, [0])
    first = plan_dense(table, 0)
    with pytest.raises(ValueError, match="one plan per request"):
        backend.submit_many([first, first])
    assert not backend.in_flight(0)
