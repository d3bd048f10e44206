# SPDX-License-Identifier: Apache-2.0
"""``vtoken serve``: the real tritonserver on triton_model_repo, with vToken settings applied."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from trtllm_vtoken.policies import POLICIES
from trtllm_vtoken.runtime.config import VARIANTS


def register(sub) -> None:
    parser = sub.add_parser(
        "serve", help="serve the model through Triton Inference Server",
        description="Starts tritonserver on a copy of triton_model_repo whose tensorrt_llm model "
                    "parameters carry the options below; waits for readiness; Ctrl-C unloads the "
                    "models (requests still running are ended) and stops the server, whatever "
                    "clients are connected.",
    )
    parser.add_argument("--repository", default=None, help="model repository (default: triton_model_repo)")
    parser.add_argument("--host", default="0.0.0.0",
                        help="address the HTTP, gRPC and metrics endpoints bind to (default 0.0.0.0: every "
                             "interface, as Triton's default; 127.0.0.1: this machine only)")
    parser.add_argument("--http-port", type=int, default=8000, help="HTTP/REST port, also /generate (default 8000)")
    parser.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001)")
    parser.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics port (default 8002)")
    parser.add_argument("--workdir", default=None,
                        help="scratch folder for the repository copy and tritonserver.log (default: a temporary one)")
    parser.add_argument("--verbose", action="store_true", help="tritonserver --log-verbose 1")
    g = parser.add_argument_group("model parameters (override the repository's)")
    g.add_argument("--model", help="Hugging Face Llama folder, or smollm2-135m-instruct (the default)")
    g.add_argument("--variant", choices=VARIANTS,
                   help="native: full KV retention; naive-evict: evicted tokens masked in place; vtoken: "
                        "evicted slots reclaimed by relocation")
    g.add_argument("--mode", choices=["dense", "lazy"],
                   help="vtoken compaction: dense every step, or lazy (masked holes, compacted on demand)")
    g.add_argument("--policy", choices=POLICIES.names(), metavar="POLICY",
                   help=f"eviction policy, one of: {', '.join(POLICIES.names())}")
    g.add_argument("--budget",
                   help="live tokens kept per request: a number in (0, 1] is a retention ratio (0.5 keeps "
                        "half of each request's tokens), an integer is a token count (256 keeps 256)")
    g.add_argument("--tokens-per-block", type=int, help="tokens in one KV block")
    g.add_argument("--num-blocks", type=int, help="KV block budget: blocks in the pool, shared by all requests")
    g.add_argument("--max-batch-size", type=int, help="requests running at once, at most")
    g.add_argument("--max-seq-len", type=int, help="prompt plus output tokens of one request, at most")
    g.add_argument("--max-tokens-limit", type=int, help="the largest max_tokens a request may ask for")
    g.add_argument("--device", help="torch device of the reference engine: cpu or cuda")
    g.add_argument("--threads", type=int,
                   help="intra-op CPU threads of the reference engine (0 or unset: the cores the model's "
                        "process may use but one)")
    g.add_argument("--batch-invariant", action="store_true", default=None,
                   help="reference engine on the CPU: bitwise the same logits and decisions for a request alone and "
                        "in any batch (slower; EngineConfig.batch_invariant)")
    g.add_argument("--backend", choices=["auto", "reference", "trtllm"],
                   help="reference engine, TensorRT-LLM with vToken's hooks, or auto (trtllm where it runs)")
    parser.set_defaults(func=run)


OVERRIDES = ("model", "variant", "mode", "policy", "budget", "tokens_per_block", "num_blocks",
             "max_batch_size", "max_seq_len", "max_tokens_limit", "device", "threads", "batch_invariant", "backend")


def run(args: argparse.Namespace) -> int:
    from trtllm_vtoken.serving.settings import ServingSettings
    from trtllm_vtoken.serving.triton import MODEL, default_repository, prepare_repository, repository_parameters

    source = Path(args.repository) if args.repository else default_repository()
    if not (source / MODEL / "config.pbtxt").is_file():
        raise ValueError(f"{source} is not a model repository (no {MODEL}/config.pbtxt)")
    overrides = {k: str(getattr(args, k)) for k in OVERRIDES if getattr(args, k) is not None}
    scratch = args.workdir is None  # a temporary folder of ours: removed unless the server failed
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="vtoken-serve-"))
    try:
        repository = prepare_repository(source, workdir / "model_repository", overrides)
        ServingSettings.from_parameters(repository_parameters(repository)).check_host()
    except BaseException:
        if scratch:
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    code = 1  # an error escaping: the folder is kept with the server's log
    try:
        code = _serve(args, repository, workdir)
    except KeyboardInterrupt:
        code = 0  # interrupted while starting: the server was stopped, nothing to keep
        raise
    finally:
        if scratch and code == 0:
            shutil.rmtree(workdir, ignore_errors=True)
    return code


def _serve(args: argparse.Namespace, repository: Path, workdir: Path) -> int:
    from trtllm_vtoken.serving.triton import TritonServer

    server = TritonServer(repository, workdir, args.http_port, args.grpc_port, args.metrics_port,
                          verbose=args.verbose, host=args.host)
    print(f"vtoken serve: starting tritonserver (log: {server.log_file})", file=sys.stderr)
    stop = threading.Event()
    try:
        try:
            server.start()  # Ctrl-C here: KeyboardInterrupt, and the server is stopped below
        except RuntimeError as error:  # it exited, or never got ready: the log says why
            server.stop()
            reason = server.last_error() or str(error).splitlines()[0]
            print(f"vtoken: error: tritonserver did not start: {reason} (log: {server.log_file})", file=sys.stderr)
            return 1
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        where = " (every interface)" if server.client_host != args.host else ""
        print(f"ready: HTTP {args.host}:{args.http_port}  gRPC {args.host}:{args.grpc_port}  metrics "
              f"{args.host}:{args.metrics_port}/metrics{where}\n"
              f"  curl -X POST {server.http_url}/v2/models/ensemble/generate "
              "-d '{\"text_input\": \"What is a KV cache?\", \"max_tokens\": 64}'", flush=True)
        while not stop.wait(1.0):
            if server.process.poll() is not None:
                print(f"vtoken: error: tritonserver exited with {server.process.returncode}: "
                      f"{server.last_error() or 'see ' + str(server.log_file)}", file=sys.stderr)
                return 1
    except BaseException:
        server.stop()  # never leave a tritonserver behind (it runs in its own session)
        raise
    print("vtoken serve: stopping", file=sys.stderr)
    started = time.monotonic()
    code = server.stop()
    if server.stop_problem is not None:
        print(f"vtoken: error: {server.stop_problem} (log: {server.log_file})", file=sys.stderr)
        return 1
    note = f" ({server.stop_note})" if server.stop_note else ""
    print(f"vtoken serve: stopped in {time.monotonic() - started:.1f} s{note}", file=sys.stderr)
    return 0 if code == 0 or server.stop_note else 1
