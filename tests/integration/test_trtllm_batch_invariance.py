# SPDX-License-Identifier: Apache-2.0
"""The TensorRT-LLM manager decides for a request as it would alone, whatever runs beside it
(block reuse on, TensorRT-LLM's default), driven by the executor-loop double in both of its
orders. Four requests share a system prompt: each runs alone (one after another, later ones
taking the stored prompt blocks from the reuse tree), then together (the others join while the
first decodes, holding its stored prompt blocks at the same time). The protected tokens are each
request's own full prompt blocks, shared or not, so every request's victims, registration by
registration, must be the same both ways."""

from __future__ import annotations

import pytest

from tests.integration.test_trtllm_executor_loop import Mix, build_executor, trace_victims

SYSTEM = [7, 19, 23, 41, 5, 88, 13, 2, 61]  # two full blocks of 4 and one token
SUFFIXES = [[3, 4, 5], [9, 10, 11, 12, 13, 14], [30], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60]]


def decisions(policy: str, overlap: bool, together: bool) -> tuple[dict[int, list], int]:
    """Each request's (tokens known, victims) after every step, and the prompt tokens reused."""
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, SamplingConfig

    executor = build_executor(policy, Mix(0, num_requests=len(SUFFIXES), num_blocks=120,
                                          max_batch_size=len(SUFFIXES)), overlap=overlap)
    trace = trace_victims(executor.resources["kv_cache_manager"])
    requests = [LlmRequest(request_id=100 + i, max_new_tokens=14, input_tokens=SYSTEM + suffix,
                           sampling_config=SamplingConfig(1)) for i, suffix in enumerate(SUFFIXES)]
    reused: list[int] = []  # add_sequence's reuse hits (LlmRequest.set_prepopulated_prompt_len)
    for i, req in enumerate(requests):
        setter = req.set_prepopulated_prompt_len
        req.set_prepopulated_prompt_len = lambda n, tpb, setter=setter: (reused.append(n), setter(n, tpb))[1]
        # together: the others join while the first decodes; alone: each after the last finished
        executor.enqueue_request(req, (0, 2, 3, 5)[i] if together else 40 * i)
    executor.run()
    assert all(executor.responses[r.py_request_id].finish_reason.name == "LENGTH" for r in requests)
    return {r: t for r, t in trace.items() if r >= 100}, sum(reused)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("policy", ["h2o", "streaming_llm", "sliding_window", "random", "scissorhands"])
def test_a_request_decides_alike_alone_and_beside_requests_sharing_its_prompt(trtllm121, policy, overlap):
    alone, reused_alone = decisions(policy, overlap, together=False)
    together, reused_together = decisions(policy, overlap, together=True)
    assert reused_alone > 0 and reused_together > 0, "the system prompt came from the reuse tree"
    assert together == alone
    assert any(v for t in alone.values() for _, v in t), "the budget evicts"
