# SPDX-License-Identifier: Apache-2.0
"""What runs inside one rank's process: join the group, load and shard the model, then run jobs.

A job is a whole batch of requests under one engine config. Every rank builds its own engine over
its shard, adds the same requests in the same order and steps until all are done; the
all-reduces inside the forward keep the ranks in lockstep. Rank 0 streams each step's outputs to
the caller if asked; every rank ends a job with a ``RankReport``.
"""

from __future__ import annotations

import faulthandler
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trtllm_vtoken.consistency import ProtocolStats, RankDivergenceError, step_digest
from trtllm_vtoken.runtime.config import EngineConfig
from trtllm_vtoken.runtime.outputs import RequestOutput, finished_output
from trtllm_vtoken.runtime.sampling import SamplingParams
from trtllm_vtoken.threads import set_threads


@dataclass(frozen=True)
class Job:
    config: EngineConfig
    prompts: list[list[int]]
    """Token ids of each request, added in this order (request ids 0, 1, ... on every rank)."""
    params: SamplingParams | list[SamplingParams]
    """One for every prompt, or one per prompt."""
    stream: bool = False
    """Rank 0 sends each step's outputs as they come."""
    trace: bool = False
    """Record per step the eviction decisions and the token-table digest (tests, benchmarks)."""
    timings: bool = False
    """Record the duration of every mass reduction (``ProtocolStats.durations``)."""
    logits: bool = False
    """With ``trace``: also return the logits behind every output token (large)."""


@dataclass
class RankReport:
    """What one rank did in one job."""

    rank: int
    outputs: dict[int, list[int]] = field(default_factory=dict)
    """Request id -> output token ids."""
    results: dict[int, RequestOutput] = field(default_factory=dict)
    """Request id -> its output as ``LLM.generate`` returns it (``prompt`` None, set by the caller)."""
    evictions: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)
    """Request id -> the logical ids evicted after each output token (``trace``)."""
    logits: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    digests: list[int] = field(default_factory=list)
    """``step_digest`` of the token table and free-block count after each step (``trace``)."""
    step_seconds: list[float] = field(default_factory=list)
    decode_tokens: int = 0
    peak_blocks_used: int = 0
    tokens_evicted: int = 0
    blocks_freed: int = 0
    protocol: ProtocolStats = field(default_factory=ProtocolStats)
    all_reduces: int = 0
    all_reduce_seconds: float = 0.0
    """Every all-reduce of the job on this rank: the model's (two per layer and forward) and the
    protocol's."""
    error: BaseException | None = None
    """The job's failure on this rank (the report then holds what happened before it)."""


def rank_main(rank: int, world_size: int, init_method: str, model_path: str, device: str, threads: int | None,
              conn: Any) -> None:
    """The entry point of a rank's process (``torch.multiprocessing``, spawn). It leaves silently
    when told to close or when the caller's process is gone (its pipe closed)."""
    faulthandler.enable()  # a fatal signal (a crash in native code) still prints this rank's stack
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle: it stops the ranks
    try:
        # Ranks share the machine's cores: each takes its share (trtllm_vtoken/threads.py).
        set_threads(threads, processes=world_size)
        from trtllm_vtoken.runtime.model import load_llama
        from trtllm_vtoken.runtime.parallel.layers import shard_model
        from trtllm_vtoken.runtime.parallel.torch_ranks import init_rank
        from trtllm_vtoken.runtime.tokenizer import Tokenizer

        ranks = init_rank(rank, world_size, init_method, device)
        model = shard_model(load_llama(Path(model_path)), rank, ranks)
        # Every rank needs the tokenizer: stop strings decide when a request ends.
        tokenizer = Tokenizer(Path(model_path))
        conn.send(("ready", rank))
    except BaseException:  # noqa: BLE001 - the caller gets the traceback instead of a silent exit
        conn.send(("failed", rank, traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the caller's process ended without closing us
            return
        if message[0] == "close":
            break
        if message[0] == "call":  # a function of (ranks, *args), run on every rank at once
            try:
                conn.send(("result", message[1](ranks, *message[2])))
            except Exception:  # noqa: BLE001
                conn.send(("result", RuntimeError(f"rank {rank}: {traceback.format_exc()}")))
            continue
        report = run_job(message[1], model, tokenizer, ranks, conn if rank == 0 else None)
        conn.send(("report", report))
    torch.distributed.destroy_process_group()


def run_job(job: Job, model, tokenizer, ranks, conn) -> RankReport:
    """Runs one job on this rank; failures are returned in the report, never raised (the
    process must stay up to tell its caller)."""
    from trtllm_vtoken.runtime.engine import Engine

    report = RankReport(ranks.rank)
    engine = None
    calls, seconds = getattr(ranks, "all_reduces", 0), getattr(ranks, "all_reduce_seconds", 0.0)
    try:
        config = job.config
        if config.device.startswith("cuda"):
            config = EngineConfig.from_dict({**vars(config), "device": f"cuda:{ranks.rank}"})
        engine = Engine(model, config, tokenizer, record_trace=job.trace, ranks=ranks)
        if job.timings:
            engine.consistency.stats.durations = []
        per_prompt = job.params if isinstance(job.params, list) else [job.params] * len(job.prompts)
        for prompt, params in zip(job.prompts, per_prompt):
            engine.add_request(prompt, params)
        while engine.has_unfinished():
            start = time.perf_counter()
            outputs = engine.step()
            report.step_seconds.append(time.perf_counter() - start)
            if job.trace:
                report.digests.append(step_digest(engine.kv.layout, [engine.kv.pool.num_free]))
            if conn is not None and job.stream:
                conn.send(("step", outputs))
    except RankDivergenceError as error:  # raised on every rank in the same step
        report.error = error
    except Exception:  # noqa: BLE001 - the traceback travels as text (any exception pickles)
        report.error = RuntimeError(f"rank {ranks.rank}: {traceback.format_exc()}")
    report.all_reduces = getattr(ranks, "all_reduces", 0) - calls
    report.all_reduce_seconds = getattr(ranks, "all_reduce_seconds", 0.0) - seconds
    if engine is not None:
        summarize(engine, job, report)
    return report


def summarize(engine, job: Job, report: RankReport) -> None:
    for req_id, request in engine.requests.items():
        report.outputs[req_id] = list(request.output_ids)
        report.results[req_id] = finished_output(request, None)
        if job.trace:
            report.evictions[req_id] = list(request.evictions)
            if job.logits:
                report.logits[req_id] = [t.clone() for t in request.logits]
    kv = engine.kv
    report.decode_tokens = engine.stats.decode_tokens
    report.peak_blocks_used = kv.stats.peak_blocks_used
    report.tokens_evicted = kv.step_stats.tokens_evicted
    report.blocks_freed = kv.step_stats.blocks_freed
    report.protocol = engine.consistency.stats
