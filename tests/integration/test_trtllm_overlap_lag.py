# SPDX-License-Identifier: Apache-2.0
"""The one-step lag is the same on every host: TensorRT-LLM's executor loop (the 1.2.1 double of
``PyExecutor``, plain ``_executor_loop`` and ``_executor_loop_overlap``) driving vToken's manager,
and the reference engine with and without its overlap scheduler, make the same decisions step
for step, request by request.

StreamingLLM decides from token counts alone, so the two hosts (different models, schedulers and
allocators; no prefix caching on either, which would keep prompt blocks on top of the budget) must give each request the same victims at each of its steps when they order the step
alike: under the overlap order the step after a forward also counts the next forward's token (its
first step takes the prompt and the first generated token together), in the plain order it does
not. The same request mix shows both: the overlap order differs from the plain one."""

from __future__ import annotations

import pytest

from tests.integration.test_trtllm_executor_loop import TPB, Mix, build_executor
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.runtime.simulated import MODEL_SHAPES, SimulatedModel
from trtllm_vtoken.step import DecodeStep

BUDGET, N_SINK = 12, 2
MIX = [(5, 20), (11, 9), (17, 30), (26, 3), (35, 12), (2, 25)]  # (prompt tokens, new tokens)


@pytest.fixture
def victims(monkeypatch):
    """Every finished step's victims: request id -> [victims of each step that had its row]."""
    seen: dict[int, list[tuple[int, ...]]] = {}
    finish = DecodeStep.finish

    def spy_finish(step):
        out = finish(step)
        for i, req_id in enumerate(out.req_ids.tolist()):
            seen.setdefault(req_id, []).append(tuple(out.victims_of(i)))
        return out

    monkeypatch.setattr(DecodeStep, "finish", spy_finish)
    return seen


def engine_decisions(overlap: bool, victims: dict) -> list[list[tuple[int, ...]]]:
    victims.clear()
    engine = Engine(SimulatedModel(MODEL_SHAPES["smollm2-135m"]), EngineConfig(
        policy="streaming_llm", budget=BUDGET, policy_options={"n_sink": N_SINK}, eviction_unit=TPB,
        tokens_per_block=TPB, num_blocks=200, max_batch_size=len(MIX), max_seq_len=96, check_invariants=True,
        prefix_caching=False, overlap_scheduler=overlap))
    ids = [engine.add_request([1] * n, SamplingParams(max_tokens=new, ignore_eos=True)) for n, new in MIX]
    while engine.has_unfinished():
        engine.step()
    return [victims.get(req_id, []) for req_id in ids]


def trtllm_decisions(overlap: bool, victims: dict) -> list[list[tuple[int, ...]]]:
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, SamplingConfig

    executor = build_executor("streaming_llm", Mix(0, num_requests=len(MIX), num_blocks=200,
                                                   max_batch_size=len(MIX)), overlap=overlap, block_reuse=False)
    victims.clear()  # the estimation run's and the warm-up's steps are not the mix's
    requests = [LlmRequest(request_id=100 + i, max_new_tokens=new, input_tokens=list(range(2, 2 + n)),
                           sampling_config=SamplingConfig(1)) for i, (n, new) in enumerate(MIX)]
    for req in requests:
        executor.enqueue_request(req, 0)
    executor.run()
    assert all(executor.responses[req.py_request_id].finish_reason.name == "LENGTH" for req in requests)
    return [victims.get(req.py_request_id, []) for req in requests]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_executor_loop_and_the_engine_decide_alike_in_the_same_order(trtllm121, victims, overlap):
    trtllm = trtllm_decisions(overlap, victims)
    engine = engine_decisions(overlap, victims)
    if not overlap:
        # The plain engine starts an iteration's step before sampling, so the step of the
        # iteration a request finishes in runs for it too; TensorRT-LLM's loop frees the request
        # first (``_handle_responses`` before ``update_resources``) and skips it.
        engine = [steps[:-1] for steps in engine]
    assert trtllm == engine
    assert sum(len(v) for steps in engine for v in steps) > 50  # the mix evicted


def test_the_overlap_order_moves_the_decisions(trtllm121, victims):
    plain, overlapped = engine_decisions(False, victims), engine_decisions(True, victims)
    assert plain != overlapped
    for (n, new), a, b in zip(MIX, plain, overlapped):
        # Every token but the last generated one reaches the table in both orders, so a request
        # loses the same tokens overall; the overlap order's first step takes two steps' worth.
        assert sorted(v for step in a for v in step) == sorted(v for step in b for v in step)
