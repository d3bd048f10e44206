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

Lifecycle: the ranks start only from code that spawn will not re-run (``main_guard.py``); they
stop on ``close()``, at the end of a ``with`` block, or when the interpreter exits (atexit), and
leave silently. A rank that fails (an exception, or its process dying) ends the call: the others
are stopped at once, since they may wait in a collective the failed rank never joins, and the
RuntimeError carries the failed rank's own traceback (or its exit code).
"""

from __future__ import annotations

import atexit
import signal
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, NoReturn

import torch.multiprocessing as mp

from trtllm_vtoken.consistency import RankDivergenceError
from trtllm_vtoken.runtime.parallel.main_guard import check_main_guard
from trtllm_vtoken.runtime.parallel.rank_process import Job, RankReport, rank_main
from trtllm_vtoken.runtime.request import RequestDelta

START_TIMEOUT_S = 600.0
"""Loading and sharding the model on a busy 2-core machine takes a while."""
FAILURE_GRACE_S = 1.0
"""After a rank fails, how long the others may take to report what they saw (a rank whose peer
died fails its collective right after) before every rank is stopped."""

Failure = Callable[[tuple], "BaseException | None"]


class RankProcesses:
    """N rank processes serving jobs on one model.

    Args:
        model_path: a Hugging Face Llama folder (config.json, safetensors, tokenizer).
        world_size: tensor_parallel_size; at most the model's KV heads.
        device: "cpu" (gloo) or "cuda" (NCCL, rank r on cuda:r).
        threads: intra-op CPU threads of each rank; None: the usable cores but one, split over
            the ranks (``trtllm_vtoken/threads.py``).
    Raises RuntimeError before starting anything if the caller's script would start the ranks
    again in every rank (``main_guard.py``), and RuntimeError, with the rank's traceback, if a
    rank fails to start.
    """

    def __init__(self, model_path: str | Path, world_size: int, device: str = "cpu",
                 threads: int | None = None) -> None:
        if world_size < 2:
            raise ValueError(f"RankProcesses needs at least 2 ranks, got {world_size}")
        check_main_guard()
        self.world_size = world_size
        self._rendezvous = tempfile.TemporaryDirectory(prefix="vtoken-ranks-")
        init_method = f"file://{self._rendezvous.name}/store"
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        atexit.register(_close_at_exit, weakref.ref(self))  # runs before multiprocessing's own
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, daemon=True, name=f"vtoken-rank-{rank}",
                               args=(rank, world_size, init_method, str(model_path), device, threads, child))
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        for rank, conn in enumerate(self._conns):
            if not conn.poll(START_TIMEOUT_S):
                self.close(graceful=False)
                raise RuntimeError(f"rank {rank} did not start within {START_TIMEOUT_S:.0f} s")
            try:
                message = conn.recv()
            except EOFError:
                message = ("failed", rank, self._exited(rank, "before it started"))
            if message[0] != "ready":
                self.close(graceful=False)
                raise RuntimeError(f"rank {rank} failed to start:\n{message[2]}")

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids, in rank order (empty once closed)."""
        return [proc.pid for proc in self._procs]

    def run(self, job: Job, on_step: Callable[[list[RequestDelta]], None] | None = None) -> list[RankReport]:
        """Runs ``job`` on every rank; returns their reports in rank order. ``on_step`` receives
        rank 0's outputs of each step (the job must have ``stream=True``).

        Raises RankDivergenceError if the ranks' tables diverged (the group stays usable), or
        RuntimeError for any other failure on a rank (the group is closed)."""
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
        self._send(("job", job))
        reports: list[RankReport | None] = [None] * self.world_size
        for rank, message in self._collect("during a job", _report_failure):
            if message[0] == "step":
                yield "step", message[1]
            else:
                reports[rank] = message[1]
        errors = [r.error for r in reports if r.error is not None]
        if errors:  # every rank raises a divergence, in the same step: the group is intact
            errors[0].reports = reports  # what each rank did up to the divergence
            raise errors[0]
        yield "done", reports

    def call(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Runs ``fn(ranks, *args)`` on every rank at once (``fn`` importable by name, its
        ``ranks`` the rank's ``TorchDistributedRanks``); returns the results in rank order.
        RuntimeError (the group closed) if any rank raised."""
        self._send(("call", fn, args))
        results: list[Any] = [None] * self.world_size
        for rank, message in self._collect("during a call", _call_failure):
            results[rank] = message[1]
        return results

    def close(self, graceful: bool = True) -> None:
        """Stops the rank processes (idempotent). ``graceful``: ask them to leave and wait for them;
        otherwise (after a failure, with ranks perhaps stuck in a collective) terminate them."""
        for conn, proc in zip(self._conns, self._procs):
            try:
                if graceful and proc.is_alive():
                    conn.send(("close",))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            if not graceful and proc.is_alive():
                proc.terminate()
            proc.join(timeout=10 if graceful else 2)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        self._rendezvous.cleanup()

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- failures --------------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        if not self._procs:
            raise RuntimeError("the rank processes are closed")
        for conn in self._conns:
            conn.send(message)

    def _collect(self, during: str, failure: Failure) -> Iterator[tuple[int, tuple]]:
        """Yields (rank, message) as the ranks send them, until each has sent its last one (any but
        "step"). The first failure, a rank exiting or ``failure(message)`` naming an error, stops
        every rank and raises RuntimeError."""
        pending = dict(enumerate(self._conns))
        while pending:
            for conn in wait(list(pending.values())):
                rank = self._conns.index(conn)
                try:
                    message = conn.recv()
                except EOFError:
                    del pending[rank]
                    self._abort({rank: self._exited(rank, during)}, pending, failure, during)
                if message[0] != "step":
                    del pending[rank]
                    error = failure(message)
                    if error is not None:
                        self._abort({rank: str(error)}, pending, failure, during)
                yield rank, message

    def _abort(self, failures: dict[int, str], pending: dict, failure: Failure, during: str) -> NoReturn:
        """Collects for a moment what the other ranks still report, stops every rank, raises. A
        rank found exited here is reported as one found first would be: its peers' errors (a
        collective's reset connection) often reach the pipes before its exit does."""
        deadline = time.monotonic() + FAILURE_GRACE_S
        while pending and time.monotonic() < deadline:
            for conn in wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic())):
                rank = self._conns.index(conn)
                try:
                    message = conn.recv()
                except EOFError:
                    del pending[rank]
                    failures[rank] = self._exited(rank, during)
                    continue
                if message[0] != "step":
                    del pending[rank]
                    error = failure(message)
                    if error is not None:
                        failures[rank] = str(error)
        died = [r for r in failures if failures[r].startswith(f"rank {r} exited")]
        first = min(died) if died else next(iter(failures))  # a death explains its peers' errors
        others = "; ".join(f"rank {r} then: {text.strip().splitlines()[-1]}" for r, text in failures.items()
                           if r != first)
        self.close(graceful=False)
        raise RuntimeError(f"{failures[first]}\n(the other ranks were stopped{'; ' + others if others else ''})")

    def _exited(self, rank: int, during: str) -> str:
        proc = self._procs[rank]
        proc.join(timeout=5)  # its pipe closed: it is exiting
        code = proc.exitcode
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"code {code}"
        return f"rank {rank} exited with {how}{' ' + during if during else ''}"


def _report_failure(message: tuple) -> BaseException | None:
    """A job's failure on a rank, but a divergence: every rank raises that one in the same step."""
    error = message[1].error if message[0] == "report" else None
    return None if isinstance(error, RankDivergenceError) else error


def _call_failure(message: tuple) -> BaseException | None:
    return message[1] if isinstance(message[1], BaseException) else None


def _close_at_exit(ref: weakref.ref) -> None:
    ranks = ref()
    if ranks is not None:
        ranks.close()
