#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Talk to `vtoken serve` with tritonclient: gRPC (optionally streaming) or HTTP.

    python examples/client.py "What is a KV cache?"                       # gRPC, one answer
    python examples/client.py "What is a KV cache?" --stream              # gRPC, pieces as they come
    python examples/client.py "What is a KV cache?" --protocol http       # HTTP generate endpoint
    python examples/client.py "What is a KV cache?" --protocol http --stream

The `tensorrt_llm` model is decoupled (it may answer a request with several responses), so gRPC
uses the bidirectional stream and HTTP uses Triton's /generate and /generate_stream endpoints;
tritonclient.http checks the server and model first.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import urllib.request

import numpy as np


def grpc_generate(url: str, prompt: str, max_tokens: int, stream: bool) -> str:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES"),
              grpcclient.InferInput("sampling_param_max_tokens", [1], "INT32"),
              grpcclient.InferInput("streaming", [1], "BOOL")]
    inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
    inputs[2].set_data_from_numpy(np.array([stream]))
    client.async_stream_infer("tensorrt_llm", inputs, enable_empty_final_response=True)
    text = []
    try:
        while True:
            result, error = responses.get()
            if error is not None:
                raise RuntimeError(str(error))
            piece = result.as_numpy("text_output")
            if piece is not None:
                text.append(piece[0].decode())
                if stream:
                    print(text[-1], end="", flush=True)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
    return "".join(text)


def http_generate(url: str, prompt: str, max_tokens: int, stream: bool) -> str:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url)
    if not (client.is_server_ready() and client.is_model_ready("ensemble")):
        raise RuntimeError(f"server at {url} is not ready")
    body = json.dumps({"text_input": prompt, "max_tokens": max_tokens, "stream": stream}).encode()
    endpoint = f"http://{url}/v2/models/ensemble/generate" + ("_stream" if stream else "")
    with urllib.request.urlopen(urllib.request.Request(endpoint, data=body)) as response:
        if not stream:
            return json.loads(response.read())["text_output"]
        text = []
        for line in response:  # server-sent events: "data: {...}"
            if line.startswith(b"data: "):
                text.append(json.loads(line[6:])["text_output"])
                print(text[-1], end="", flush=True)
        return "".join(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    parser.add_argument("--url", help="host:port (default localhost:8001 for gRPC, localhost:8000 for HTTP)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    url = args.url or ("localhost:8001" if args.protocol == "grpc" else "localhost:8000")
    run = grpc_generate if args.protocol == "grpc" else http_generate
    try:
        text = run(url, args.prompt, args.max_tokens, args.stream)
    except Exception as error:  # one clear line for a command-line user
        print(f"client: error: {error}", file=sys.stderr)
        return 1
    print() if args.stream else print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
