# SPDX-License-Identifier: Apache-2.0
"""Cancellation through the real Triton server: a client that leaves a stream (gRPC or HTTP, the
tensorrt_llm model or the ensemble) ends its request and frees its blocks; a non-streaming
/generate request, whose leaving client Triton does not report, is stopped by its id."""

from __future__ import annotations

import json
import queue
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.serving.test_triton_server import PROMPTS, generate, metrics

pytestmark = pytest.mark.slow


def wait_until_freed(server, timeout_s: float) -> float:
    """Seconds until no request runs and no KV block is held; fails after ``timeout_s``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        now = metrics(server)
        if now["vtoken_requests_running"] == 0 and now["vtoken_kv_blocks_retained"] == 0:
            return time.monotonic() - started
        time.sleep(0.05)
    pytest.fail(f"request still running {timeout_s} s after its client left: {now}")


def grpc_stream_then_leave(server, model: str) -> None:
    import tritonclient.grpc as grpcclient

    names = {"ensemble": ("text_input", "stream", "max_tokens"),
             "tensorrt_llm": ("text_input", "streaming", "sampling_param_max_tokens")}[model]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put(error))
    inputs = [grpcclient.InferInput(names[0], [1], "BYTES"), grpcclient.InferInput(names[1], [1], "BOOL"),
              grpcclient.InferInput(names[2], [1], "INT32")]
    inputs[0].set_data_from_numpy(np.array([PROMPTS[3].encode()], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([True]))
    inputs[2].set_data_from_numpy(np.array([250], dtype=np.int32))
    client.async_stream_infer(model, inputs)
    for _ in range(3):
        assert received.get(timeout=120) is None
    assert metrics(server)["vtoken_requests_running"] == 1
    client.stop_stream(cancel_requests=True)


def http_stream_then_leave(server, model: str) -> None:
    import socket

    body = ({"text_input": PROMPTS[3], "max_tokens": 250, "stream": True} if model == "ensemble" else
            {"text_input": PROMPTS[3], "sampling_param_max_tokens": 250, "streaming": True})
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=120) as connection:
        connection.sendall(f"POST /v2/models/{model}/generate_stream HTTP/1.1\r\nHost: x\r\n"
                           f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        received = b""
        while received.count(b"data: ") < 3:
            received += connection.recv(65536)
        assert metrics(server)["vtoken_requests_running"] == 1


@pytest.mark.parametrize("client", ["grpc stream", "http generate_stream"])
@pytest.mark.parametrize("model", ["tensorrt_llm", "ensemble"])
def test_a_client_that_goes_away_is_cancelled_and_its_blocks_freed(triton_server, client, model):
    """250 tokens take 15 s or more here; the request must end, blocks freed, within 5 s."""
    (grpc_stream_then_leave if client == "grpc stream" else http_stream_then_leave)(triton_server, model)
    seconds = wait_until_freed(triton_server, timeout_s=5.0)
    print(f"\n{model} {client}: blocks freed {seconds:.2f} s after the client left")


def wait_until_running(server) -> None:
    deadline = time.monotonic() + 60
    while metrics(server)["vtoken_requests_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("model,body", [
    ("tensorrt_llm", {"id": "job-7", "text_input": PROMPTS[3], "sampling_param_max_tokens": 250}),
    ("ensemble", {"id": "job-8", "text_input": PROMPTS[3], "max_tokens": 250}),  # its id reaches tensorrt_llm
])
def test_a_non_streaming_generate_is_stopped_by_its_id(triton_server, model, body):
    """Triton's HTTP front end does not notice a non-streaming /generate client leave (next
    test); such a request is ended by a second one with its id and stop: true."""
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate, triton_server, model, body)
        wait_until_running(triton_server)
        status, answer = generate(triton_server, "tensorrt_llm", {"id": body["id"], "text_input": "", "stop": True})
        assert status == 400 and answer["error"] == f"stopped 1 running request(s) with id '{body['id']}'"
        assert running.result(timeout=10) == (400, {"error": "request cancelled"})
    wait_until_freed(triton_server, timeout_s=5.0)
    status, answer = generate(triton_server, "tensorrt_llm", {"text_input": "", "stop": True})
    assert status == 400 and "needs the request id" in answer["error"]


def test_a_non_streaming_generate_client_that_leaves_is_not_seen_by_the_model(triton_server):
    """What the README says: Triton's HTTP front end stops reading a connection while its
    non-streaming request runs, so the request runs on (cancelled ones end within 0.2 s)."""
    import socket

    data = json.dumps({"text_input": PROMPTS[3], "sampling_param_max_tokens": 64}).encode()
    with socket.create_connection(("127.0.0.1", triton_server.http_port), timeout=120) as connection:
        connection.sendall(f"POST /v2/models/tensorrt_llm/generate HTTP/1.1\r\nHost: x\r\n"
                           f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        wait_until_running(triton_server)
    time.sleep(1.0)
    assert metrics(triton_server)["vtoken_requests_running"] == 1
    wait_until_freed(triton_server, timeout_s=120.0)
