# SPDX-License-Identifier: Apache-2.0
"""No lag for a policy that decides from counts, on every host and in every order: TensorRT-LLM's
executor loop (the 1.2.1 double of ``PyExecutor``, plain ``_executor_loop`` and
``_executor_loop_overlap``) driving vToken's manager, and the reference engine with and without
its overlap scheduler, give each request the same victims at each of its steps. StreamingLLM
decides from token counts alone, so the two hosts (different models, schedulers and allocators;
no prefix caching on either) must agree step for step. Under the overlap order both take batch
N's tokens in before forward N+1 is launched (the manager in ``prepare_resources(N+1)``, which
``_executor_loop_overlap`` calls before ``_forward_step``; the engine before it reserves N+1's
slots), so the overlap order decides as the plain one. They differ only at a request's end:
TensorRT-LLM's plain loop frees a finished request before ``update_resources`` (its last step
never runs), the plain engine starts the step before sampling and the overlap manager prepares
the request for one more batch before it learns it finished: one step more, no forward reads it.
(Attention-observing policies read each host's own model's attention, so they are held to the
plain order per host: ``tests/runtime/test_overlap_scheduler.py`` and the loop double's
``test_every_policy_decides_in_the_overlap_loop_as_in_the_plain_loop``.)"""

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


def agree(runs: list[list[list[tuple[int, ...]]]]) -> None:
    """Per request: every run's steps are the shortest run's, plus at most one at the end."""
    for steps in zip(*runs):
        shortest = min(len(s) for s in steps)
        assert all(s[:shortest] == steps[0][:shortest] and len(s) - shortest <= 1 for s in steps)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_executor_loop_and_the_engine_decide_alike_in_the_same_order(trtllm121, victims, overlap):
    trtllm = trtllm_decisions(overlap, victims)
    engine = engine_decisions(overlap, victims)
    agree([trtllm, engine])
    assert sum(len(v) for steps in engine for v in steps) > 50  # the mix evicted


def test_the_overlap_order_decides_as_the_plain_order(trtllm121, victims):
    plain, overlapped = trtllm_decisions(False, victims), trtllm_decisions(True, victims)
    agree([plain, overlapped, engine_decisions(False, victims), engine_decisions(True, victims)])
    for (n, new), steps in zip(MIX, plain):
        # The plain loop steps once for the prompt and once after each decode forward but the
        # last (the request is freed first): new - 2 decode steps.
        assert len(steps) == new - 1
