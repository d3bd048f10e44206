# SPDX-License-Identifier: Apache-2.0
"""The engine thread behind the Triton model: concurrent submitters, cancellation, shutdown."""

from __future__ import annotations

import threading

import pytest
import torch

from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.serving.engine_loop import CollectingSink as Collect
from trtllm_vtoken.serving.engine_loop import EngineLoop
from trtllm_vtoken.serving.metrics import METRICS, snapshot


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig.tiny()).eval()


def make_engine(model, **overrides) -> Engine:
    cfg = dict(policy="h2o", budget=12, tokens_per_block=4, num_blocks=64, max_batch_size=8, max_seq_len=64)
    cfg.update(overrides)
    return Engine(model, EngineConfig(**cfg))


def prompt(i: int) -> list[int]:
    return torch.randint(0, 128, (5 + i % 20,), generator=torch.Generator().manual_seed(i)).tolist()


def test_concurrent_submitters_get_the_outputs_of_a_direct_run(model):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    direct = make_engine(model)
    ids = [direct.add_request(prompt(i), params) for i in range(24)]
    while direct.has_unfinished():
        direct.step()
    expected = [direct.pop_finished(i).output_ids for i in ids]

    steps = []
    loop = EngineLoop(make_engine(model), on_step=lambda e: steps.append(snapshot(e)))
    sinks = [Collect() for _ in range(24)]
    threads = [threading.Thread(target=loop.submit, args=(prompt(i), params, sinks[i])) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The loop starts once every client has submitted: its first step fills the batch, however
    # slowly the client threads ran (stepping meanwhile made the batch size depend on timing).
    loop.start()
    assert all(s.done.wait(30) for s in sinks)
    loop.stop()
    assert [s.tokens for s in sinks] == expected and all(s.error is None for s in sinks)
    assert all(s.outputs[-1].finish_reason == "length" for s in sinks)
    assert max(m["vtoken_requests_running"] for m in steps) == 8  # one batch, many clients
    final = snapshot(loop.engine)
    assert final["vtoken_kv_blocks_retained"] == 0 and final["vtoken_requests_finished"] == 24
    assert final["vtoken_tokens_evicted"] == direct.kv.step_stats.tokens_evicted
    assert {m.name for m in METRICS} == set(final)


def test_bad_requests_fail_alone_and_the_loop_keeps_serving(model):
    loop = EngineLoop(make_engine(model)).start()
    bad, good = Collect(), Collect()
    loop.submit([1] * 70, SamplingParams(max_tokens=4), bad)
    loop.submit(prompt(1), SamplingParams(max_tokens=4), good)
    assert bad.done.wait(10) and good.done.wait(10)
    assert "exceeds max_seq_len 64" in bad.error and good.error is None and len(good.tokens) == 4
    loop.stop()


def test_cancelled_clients_free_their_blocks(model):
    loop = EngineLoop(make_engine(model)).start()
    quitter, stayer = Collect(cancel_after=3), Collect()
    loop.submit(prompt(2), SamplingParams(max_tokens=40, ignore_eos=True), quitter)
    loop.submit(prompt(3), SamplingParams(max_tokens=40, ignore_eos=True), stayer)
    assert quitter.done.wait(10) and stayer.done.wait(30)
    assert quitter.error == "request cancelled" and len(stayer.tokens) == 40
    loop.stop()
    engine = loop.engine
    assert engine.stats.cancelled == 1 and engine.kv.num_available == engine.kv.pool.num_blocks


def test_stop_fails_in_flight_requests_and_refuses_new_ones(model):
    loop = EngineLoop(make_engine(model)).start()
    sinks = [Collect() for _ in range(4)]
    for i, sink in enumerate(sinks):
        loop.submit(prompt(i), SamplingParams(max_tokens=60 - len(prompt(i)), ignore_eos=True), sink)
    loop.stop()
    assert all(s.done.is_set() for s in sinks)
    assert any(s.error == "server is shutting down" for s in sinks)
    late = Collect()
    loop.submit(prompt(0), SamplingParams(), late)
    assert late.error == "server is shutting down"
    assert loop.engine.kv.num_available == loop.engine.kv.pool.num_blocks
