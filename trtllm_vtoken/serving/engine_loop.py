# SPDX-License-Identifier: Apache-2.0
"""One engine, one thread: in-flight batching for a server whose requests arrive on other threads.

    server threads                      engine thread
    submit(prompt, params, sink) --+
    cancel(req_id) ----------------+--> inbox --> add / cancel between steps
                                        step() --> sink(output) per request, in order
                                        sink.is_cancelled() polled every step (client gone)

A sink receives every ``RequestDelta`` of its request, in order, then nothing more; an error
(bad request, shutdown, or an engine failure) is delivered as ``sink.fail(message)`` instead.
``stop()`` cancels what is left, fails it with "server is shutting down" and joins the thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from trtllm_vtoken.runtime.engine import Engine
from trtllm_vtoken.runtime.request import RequestDelta
from trtllm_vtoken.runtime.sampling import SamplingParams

log = logging.getLogger(__name__)


class Sink(Protocol):
    def emit(self, output: RequestDelta) -> None: ...

    def fail(self, message: str) -> None: ...

    def is_cancelled(self) -> bool: ...


class CollectingSink:
    """A sink that keeps every output and lets another thread wait for the end (in-process
    clients: benchmarks, tests). With ``cancel_after``, it reports its client gone once that
    many outputs have arrived."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.outputs: list[RequestDelta] = []
        self.error: str | None = None
        self.done = threading.Event()
        self.cancel_after = cancel_after

    def emit(self, output: RequestDelta) -> None:
        self.outputs.append(output)
        if output.finished:
            self.done.set()

    def fail(self, message: str) -> None:
        self.error = message
        self.done.set()

    def is_cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.outputs) >= self.cancel_after

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.new_token_ids]

    @property
    def text(self) -> str:
        return "".join(o.text_delta for o in self.outputs)


@dataclass
class _Add:
    req_id: int
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink


class EngineLoop:
    """Owns ``engine``; only its thread touches it after ``start()``.

    Args:
        on_step: Called on the engine thread after every iteration that changed something (a
            step, an admission, a cancellation), for metrics export.
    """

    def __init__(self, engine: Engine, on_step: Callable[[Engine], None] | None = None,
                 idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.on_step = on_step
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[int, Sink] = {}
        self._ids = itertools.count()
        self._id_lock = threading.Lock()
        self._stopping = threading.Event()
        self._failed: str | None = None
        self._thread = threading.Thread(target=self._run, name="vtoken-engine", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> int:
        """Queues a request from any thread; returns its id. Errors reach ``sink.fail``."""
        with self._id_lock:
            req_id = next(self._ids)
        if self._stopping.is_set() or self._failed:
            sink.fail(self._failed or "server is shutting down")
            return req_id
        self._inbox.put(_Add(req_id, prompt_ids, params, sink))
        return req_id

    def cancel(self, req_id: int) -> None:
        self._inbox.put(req_id)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stops taking requests, fails the ones in flight, joins the engine thread."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def in_flight(self) -> int:
        return len(self._sinks)

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            changed = self._drain(block=not engine.has_unfinished())
            for req_id, sink in list(self._sinks.items()):
                if sink.is_cancelled():
                    self._cancel(req_id)
                    changed = True
            if engine.has_unfinished():
                try:
                    outputs = engine.step()
                except Exception as error:  # an engine bug: fail every request, refuse new ones
                    log.exception("engine step failed")
                    self._failed = f"engine failure: {error}"
                    self._fail_all(self._failed)
                    return
                # Metrics first: a client that has its answer must find it counted when it scrapes.
                if self.on_step is not None:
                    self.on_step(engine)
                self._deliver(outputs)
            elif changed and self.on_step is not None:
                self.on_step(engine)
        self._drain(block=False)
        self._fail_all("server is shutting down")
        if self.on_step is not None:
            self.on_step(engine)

    def _deliver(self, outputs: list[RequestDelta]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.req_id)
            if sink is None:
                continue
            sink.emit(out)
            if out.finished:
                del self._sinks[out.req_id]
                self.engine.pop_finished(out.req_id)

    def _drain(self, block: bool) -> bool:
        """Handles what the inbox holds (waiting briefly first if ``block``); True if anything."""
        handled = False
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
            while True:
                self._handle(item)
                handled = True
                item = self._inbox.get_nowait()
        except queue.Empty:
            return handled

    def _handle(self, item) -> None:
        if item is None:
            return
        if isinstance(item, int):
            self._cancel(item)
            return
        if self._stopping.is_set():
            item.sink.fail("server is shutting down")
            return
        try:
            self.engine.add_request(item.prompt_ids, item.params, req_id=item.req_id)
        except ValueError as error:
            item.sink.fail(str(error))
            return
        self._sinks[item.req_id] = item.sink

    def _cancel(self, req_id: int) -> None:
        sink = self._sinks.pop(req_id, None)
        if sink is not None and self.engine.cancel(req_id):
            self.engine.pop_finished(req_id)
            sink.fail("request cancelled")

    def _fail_all(self, message: str) -> None:
        for req_id in list(self._sinks):
            sink = self._sinks.pop(req_id)
            if self.engine.cancel(req_id):
                self.engine.pop_finished(req_id)
            sink.fail(message)
