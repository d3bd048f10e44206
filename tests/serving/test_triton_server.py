# SPDX-License-Identifier: Apache-2.0
"""The real Triton server on triton_model_repo, driven by tritonclient HTTP + gRPC and the
generate endpoints, checked against the engine run in-process with the same settings."""

from __future__ import annotations

import json
import queue
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from trtllm_vtoken.serving.settings import ServingSettings
from trtllm_vtoken.serving.triton import repository_parameters

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Explain what a hash table is.", "Write a haiku about the sea.",
           "Give me three tips for writing readable Python code."]


def generate(server, model: str, body: dict, stream: bool = False) -> tuple[int, object]:
    url = f"http://{server.http_url}/v2/models/{model}/generate" + ("_stream" if stream else "")
    request = urllib.request.Request(url, data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            raw = response.read().decode()
            if stream:
                return response.status, [json.loads(l[6:]) for l in raw.splitlines() if l.startswith("data: ")]
            return response.status, json.loads(raw)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read().decode())


def metrics(server) -> dict[str, float]:
    """vToken's metric families as Triton's Prometheus endpoint reports them."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(vtoken_\w+)\{[^}]*\} (\S+)$", text, re.M)}


@pytest.fixture(scope="module")
def local_engine(triton_server):
    """The same engine, in this process, with the server's thread count: what it must answer."""
    import torch

    from tests.serving.conftest import ENGINE_THREADS
    from trtllm_vtoken.runtime.checkpoint import resolve_model
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.model import load_llama
    from trtllm_vtoken.runtime.tokenizer import Tokenizer

    settings = ServingSettings.from_parameters(repository_parameters(triton_server.repository))
    folder = resolve_model(settings.model)
    tokenizer = Tokenizer(folder)
    threads = torch.get_num_threads()
    torch.set_num_threads(ENGINE_THREADS)
    yield Engine(load_llama(folder), settings.engine, tokenizer), tokenizer
    torch.set_num_threads(threads)


def run_local(local_engine, prompt: str, max_tokens: int, eviction=None):
    from trtllm_vtoken.runtime.sampling import SamplingParams

    engine, tokenizer = local_engine
    params = SamplingParams(max_tokens=max_tokens, eviction=eviction)
    req_id = engine.add_request(tokenizer.encode(prompt, chat=True), params)
    while engine.has_unfinished():
        engine.step()
    return engine.pop_finished(req_id)


def test_generate_endpoints_answer_what_the_engine_generates(triton_server, local_engine):
    for prompt in PROMPTS[:3]:
        expected = run_local(local_engine, prompt, 16)
        status, body = generate(triton_server, "ensemble", {"text_input": prompt, "max_tokens": 16})
        assert status == 200 and body["text_output"] == expected.text
        status, body = generate(triton_server, "tensorrt_llm", {
            "text_input": prompt, "sampling_param_max_tokens": 16, "return_finish_reason": True,
            "return_stop_reason": True, "return_cumulative_logprob": True})
        assert status == 200 and body["text_output"] == expected.text
        assert body["finish_reason"] == expected.finish_reason and body["stop_reason"] == ""
        assert body["cumulative_logprob"] == pytest.approx(expected.cumulative_logprob, rel=1e-5)
    stop = expected.text.split()[2]
    status, body = generate(triton_server, "tensorrt_llm", {
        "text_input": PROMPTS[2], "sampling_param_max_tokens": 16, "sampling_param_stop": [stop],
        "return_finish_reason": True, "return_stop_reason": True})
    assert body["text_output"] == expected.text[: expected.text.index(stop)]
    assert (body["finish_reason"], body["stop_reason"]) == ("stop", stop)
    status, body = generate(triton_server, "tensorrt_llm", {"text_input": PROMPTS[0], "sampling_param_max_tokens": 8,
                                                            "sampling_param_exclude_input_from_output": False})
    assert body["text_output"].startswith(PROMPTS[0])


def test_streamed_pieces_arrive_in_order_and_join_to_the_full_text(triton_server):
    import tritonclient.grpc as grpcclient

    _, whole = generate(triton_server, "ensemble", {"text_input": PROMPTS[1], "max_tokens": 32})
    status, events = generate(triton_server, "ensemble", {"text_input": PROMPTS[1], "max_tokens": 32, "stream": True},
                              stream=True)
    assert status == 200 and len(events) > 5 and "".join(e["text_output"] for e in events) == whole["text_output"]

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("streaming", [1], "BOOL"),
              grpcclient.InferInput("sampling_param_max_tokens", [1], "INT32")]
    inputs[0].set_data_from_numpy(np.array([PROMPTS[1].encode()], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([True]))
    inputs[2].set_data_from_numpy(np.array([32], dtype=np.int32))
    client.async_stream_infer("tensorrt_llm", inputs, enable_empty_final_response=True)
    pieces = []
    while True:
        result, error = results.get(timeout=120)
        assert error is None, error
        final = result.get_response().parameters["triton_final_response"].bool_param
        output = result.as_numpy("text_output")
        if output is not None:
            pieces.append(output[0].decode())
        if final:
            break
    client.stop_stream()
    assert "".join(pieces) == whole["text_output"] and len([p for p in pieces if p]) > 5


def test_32_concurrent_clients_all_answered(triton_server):
    def one(i: int):
        return generate(triton_server, "tensorrt_llm", {"text_input": PROMPTS[i % 4] + f" ({i})",
                                                        "sampling_param_max_tokens": 12, "return_finish_reason": True})

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(one, range(32)))
    assert all(status == 200 for status, _ in answers), [b for s, b in answers if s != 200][:2]
    assert all(body["text_output"] and body["finish_reason"] in ("length", "stop") for _, body in answers)
    assert metrics(triton_server)["vtoken_kv_blocks_retained"] == 0


def test_a_greedy_answer_is_the_same_alone_and_sent_together(triton_server):
    """H2O at 0.5 with prefix caching on (the server's settings): six chat prompts sharing the
    chat template answer the same sent one at a time and sent at once."""
    chat = ["Write one sentence about cats.", "Write one sentence about the sea.", "Write one sentence about rain.",
            "Write one sentence about bread.", "Write one sentence about trains.", "Write one sentence about music."]

    def one(prompt: str) -> str:
        status, body = generate(triton_server, "tensorrt_llm", {"text_input": prompt, "sampling_param_max_tokens": 16})
        assert status == 200, body
        return body["text_output"]

    alone = [one(p) for p in chat]
    with ThreadPoolExecutor(len(chat)) as pool:
        together = list(pool.map(one, chat))
    assert together == alone


def test_bad_inputs_get_clear_errors_and_the_server_keeps_serving(triton_server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    cases = [
        ({"sampling_param_max_tokens": 4}, "missing required input 'text_input'"),
        ({"text_input": "", "sampling_param_max_tokens": 4}, "'text_input' is empty"),
        ({"text_input": "hi", "sampling_param_max_tokens": 0}, "must lie in [1, 256], got 0"),
        ({"text_input": "hi", "sampling_param_max_tokens": 257}, "must lie in [1, 256], got 257"),
        ({"text_input": "word " * 1100, "sampling_param_max_tokens": 4}, "exceeds max_seq_len 1024"),
        ({"text_input": "hi", "vtoken_policy": "lru"}, "unknown eviction policy 'lru'"),
        # Per-request settings accept any known policy ("random" too); a bad value is refused.
        ({"text_input": "hi", "vtoken_policy": "random", "vtoken_budget": -2.0}, "ratio must lie in (0, 1]"),
        # Triton's HTTP front end casts JSON integers to the input's int32: 2**40 arrives as 0.
        ({"text_input": "hi", "sampling_param_max_tokens": 2**40}, "got 0 (over HTTP, Triton converts JSON integers "
                                                                    "to int32 before the model sees them"),
        ({"text_input": "hi", "sampling_param_temperature": 1e39}, "'sampling_param_temperature' must be a finite "
                                                                   "number, got inf"),  # beyond fp32: inf
        ({"text_input": "hi", "sampling_param_temperature": float("inf")}, "must be a finite number, got inf"),
        ({"text_input": "hi", "sampling_param_top_p": float("nan")}, "'sampling_param_top_p' must be a finite number"),
        ({"text_input": "hi", "sampling_param_max_token": 8}, "unknown input 'sampling_param_max_token'; did you mean "
                                                              "'sampling_param_max_tokens'?"),
        ({"text_input": "hi", "vtoken_budget": 1.5}, "above 1 is a token count and must be whole"),
        ({"text_input": "hi", "vtoken_policy": "native", "vtoken_budget": 0.5}, "'native' evicts nothing"),
    ]
    for body, message in cases:
        status, answer = generate(triton_server, "tensorrt_llm", body)
        assert status == 400 and message in answer["error"], (body, answer)
    for body, message in [
        ({"text_input": "hi", "max_tokens": 2**40}, "'max_tokens' must lie in [1, 256], got 0 (over HTTP"),
        ({"text_input": "hi", "max_tokens": 4, "temperature": float("inf")}, "'temperature' must be a finite number"),
        ({"text_input": "hi", "max_tokens": 4, "colour": "blue"}, "unknown input 'colour'; the inputs are: text_input"),
    ]:
        status, answer = generate(triton_server, "ensemble", body)
        assert status == 400 and message in answer["error"], (body, answer)
    # What Triton's HTTP front end answers itself, before the model sees the request (README).
    for raw, message in [
        (b'{"text_input": "hi", ', "failed to parse the request JSON buffer"),
        (json.dumps({"text_input": "hi", "max_tokens": "4"}).encode(), "Unable to parse 'data'"),
    ]:
        request = urllib.request.Request(f"http://{triton_server.http_url}/v2/models/ensemble/generate", data=raw)
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=60)
        assert caught.value.code == 500 and message in json.loads(caught.value.read())["error"]

    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
    wrong_dtype = grpcclient.InferInput("sampling_param_max_tokens", [1], "FP32")
    wrong_dtype.set_data_from_numpy(np.array([4.0], dtype=np.float32))
    wrong_shape = grpcclient.InferInput("sampling_param_max_tokens", [2], "INT32")
    wrong_shape.set_data_from_numpy(np.array([4, 5], dtype=np.int32))
    misspelled = grpcclient.InferInput("sampling_param_max_token", [1], "INT32")
    misspelled.set_data_from_numpy(np.array([4], dtype=np.int32))
    for inputs, parameters, message in (
        ([text, wrong_dtype], None, "FP32"), ([text, wrong_shape], None, "[2]"),
        ([text, misspelled], None, "unexpected inference input 'sampling_param_max_token'"),  # Triton itself
        ([text], {"sampling_param_max_token": 4}, "unknown input 'sampling_param_max_token'; did you mean"),
    ):
        errors: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: errors.put(error))
        client.async_stream_infer("tensorrt_llm", inputs, parameters=parameters)
        error = errors.get(timeout=60)
        client.stop_stream()
        assert isinstance(error, InferenceServerException) and message in str(error), error
    assert client.is_server_live() and client.is_model_ready("tensorrt_llm")
    status, body = generate(triton_server, "ensemble", {"text_input": "hi", "max_tokens": 4})
    assert status == 200 and body["text_output"]


def test_a_request_brings_its_own_eviction_settings(triton_server, local_engine):
    from trtllm_vtoken.policies.request_settings import EvictionSettings

    def policy_requests(policy: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{triton_server.metrics_port}/metrics").read().decode()
        found = re.search(r'^vtoken_policy_requests\{[^}]*policy="' + policy + r'"[^}]*\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else 0.0

    before = policy_requests("streaming_llm")
    expected = run_local(local_engine, PROMPTS[1], 16, EvictionSettings("streaming_llm", 12, n_sink=4))
    assert local_engine[0].kv.stats.tokens_evicted_by_policy["streaming_llm"] > 0  # the settings bite
    status, body = generate(triton_server, "tensorrt_llm", {
        "text_input": PROMPTS[1], "sampling_param_max_tokens": 16, "vtoken_policy": "streaming_llm",
        "vtoken_budget": 12, "vtoken_sink_tokens": 4})
    assert status == 200 and body["text_output"] == expected.text
    assert policy_requests("streaming_llm") == before + 1


def test_metrics_agree_with_the_engines_own_counters(triton_server, local_engine):
    counters = ("vtoken_tokens_evicted", "vtoken_relocations", "vtoken_tokens_relocated", "vtoken_bytes_copied",
                "vtoken_blocks_reclaimed", "vtoken_requests_finished")
    engine, _ = local_engine
    local_before = _local_counters(engine)
    server_before = metrics(triton_server)
    for prompt in PROMPTS:  # one at a time: every counter is then independent of batching
        run_local(local_engine, prompt, 12)
        assert generate(triton_server, "ensemble", {"text_input": prompt, "max_tokens": 12})[0] == 200
    server_after, local_after = metrics(triton_server), _local_counters(engine)
    for name in counters:
        assert server_after[name] - server_before[name] == local_after[name] - local_before[name], name
    assert server_after["vtoken_tokens_evicted"] > server_before["vtoken_tokens_evicted"]
    assert server_after["vtoken_kv_blocks_retained"] == 0 and server_after["vtoken_kv_blocks_total"] == 256
    assert server_after["vtoken_requests_running"] == 0


def _local_counters(engine) -> dict[str, float]:
    from trtllm_vtoken.serving.metrics import snapshot

    return snapshot(engine)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("stream", [False, True])
def test_example_client(triton_server, protocol, stream):
    import subprocess
    import sys
    from pathlib import Path

    _, whole = generate(triton_server, "ensemble", {"text_input": PROMPTS[0], "max_tokens": 16})
    url = triton_server.grpc_url if protocol == "grpc" else triton_server.http_url
    command = [sys.executable, str(Path(__file__).parents[2] / "examples" / "client.py"), PROMPTS[0],
               "--protocol", protocol, "--url", url, "--max-tokens", "16"] + (["--stream"] if stream else [])
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == whole["text_output"] + "\n"


def test_vtoken_serve_banner_log_and_ctrl_c_with_clients_connected(tmp_path):
    """Ready banner = the address Triton listens on; no GPU complaints in the log on CPU; Ctrl-C
    with an idle keep-alive HTTP connection, an open gRPC stream and a request generating: exit 0
    within seconds, the running request told, every backend stub gone."""
    import http.client
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import tritonclient.grpc as grpcclient

    from trtllm_vtoken.serving.triton import free_ports
    from trtllm_vtoken.serving.triton_log import CPU_NOTE, has_cuda_driver

    http_port, grpc_port, metrics_port = free_ports(3)
    command = [sys.executable, "-m", "trtllm_vtoken.cli", "serve", "--host", "127.0.0.1", "--http-port", str(http_port),
               "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--workdir", str(tmp_path),
               "--policy", "streaming_llm", "--budget", "64", "--num-blocks", "32"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = process.stdout.readline()  # printed only once the server answers /v2/health/ready
        assert ready.startswith(f"ready: HTTP 127.0.0.1:{http_port}  gRPC 127.0.0.1:{grpc_port}"), process.stderr.read()
        log = (tmp_path / "tritonserver.log").read_text()
        assert f"Started HTTPService at 127.0.0.1:{http_port}" in log and f"at 127.0.0.1:{grpc_port}" in log
        if not has_cuda_driver():
            assert log.startswith(CPU_NOTE)
            assert not re.search(r"NVML|DCGM|CudaDriverHelper|CUDA driver version|pinned system memory", log)
        config = (tmp_path / "model_repository" / "tensorrt_llm" / "config.pbtxt").read_text()
        assert 'key: "policy", value: { string_value: "streaming_llm" }' in config

        keep_alive = http.client.HTTPConnection("127.0.0.1", http_port, timeout=120)  # as requests.Session
        keep_alive.request("POST", "/v2/models/ensemble/generate", json.dumps({"text_input": "hi", "max_tokens": 4}))
        assert json.loads(keep_alive.getresponse().read())["text_output"]
        idle_stream = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        idle_stream.start_stream(callback=lambda result, error: None)
        streaming = http.client.HTTPConnection("127.0.0.1", http_port, timeout=120)
        streaming.request("POST", "/v2/models/ensemble/generate_stream",
                          json.dumps({"text_input": PROMPTS[3], "max_tokens": 250, "stream": True}))
        events = streaming.getresponse()
        assert events.readline().startswith(b"data: ")
        stubs = _backend_stubs(tmp_path)
        assert len(stubs) == 2

        started = time.monotonic()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0, process.stderr.read()
        seconds = time.monotonic() - started
        print(f"\nvtoken serve stopped in {seconds:.1f} s (exit 0) with clients connected")
        assert seconds < 10
        assert b'"error":"server is shutting down"' in events.read()
        assert not _backend_stubs(tmp_path)
        assert not [region for region in stubs.values() if Path("/dev/shm", region).exists()]
        stderr = process.stderr.read()
        assert "vtoken serve: stopped in" in stderr
        print(stderr.strip().splitlines()[-1])
    finally:
        if process.poll() is None:  # vtoken serve stops its tritonserver on SIGINT
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def _backend_stubs(workdir) -> dict[int, str]:
    """Python-backend stub processes serving the repository under ``workdir``, with the shared
    memory region each one uses (its command line: stub, model.py, region, ...)."""
    import subprocess

    found = subprocess.run(["pgrep", "-af", f"triton_python_backend_stub {workdir}"], capture_output=True, text=True)
    return {int(line.split()[0]): line.split()[3] for line in found.stdout.splitlines()}


def test_vtoken_serve_help_explains_policy_and_budget():
    import subprocess
    import sys

    from trtllm_vtoken.policies import POLICIES

    result = subprocess.run([sys.executable, "-m", "trtllm_vtoken.cli", "serve", "--help"], capture_output=True,
                            text=True, timeout=60)
    text = " ".join(result.stdout.split())
    assert result.returncode == 0 and f"eviction policy, one of: {', '.join(POLICIES.names())}" in text
    assert "a number in (0, 1] is a retention ratio (0.5 keeps half" in text and "an integer is a token count" in text
    assert "--host" in text and "0.0.0.0" in text
