# SPDX-License-Identifier: Apache-2.0
"""One process per tensor-parallel rank, driven from the caller's process.

    caller's process (LLM, `vtoken generate --tp`)       rank processes (torch.multiprocessing)
    RankProcesses(model, N)  ---- start N --------------> join the group (gloo / NCCL), load the
                                                          model, keep this rank's shard
    run(job)                 ---- the same job to all --> every rank: Engine(shard, config),
                                                          same requests, steps in lockstep
                             <--- rank 0: each step's outputs (stream=True)
                             <--- every rank: RankReport

The caller's process joins no process group and holds no model: it only sends jobs and reads
reports, so it may start several groups, and a failed rank never takes it down.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from trtllm_vtoken.consistency import RankDivergenceError
from trtllm_vtoken.runtime.parallel.rank_process import Job, RankReport, rank_main
from trtllm_vtoken.runtime.request import RequestOutput

START_TIMEOUT_S = 600.0
"""Loading and sharding the model on a busy 2-core machine takes a while."""


class RankProcesses:
    """N rank processes serving jobs on one model.

    Args:
        model_path: a Hugging Face Llama folder (config.json, safetensors, tokenizer).
        world_size: tensor_parallel_size; at most the model's KV heads.
        device: "cpu" (gloo) or "cuda" (NCCL, rank r on cuda:r).
    Raises RuntimeError, with the rank's traceback, if a rank fails to start.
    """

    def __init__(self, model_path: str | Path, world_size: int, device: str = "cpu") -> None:
        if world_size < 2:
            raise ValueError(f"RankProcesses needs at least 2 ranks, got {world_size}")
        self.world_size = world_size
        self._rendezvous = tempfile.TemporaryDirectory(prefix="vtoken-ranks-")
        init_method = f"file://{self._rendezvous.name}/store"
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(rank, world_size, init_method, str(model_path), device, child),
                               daemon=True, name=f"vtoken-rank-{rank}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        for rank, conn in enumerate(self._conns):
            if not conn.poll(START_TIMEOUT_S):
                self.close()
                raise RuntimeError(f"rank {rank} did not start within {START_TIMEOUT_S:.0f} s")
            try:
                message = conn.recv()
            except EOFError:
                message = ("failed", rank, f"the process exited with code {self._procs[rank].exitcode}")
            if message[0] != "ready":
                self.close()
                raise RuntimeError(f"rank {rank} failed to start:\n{message[2]}")

    def run(self, job: Job, on_step: Callable[[list[RequestOutput]], None] | None = None) -> list[RankReport]:
        """Runs ``job`` on every rank; returns their reports in rank order. ``on_step`` receives
        rank 0's outputs of each step (the job must have ``stream=True``).

        Raises RankDivergenceError if the ranks' tables diverged (the group stays usable), or
        RuntimeError for any other failure on a rank (the group is closed: a rank that failed
        alone may have left the others inside a collective)."""
        for kind, item in self.events(job):
            if kind == "step" and on_step is not None:
                on_step(item)
            elif kind == "done":
                return item
        raise RuntimeError("the ranks ended the job without reports")

    def events(self, job: Job) -> Iterator[tuple[str, Any]]:
        """Runs ``job``: yields ("step", rank 0's outputs of a step) while it runs (``job.stream``),
        then ("done", every rank's report). Errors as ``run``. Iterate to the end: the ranks run
        the whole job whatever the caller does with it."""
        if not self._procs:
            raise RuntimeError("the rank processes are closed")
        for conn in self._conns:
            conn.send(("job", job))
        reports: list[RankReport | None] = [None] * self.world_size
        pending = dict(enumerate(self._conns))
        while pending:
            for conn in wait(list(pending.values())):
                rank = self._conns.index(conn)
                try:
                    message = conn.recv()
                except EOFError:
                    self.close()
                    raise RuntimeError(f"rank {rank} exited during a job") from None
                if message[0] == "step":
                    yield "step", message[1]
                else:
                    reports[rank] = message[1]
                    del pending[rank]
        errors = [r.error for r in reports if r.error is not None]
        if errors:
            if all(isinstance(e, RankDivergenceError) for e in errors) and len(errors) == self.world_size:
                errors[0].reports = reports  # what each rank did up to the divergence
                raise errors[0]
            self.close()
            raise RuntimeError("; ".join(str(e) for e in errors))
        yield "done", reports

    def call(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Runs ``fn(ranks, *args)`` on every rank at once (``fn`` importable by name, its
        ``ranks`` the rank's ``TorchDistributedRanks``); returns the results in rank order.
        RuntimeError (the group closed) if any rank raised."""
        if not self._procs:
            raise RuntimeError("the rank processes are closed")
        for conn in self._conns:
            conn.send(("call", fn, args))
        results = []
        for rank, conn in enumerate(self._conns):
            try:
                results.append(conn.recv()[1])
            except EOFError:
                results.append(RuntimeError(f"rank {rank} exited during a call"))
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.close()
            raise RuntimeError("; ".join(str(e) for e in errors))
        return results

    def close(self) -> None:
        """Stops the rank processes (idempotent)."""
        for conn, proc in zip(self._conns, self._procs):
            try:
                if proc.is_alive():
                    conn.send(("close",))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._conns = [], []
        self._rendezvous.cleanup()

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
