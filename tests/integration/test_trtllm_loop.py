# SPDX-License-Identifier: Apache-2.0
"""The Triton model's TensorRT-LLM path (``TRTLLMLoop``) over test doubles of the 1.2.1 LLM API:
streamed pieces arrive in order and join to the full output, cancellation aborts the request,
refusals reach only their client, and stop shuts the LLM down."""

from __future__ import annotations

import time

from tests.integration.trtllm_doubles import LLMDouble121, TensorrtLlmApiDouble121
from trtllm_vtoken.integration.trtllm.stats import StatsFile
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.serving.engine_loop import CollectingSink
from trtllm_vtoken.serving.metrics import METRICS
from trtllm_vtoken.serving.settings import ServingSettings
from trtllm_vtoken.serving.trtllm_loop import TRTLLMLoop, trtllm_sampling


def wait(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_requests_stream_in_order_and_finish():
    llm = LLMDouble121()
    loop = TRTLLMLoop(llm, TensorrtLlmApiDouble121).start()
    sinks = [CollectingSink() for _ in range(8)]
    for i, sink in enumerate(sinks):
        loop.submit([i + 1, 100], SamplingParams(max_tokens=5), sink)
    wait(lambda: all(s.done.is_set() for s in sinks))
    for i, sink in enumerate(sinks):
        assert sink.tokens == [i + 1, 100, i + 1, 100, i + 1]
        assert sink.text == "".join(f"<{t}>" for t in sink.tokens)
        assert [o.finished for o in sink.outputs] == [False] * 4 + [True]
        assert sink.outputs[-1].finish_reason == "length" and sink.outputs[-1].num_output_tokens == 5
    loop.stop()
    assert llm.shut_down and loop.in_flight() == 0


def test_metrics_merge_the_workers_counters_with_the_loops(tmp_path):
    stats_file = tmp_path / "stats.json"
    StatsFile(stats_file).maybe_write(lambda: {"vtoken_tokens_evicted": 42, "vtoken_requests_running": 0})
    seen = []
    loop = TRTLLMLoop(LLMDouble121(), TensorrtLlmApiDouble121, stats_file, on_stats=seen.append, poll_s=0.01).start()
    sinks = [CollectingSink() for _ in range(3)]
    for sink in sinks:
        loop.submit([5], SamplingParams(max_tokens=2), sink)
    wait(lambda: all(s.done.is_set() for s in sinks))
    wait(lambda: seen[-1]["vtoken_requests_finished"] == 3)
    assert seen[-1]["vtoken_tokens_evicted"] == 42 and seen[-1]["vtoken_requests_waiting"] == 0
    assert set(seen[-1]) <= {spec.name for spec in METRICS}
    loop.stop()
    # Without a worker file yet: only the loop's own counters.
    assert TRTLLMLoop(LLMDouble121(), TensorrtLlmApiDouble121, tmp_path / "none.json").metrics() == \
        {"vtoken_requests_finished": 0.0, "vtoken_requests_waiting": 0.0}


def test_a_cancelled_client_aborts_its_request():
    llm = LLMDouble121(delay_s=0.01)
    loop = TRTLLMLoop(llm, TensorrtLlmApiDouble121).start()
    sink = CollectingSink(cancel_after=2)
    loop.submit([7], SamplingParams(max_tokens=50), sink)
    wait(sink.done.is_set)
    assert llm.results[0].aborted and sink.outputs[-1].finish_reason == "cancelled"
    assert len(sink.tokens) < 50
    loop.stop()


def test_a_refused_request_fails_only_its_client():
    loop = TRTLLMLoop(LLMDouble121(), TensorrtLlmApiDouble121).start()
    bad, good = CollectingSink(), CollectingSink()
    loop.submit([], SamplingParams(max_tokens=3), bad)
    loop.submit([3], SamplingParams(max_tokens=3), good)
    wait(lambda: bad.done.is_set() and good.done.is_set())
    assert "refused the request: empty prompt" in bad.error and good.tokens == [3, 3, 3]
    loop.stop()


def test_sampling_parameters_map_onto_tensorrt_llm_names():
    """The same names and meanings: every field passes as it is (None, "not specified", included)."""
    greedy = trtllm_sampling(SamplingParams(max_tokens=9, stop="END", ignore_eos=True, logprobs=2),
                             TensorrtLlmApiDouble121)
    assert (greedy.max_tokens, greedy.top_k, greedy.temperature, greedy.stop, greedy.ignore_eos, greedy.logprobs) \
        == (9, None, None, ["END"], True, 2)
    assert greedy._greedy_decoding  # TensorRT-LLM decodes it greedily, as the reference runtime does
    sampled = trtllm_sampling(SamplingParams(temperature=0.7, top_p=0.9, seed=3), TensorrtLlmApiDouble121)
    assert (sampled.temperature, sampled.top_p, sampled.top_k, sampled.seed) == (0.7, 0.9, None, 3)
    assert not sampled._greedy_decoding


def test_backend_setting_is_validated():
    assert ServingSettings.from_parameters({"backend": "trtllm"}).backend == "trtllm"
    import pytest

    with pytest.raises(ValueError, match="backend must be auto, reference or trtllm"):
        ServingSettings.from_parameters({"backend": "vllm"})
