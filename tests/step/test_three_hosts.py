# SPDX-License-Identifier: Apache-2.0
"""The three hosts run the one step: the reference engine (tiny real model), the simulated backend
and the TensorRT-LLM manager (over the 1.2.1 doubles) serve the same batch (three prompts, then
decode steps, StreamingLLM at budget 8) and step it once per iteration with the same input (the
engines ``DecodeStep.start`` + ``finish``, the manager ``run``, which makes both); they get
identical victims, moves, freed blocks and lengths, and identical tables."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.integration.test_trtllm_adapter import make_manager, write_new_kv
from tests.integration.trtllm_doubles import ScheduledRequests, make_request
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.model import LlamaConfig, LlamaForCausalLM
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.runtime.simulated import MODEL_SHAPES, SimulatedModel
from trtllm_vtoken.step import DecodeStep

PROMPTS, STEPS = (9, 13, 6), 10
TPB = 4
POLICY = dict(policy="streaming_llm", budget=8, policy_options={"n_sink": 2})


@pytest.fixture
def recorded(monkeypatch):
    """Every step (``start`` to ``finish``): (the step, its input in plain lists, its output in
    plain lists)."""
    calls, started = [], {}
    start, finish = DecodeStep.start, DecodeStep.finish

    def spy_start(step, inp, overlap=False, forward_between=False):
        started[step] = (list(inp.req_ids), list(inp.num_new), inp.new_blocks_csr()[1].tolist())
        start(step, inp, overlap, forward_between)

    def spy_finish(step):
        out = finish(step)
        calls.append((step, started.pop(step),
                      (out.victims.tolist(), [a.tolist() for a in out.table], out.lost.tolist())))
        return out

    monkeypatch.setattr(DecodeStep, "start", spy_start)
    monkeypatch.setattr(DecodeStep, "finish", spy_finish)
    return calls


def serve_engine(model) -> None:
    engine = Engine(model, EngineConfig(tokens_per_block=TPB, num_blocks=64, max_batch_size=4, max_seq_len=64,
                                        check_invariants=True, prefix_caching=False, eviction_unit=TPB,
                                        overlap_scheduler=False, **POLICY))
    # as the manager is driven below: a block at a time, each iteration's step before the next forward
    for n in PROMPTS:
        engine.add_request([1] * n, SamplingParams(max_tokens=STEPS + 2, ignore_eos=True))
    for _ in range(STEPS + 1):  # the prefill iteration, then decode iterations
        engine.step()


def serve_trtllm() -> None:
    manager = make_manager(POLICY["policy"], budget=POLICY["budget"])
    gen = torch.Generator().manual_seed(0)
    requests = [make_request(i, prompt_len=n, max_new_tokens=STEPS + 2) for i, n in enumerate(PROMPTS)]
    for i in range(STEPS + 1):
        batch = ScheduledRequests(**{"generation_requests" if i else "context_requests": requests})
        manager.prepare_resources(batch)
        for request in requests:
            write_new_kv(manager, request, gen)
        manager.update_resources(batch)


def canonical_blocks(calls: list) -> list:
    """The host's steps, (input, output) as recorded, with every block id (and slot) replaced by
    the index of the allocation that handed the block out."""
    names: dict[int, int] = {}

    def slot(s: int) -> int:
        return names[s // TPB] * TPB + s % TPB

    steps, allocations = [], 0
    for (req_ids, num_new, new_blocks), (victims, table, lost) in calls:
        for block in new_blocks:
            names[block], allocations = allocations, allocations + 1
        move_offsets, tokens, src, dst, freed_offsets, freed, kv_lens = table
        renamed = [move_offsets, tokens, [slot(s) for s in src], [slot(s) for s in dst], freed_offsets,
                   [names[b] for b in freed], kv_lens]
        steps.append(((req_ids, num_new, [names[b] for b in new_blocks]), (victims, renamed, lost)))
    return steps


def test_engine_simulated_backend_and_trtllm_manager_run_the_same_step(recorded):
    serve_engine(LlamaForCausalLM(LlamaConfig.tiny()).eval())
    serve_engine(SimulatedModel(MODEL_SHAPES["smollm2-135m"]))
    serve_trtllm()
    hosts = list(dict.fromkeys(step for step, _, _ in recorded))
    assert len(hosts) == 3 and len({step.impl for step in hosts}) == 1
    per_host = [[(inp, out) for step, inp, out in recorded if step is host] for host in hosts]
    assert all(len(calls) == STEPS + 1 for calls in per_host)  # one step per iteration
    # The allocators differ (TensorRT-LLM hands rewound blocks out first), so blocks are compared by
    # the allocation that produced them: the n-th block a host handed out is block n everywhere.
    canonical = [canonical_blocks(calls) for calls in per_host]
    assert canonical[0] == canonical[1] == canonical[2]
    evicted = sum(len(out[0]) for _, out in per_host[0])
    moves = sum(len(out[1][1]) for _, out in per_host[0])
    assert evicted > 20 and moves > 0  # the batch did evict and relocate
    assert len({host.table_digest() for host in hosts[:2]}) == 1, "the engines' token tables differ"
    assert np.array_equal(hosts[0].batch_tokens([0, 1, 2]), hosts[2].batch_tokens([0, 1, 2]))


@pytest.mark.parametrize("built", [True, False])
def test_vtoken_info_names_the_implementation_each_host_uses(built, monkeypatch, capsys):
    from trtllm_vtoken.cli import main
    from trtllm_vtoken.cli.info import step_implementations
    from trtllm_vtoken.core.native import load
    from trtllm_vtoken.step import core

    if not built:  # as where the C++ core was not built: every host falls back to the Python step
        monkeypatch.setattr(core, "load_native", lambda: None)
    elif load() is None:
        pytest.skip("the C++ core is not built")
    said = dict(step_implementations())
    small = dict(tokens_per_block=4, num_blocks=16, max_seq_len=32)
    engine = Engine(LlamaForCausalLM(LlamaConfig.tiny()), EngineConfig(variant="naive-evict", **small))
    simulated = Engine(SimulatedModel(MODEL_SHAPES["smollm2-135m"]), EngineConfig(**small))
    native = Engine(SimulatedModel(MODEL_SHAPES["smollm2-135m"]), EngineConfig(variant="native", **small))
    assert said["reference engine (naive-evict, vtoken)"] == engine.kv.step.impl == ("cpp" if built else "python")
    assert said["simulated backend"] == simulated.kv.step.impl
    assert said["TensorRT-LLM manager"] == make_manager("h2o").vtoken.step.impl
    assert native.kv.step is None and said["native baseline"].startswith("none")
    assert main(["info"]) == 0
    printed = capsys.readouterr().out
    assert all(f"  {host}: {impl}" in printed for host, impl in said.items())
