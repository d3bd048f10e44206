# SPDX-License-Identifier: Apache-2.0
"""``vtoken serve``: the real tritonserver on triton_model_repo, with vToken settings applied."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

from trtllm_vtoken.runtime.config import VARIANTS


def register(sub) -> None:
    parser = sub.add_parser(
        "serve", help="serve the model through Triton Inference Server",
        description="Starts tritonserver on a copy of triton_model_repo whose tensorrt_llm model "
                    "parameters carry the options below; waits for readiness; Ctrl-C stops it cleanly.",
    )
    parser.add_argument("--repository", default=None, help="model repository (default: triton_model_repo)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--verbose", action="store_true", help="tritonserver --log-verbose 1")
    g = parser.add_argument_group("model parameters (override the repository's)")
    g.add_argument("--model", help="Hugging Face Llama folder or smollm2-135m-instruct")
    g.add_argument("--variant", choices=VARIANTS)
    g.add_argument("--mode", choices=["dense", "lazy"])
    g.add_argument("--policy")
    g.add_argument("--budget")
    g.add_argument("--tokens-per-block", type=int)
    g.add_argument("--num-blocks", type=int, help="KV block budget")
    g.add_argument("--max-batch-size", type=int)
    g.add_argument("--max-seq-len", type=int)
    g.add_argument("--max-tokens-limit", type=int)
    g.add_argument("--device")
    g.add_argument("--backend", choices=["auto", "reference", "trtllm"],
                   help="reference engine, TensorRT-LLM with vToken's hooks, or auto (trtllm where it runs)")
    parser.set_defaults(func=run)


OVERRIDES = ("model", "variant", "mode", "policy", "budget", "tokens_per_block", "num_blocks",
             "max_batch_size", "max_seq_len", "max_tokens_limit", "device", "backend")


def run(args: argparse.Namespace) -> int:
    from trtllm_vtoken.serving.triton import TritonServer, default_repository, prepare_repository

    source = Path(args.repository) if args.repository else default_repository()
    overrides = {k: str(getattr(args, k)) for k in OVERRIDES if getattr(args, k) is not None}
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="vtoken-serve-"))
    repository = prepare_repository(source, workdir / "model_repository", overrides)
    server = TritonServer(repository, workdir, args.http_port, args.grpc_port, args.metrics_port,
                          verbose=args.verbose)
    print(f"vtoken serve: starting tritonserver (log: {server.log_file})", file=sys.stderr)
    server.start()
    print(f"ready: HTTP {server.http_url}  gRPC {server.grpc_url}  metrics "
          f"127.0.0.1:{args.metrics_port}/metrics\n"
          f"  curl -X POST {server.http_url}/v2/models/ensemble/generate "
          "-d '{\"text_input\": \"What is a KV cache?\", \"max_tokens\": 64}'", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        if server.process.poll() is not None:
            print(f"vtoken: error: tritonserver exited with {server.process.returncode}:\n"
                  f"{server.log_tail()}", file=sys.stderr)
            return 1
    print("vtoken serve: stopping", file=sys.stderr)
    code = server.stop()
    return 0 if code in (0, None) else 1
