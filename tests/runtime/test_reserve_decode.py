# SPDX-License-Identifier: Apache-2.0
"""The decode rows' batch reservation (``KVCacheManager.reserve_decode``, ``PendingWrites``) against
one ``reserve`` per request, on both kinds of host bookkeeping (native's block lists and vToken's
step): the same blocks to the same requests in the same order, the pool and the peak alike; a pool
too short for the whole batch, or a cached prefix not yet joined, refuses it and changes nothing."""

from __future__ import annotations

import pytest

from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.runtime.simulated import MODEL_SHAPES, SimulatedModel

TPB = 8


def prefilled(variant: str, num_blocks: int, prefix_caching: bool = False, overlap: bool = False) -> Engine:
    """Eight requests of 13..16 tokens, two of each length (two fill their last block together),
    admitted and prefilled; ``overlap``: with the overlap scheduler, whose prefill's step has not
    run yet (its tokens are still reserved when the next reservation comes)."""
    engine = Engine(SimulatedModel(MODEL_SHAPES["llama-3.1-8b"]), EngineConfig(
        variant=variant, policy="streaming_llm", budget=1.0, tokens_per_block=TPB, num_blocks=num_blocks,
        max_seq_len=64, admission="greedy", prefix_caching=prefix_caching, overlap_scheduler=overlap))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(8):
        engine.add_request([1] * (13 + i % 4), params)
    engine.step()
    assert len(engine.running) == 8
    return engine


def state(engine: Engine) -> tuple:
    kv = engine.kv
    return dict(kv.writes.staged), list(kv.pool.free_ids), list(kv.pool.ref_counts), kv.stats.peak_blocks_used


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("variant", ["native", "vtoken"])
def test_batch_reservation_hands_out_what_one_reservation_per_request_would(variant, overlap):
    batch, single = prefilled(variant, 64, overlap=overlap), prefilled(variant, 64, overlap=overlap)
    rows = list(batch.running)
    for _ in range(TPB + 1):  # every request crosses a block boundary on one of these steps
        assert batch.kv.reserve_decode(rows)
        for req_id in rows:
            assert single.kv.reserve(req_id, 1)
        assert state(batch) == state(single)
        for engine in (batch, single):
            engine.kv.step_batch(rows)
    crossed = sum(batch.kv.layout.num_blocks(r) for r in rows)
    assert crossed > 2 * 8  # blocks were handed out


@pytest.mark.parametrize("variant", ["native", "vtoken"])
def test_a_pool_short_for_the_batch_refuses_it_and_changes_nothing(variant):
    engine = prefilled(variant, 40)
    kv, rows = engine.kv, list(engine.running)
    needed = sum(kv.layout.kv_len(r) % TPB == 0 for r in rows)  # rows whose last block is full
    assert needed > 0
    kv.pool.allocate(kv.pool.num_free - needed + 1)  # one block short of the batch
    before = state(engine)
    assert not kv.reserve_decode(rows)
    assert state(engine) == before
    assert kv.reserve_decode([r for r in rows if kv.layout.kv_len(r) % TPB])  # rows that need no block


def test_the_engine_preempts_as_before_when_the_pool_runs_dry():
    """The one-by-one path still runs when the batch does not fit: the newest request goes."""
    engine = prefilled("native", 22)
    newest = engine.running[-1]
    while engine.stats.preemptions == 0:
        engine.step()
    assert newest not in engine.running and engine.requests[newest].num_preemptions == 1
    while engine.has_unfinished():
        engine.step()
    engine.kv.check_integrity()


def test_a_cached_prefix_not_yet_joined_takes_the_one_by_one_path():
    engine = prefilled("vtoken", 64, prefix_caching=True)
    kv, rows = engine.kv, list(engine.running)
    joining = 100  # admitted with the running requests' prompt blocks cached: its prefix joins at its first step
    kv.new_iteration()  # as the scheduler's next admissions begin: the prefills have written their blocks
    cached = kv.admit(joining, [1] * 20, 4, kv.spec)  # a copy of the cached prefix (prefix_reuse="copy")
    assert cached >= TPB and kv.writes.cached_tokens(joining) == cached
    before = state(engine)
    assert not kv.reserve_decode(rows + [joining])
    assert state(engine) == before
    assert kv.reserve_decode(rows)  # without it the batch goes at once


@pytest.mark.parametrize("variant", ["native", "vtoken"])
def test_a_reservation_grows_for_drafts_and_gives_back_what_it_drops(variant):
    """Speculative decoding's two calls: ``extend_reservation`` grows this iteration's reservation
    (blocks as needed), ``drop_reserved`` takes its tail back and frees the blocks left empty;
    dropping more than was reserved this iteration is an error that changes nothing."""
    engine = prefilled(variant, num_blocks=64)
    kv, req_id = engine.kv, engine.running[0]
    free_before = kv.pool.num_free
    assert kv.reserve_decode(engine.running)
    written = kv.writes.written_counts(req_id)[1]  # 13 tokens: 3 left in its second block
    assert kv.extend_reservation(req_id, 2 * TPB)  # 1 + 16 tokens: two fresh blocks
    assert kv.writes.staged[req_id][1] == 1 + 2 * TPB and len(kv.writes.staged[req_id][0]) == 2
    assert len(kv.staged_slots(req_id)) == 1 + 2 * TPB
    kv.drop_reserved(req_id, 2 * TPB - 1)  # keeps 2 tokens: no fresh block needed for them
    assert kv.writes.staged[req_id] == ([], 2) and written % TPB + 2 <= TPB
    with pytest.raises(ValueError, match="cannot drop 3"):
        kv.drop_reserved(req_id, 3)
    assert kv.writes.staged[req_id] == ([], 2)
    assert not kv.extend_reservation(req_id, 10 * 64 * TPB)  # the pool lacks them: nothing changes
    assert kv.writes.staged[req_id] == ([], 2)
    assert kv.pool.num_free == free_before - sum(len(f) for f, _ in kv.writes.staged.values())
