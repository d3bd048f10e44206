# SPDX-License-Identifier: Apache-2.0
"""``vtoken bench serve``: what Triton costs on top of the engine, at several concurrencies.

For each concurrency C, C closed-loop clients send the same ShareGPT prompts, first to the engine
in this process (``EngineLoop``, the object the Triton model wraps), then through the real
tritonserver's generate endpoint. Both paths run the same engine settings and produce the same
greedy tokens; the difference in throughput and latency is the serving overhead.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ServeBenchConfig:
    concurrency: tuple[int, ...] = (1, 8, 32)
    requests_per_client: int = 2
    max_tokens: int = 32
    max_prompt_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) <= 0 or self.requests_per_client <= 0:
            raise ValueError("concurrency levels and requests_per_client must be positive")


def closed_loop(send: Callable[[str], int], prompts: list[str], clients: int, per_client: int) -> dict[str, Any]:
    """``clients`` threads each send ``per_client`` prompts back to back; ``send`` returns the
    number of output tokens. Returns throughput and latency percentiles."""
    latencies: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        for k in range(per_client):
            prompt = prompts[(c * per_client + k) % len(prompts)]
            start = time.perf_counter()
            n = send(prompt)
            with lock:
                latencies.append(time.perf_counter() - start)
                tokens[0] += n

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    wall = time.perf_counter() - start
    lat = np.array(latencies)
    return {"requests": len(lat), "output_tokens": tokens[0], "wall_s": wall, "tokens_per_s": tokens[0] / wall,
            "latency_p50_s": float(np.percentile(lat, 50)), "latency_p95_s": float(np.percentile(lat, 95))}


def run_serve_bench(cfg: ServeBenchConfig, settings, server, progress=None) -> dict[str, Any]:
    """``settings``: the ServingSettings the server runs; ``server``: a started TritonServer."""
    from trtllm_vtoken.runtime.checkpoint import resolve_model
    from trtllm_vtoken.runtime.engine import Engine
    from trtllm_vtoken.runtime.model import load_llama
    from trtllm_vtoken.runtime.sampling import SamplingParams
    from trtllm_vtoken.runtime.tokenizer import Tokenizer
    from trtllm_vtoken.serving.engine_loop import CollectingSink, EngineLoop
    from trtllm_vtoken.workloads import make_workload

    folder = resolve_model(settings.model)
    tokenizer = Tokenizer(folder)
    loop = EngineLoop(Engine(load_llama(folder), settings.engine, tokenizer)).start()
    n = max(cfg.concurrency) * cfg.requests_per_client
    prompts = [item.prompt for item in make_workload("sharegpt", n, tokenizer, seed=cfg.seed,
                                                      max_prompt_tokens=cfg.max_prompt_tokens)]
    params = SamplingParams(max_tokens=cfg.max_tokens)

    def direct(prompt: str) -> int:
        sink = CollectingSink()
        loop.submit(tokenizer.encode(prompt, chat=settings.chat_template), params, sink)
        sink.done.wait()
        if sink.error:
            raise RuntimeError(sink.error)
        return count(sink.text)

    def triton(prompt: str) -> int:
        body = json.dumps({"text_input": prompt, "sampling_param_max_tokens": cfg.max_tokens}).encode()
        url = f"http://{server.http_url}/v2/models/tensorrt_llm/generate"
        with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=600) as response:
            return count(json.loads(response.read())["text_output"])

    def count(text: str) -> int:  # both paths count output tokens the same way
        return len(tokenizer.encode(text)) if text else 0

    rows = []
    try:
        for clients in cfg.concurrency:
            row = {"concurrency": clients}
            for name, send in (("direct", direct), ("triton", triton)):
                row[name] = closed_loop(send, prompts, clients, cfg.requests_per_client)
                if progress is not None:
                    progress.update(1)
            row["triton_overhead"] = 1.0 - row["triton"]["tokens_per_s"] / row["direct"]["tokens_per_s"]
            rows.append(row)
    finally:
        loop.stop()
    return {"config": asdict(cfg), "rows": rows}
