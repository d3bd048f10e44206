# SPDX-License-Identifier: Apache-2.0
"""Triton Python-backend model: LLM-API style, decoupled (streaming), served by vToken's engine.

Each Triton request is parsed (``trtllm_vtoken.serving.protocol``), tokenized and handed to one
``EngineLoop``: requests from every client join and leave the same running batch between steps.
With ``backend`` ``trtllm`` (or ``auto`` where tensorrt_llm imports and a GPU is present) the
requests go to TensorRT-LLM's LLM API with vToken's hooks instead (``TRTLLMLoop``, same interface);
the vtoken_* metrics then come from the executor worker's KV-cache manager, which publishes them
to a file the loop polls (``integration/trtllm/stats.py``; requests_preempted is not exported there).
Responses go back through the request's response sender: one final response, or with
``streaming`` one per text piece.

Ending requests early:
- a client that goes away, where Triton tells (``is_cancelled()`` on the response sender; see the
  README for which front ends do), is cancelled at the next step, freeing its KV blocks;
- a request with ``stop: true`` cancels the running requests that carry its request id (as in
  TensorRT-LLM's llmapi model); the ``ensemble`` model uses it for its own cancelled clients;
- when Triton starts unloading the model (``vtoken serve`` stopping, or an explicit unload), the
  requests still running are failed with "server is shutting down" at once instead of running to
  ``max_tokens``: Triton calls ``finalize`` only after its in-flight requests have ended.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _tensor(name: str, text: str) -> "pb_utils.Tensor":
    return pb_utils.Tensor(name, np.array([text.encode("utf-8")], dtype=np.object_))


class _ResponseSink:
    """Sends one request's outputs: pieces if streaming, else the whole text at the end.

    A failure after the first piece is sent as an error response followed by an empty final one,
    or, for a caller that set the request parameter ``stream_end_without_error`` (the ensemble),
    as a final response without error whose ``finish_reason`` is "error: <message>": Triton 2.51's
    Python backend loses a BLS caller's error responses after the first
    (``InferResponse::SaveToSharedMemory`` stores the response id only for responses without
    error; fixed upstream in python_backend 7f21b67), so an error would leave that caller waiting
    for ever.
    """

    def __init__(self, sender, parsed, on_done, end_without_error: bool = False) -> None:
        self.sender = sender
        self.parsed = parsed
        self.on_done = on_done
        self.end_without_error = end_without_error
        self.sent = False
        self.prefix = "" if parsed.exclude_input else parsed.prompt
        self.text: list[str] = []
        self.stopped = False
        self.loop_id: int | None = None

    def emit(self, out) -> None:
        if self.parsed.streaming:
            if out.text_delta or out.finished:
                self._send(self.prefix + out.text_delta, out)
                self.prefix = ""
            return
        self.text.append(out.text_delta)
        if out.finished:
            self._send(self.prefix + "".join(self.text), out)

    def fail(self, message: str) -> None:
        self.on_done(self)
        error = pb_utils.InferenceResponse(error=pb_utils.TritonError(message))
        if not self.sent:
            self.sender.send(error, flags=FINAL)
            return
        if self.end_without_error:
            failed = [_tensor("text_output", ""), _tensor("finish_reason", f"error: {message}")]
            self.sender.send(pb_utils.InferenceResponse(output_tensors=failed), flags=FINAL)
            return
        self.sender.send(error, flags=0)
        self.sender.send(flags=FINAL)

    def is_cancelled(self) -> bool:
        return self.stopped or self.sender.is_cancelled()

    def _send(self, text: str, out) -> None:
        """One response; the ``return_*`` outputs ride on every response the client asked them on
        (finish and stop reasons are empty until the last one)."""
        tensors = [_tensor("text_output", text)]
        if self.parsed.return_finish_reason:
            tensors.append(_tensor("finish_reason", out.finish_reason or ""))
        if self.parsed.return_stop_reason:
            tensors.append(_tensor("stop_reason", "" if out.stop_reason is None else str(out.stop_reason)))
        if self.parsed.return_cumulative_logprob:
            tensors.append(pb_utils.Tensor("cumulative_logprob", np.array([out.cumulative_logprob], np.float32)))
        if out.finished:
            self.on_done(self)
        self.sent = True
        self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if out.finished else 0)


class _RunningById:
    """The running requests' sinks by Triton request id, for ``stop`` requests."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sinks: dict[str, set[_ResponseSink]] = {}

    def add(self, request_id: str, sink: _ResponseSink) -> None:
        with self.lock:
            self.sinks.setdefault(request_id, set()).add(sink)

    def remove(self, request_id: str, sink: _ResponseSink) -> None:
        with self.lock:
            running = self.sinks.get(request_id, set())
            running.discard(sink)
            if not running:
                self.sinks.pop(request_id, None)

    def take(self, request_id: str) -> list[_ResponseSink]:
        with self.lock:
            return list(self.sinks.pop(request_id, ()))


class _UnloadWatcher:
    """Calls ``on_unload`` once when the model, having been ready, is ready no more: Triton is
    unloading it. Polls ``pb_utils.is_model_ready`` (Triton tells a Python model nothing else
    before ``finalize``, which it calls only after every in-flight request has ended)."""

    def __init__(self, model_name: str, on_unload, period_s: float = 0.25) -> None:
        self.model_name, self.on_unload, self.period_s = model_name, on_unload, period_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="vtoken-unload-watcher", daemon=True)
        self.thread.start()

    def _ready(self) -> bool:
        try:
            return bool(pb_utils.is_model_ready(model_name=self.model_name))
        except Exception:  # the server is going away
            return False

    def _run(self) -> None:
        seen_ready = False
        while not self.done.wait(self.period_s):
            ready = self._ready()
            if seen_ready and not ready:
                self.on_unload()
                return
            seen_ready = seen_ready or ready


class _Metrics:
    """Exports ``trtllm_vtoken.serving.metrics.METRICS`` as Triton custom metric families."""

    def __init__(self, labels: dict[str, str]) -> None:
        from trtllm_vtoken.serving.metrics import METRICS, POLICY_METRICS

        kinds = {"gauge": getattr(pb_utils, "GAUGE", None), "counter": getattr(pb_utils, "COUNTER", None)}
        if kinds["gauge"] is None:  # newer backends keep the kinds on MetricFamily
            kinds = {"gauge": pb_utils.MetricFamily.GAUGE, "counter": pb_utils.MetricFamily.COUNTER}
        self.families = [pb_utils.MetricFamily(name=s.name, description=s.description, kind=kinds[s.kind])
                         for s in METRICS]
        self.metrics = {s.name: (s.kind, f.Metric(labels=labels)) for s, f in zip(METRICS, self.families)}
        self.labels = labels
        self.policy_families = {name: pb_utils.MetricFamily(name=name, description=text, kind=kinds["counter"])
                                for name, text in POLICY_METRICS}
        self.last: dict[str, float] = {}

    def update(self, values: dict[str, float], by_policy: dict[str, dict[str, float]] | None = None) -> None:
        """Sets gauges; advances counters by what they grew since the last update. ``by_policy``:
        counters labelled with a policy name (a metric per name, made when it first appears)."""
        for policy, counters in (by_policy or {}).items():
            for name, value in counters.items():
                key = f"{name}|{policy}"
                if key not in self.metrics:
                    labels = {**self.labels, "policy": policy}
                    self.metrics[key] = ("counter", self.policy_families[name].Metric(labels=labels))
                values = {**values, key: value}
        for name, value in values.items():
            if name not in self.metrics:
                continue
            kind, metric = self.metrics[name]
            if kind == "gauge":
                metric.set(value)
            elif value > self.last.get(name, 0.0):
                metric.increment(value - self.last.get(name, 0.0))
            self.last[name] = value


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        from trtllm_vtoken.runtime.checkpoint import resolve_model
        from trtllm_vtoken.runtime.engine import Engine
        from trtllm_vtoken.runtime.model import load_llama
        from trtllm_vtoken.runtime.tokenizer import Tokenizer
        from trtllm_vtoken.serving.engine_loop import EngineLoop
        from trtllm_vtoken.serving.metrics import snapshot, snapshot_by_policy
        from trtllm_vtoken.serving.settings import ServingSettings

        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("this model must be decoupled (streaming responses)")
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.settings = ServingSettings.from_parameters(parameters)
        engine_config = self.settings.engine
        self.served_policy = "none" if engine_config.variant == "native" else engine_config.policy
        from trtllm_vtoken.serving.trtllm_loop import make_trtllm_loop, trtllm_available

        folder = resolve_model(self.settings.model)
        self.tokenizer = Tokenizer(folder)
        self.metrics = _Metrics({"model": args["model_name"], "version": args["model_version"]})
        backend = self.settings.backend
        # The reference engine runs every request with its own eviction settings; the TensorRT-LLM
        # path serves the configured policy for all (its hooks hold one policy per worker).
        self.per_request_eviction = True
        # batch_invariant is the reference engine's: "auto" serves it there.
        if backend == "trtllm" or (backend == "auto" and trtllm_available() and not engine_config.batch_invariant):
            self.loop = make_trtllm_loop(self.settings, on_stats=self.metrics.update)
            self.per_request_eviction = False
        else:
            from trtllm_vtoken.threads import set_threads

            set_threads(self.settings.threads or None)
            engine = Engine(load_llama(folder), self.settings.engine, self.tokenizer)
            self.metrics.update(snapshot(engine), snapshot_by_policy(engine))
            self.loop = EngineLoop(engine, on_step=lambda e: self.metrics.update(snapshot(e), snapshot_by_policy(e))).start()
        self.running = _RunningById()
        self.stop_lock = threading.Lock()
        self.loop_stopped = False
        self.watcher = _UnloadWatcher(args["model_name"], self._stop_loop)

    def execute(self, requests):
        from trtllm_vtoken.serving.fields import END_WITHOUT_ERROR, TENSORRT_LLM_INPUTS, check_parameters
        from trtllm_vtoken.serving.protocol import parse_request, read_stop

        for request in requests:
            get = lambda name, r=request: _as_numpy(pb_utils.get_input_tensor_by_name(r, name))  # noqa: E731
            sender = request.get_response_sender()
            request_id = request.request_id()
            try:
                parameters = check_parameters(request.parameters(), TENSORRT_LLM_INPUTS)
                if read_stop(get):
                    self._stop_requests(request_id, sender)
                    continue
                parsed = parse_request(get, self.settings.max_tokens_limit, self.settings.default_max_tokens,
                                       self.served_policy, self.per_request_eviction)
                prompt_ids = self.tokenizer.encode(parsed.prompt, chat=self.settings.chat_template)
            except ValueError as error:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))), flags=FINAL)
                continue
            sink = _ResponseSink(sender, parsed, on_done=lambda s, i=request_id: self.running.remove(i, s),
                                 end_without_error=bool(parameters.get(END_WITHOUT_ERROR)))
            self.running.add(request_id, sink)
            sink.loop_id = self.loop.submit(prompt_ids, parsed.params, sink)
        return None

    def _stop_requests(self, request_id: str, sender) -> None:
        """Cancels the running requests with ``request_id``; answers, as TensorRT-LLM's llmapi
        model does, with a CANCELLED error."""
        if not request_id:
            raise ValueError("'stop' needs the request id ('id') of the requests to cancel")
        sinks = self.running.take(request_id)
        for sink in sinks:
            sink.stopped = True  # the loop also checks is_cancelled() itself
            if sink.loop_id is not None:
                self.loop.cancel(sink.loop_id)
        message = f"stopped {len(sinks)} running request(s) with id {request_id!r}"
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.CANCELLED)),
                    flags=FINAL)

    def _stop_loop(self) -> None:
        """Fails what is still running ("server is shutting down") and stops the loop, once."""
        with self.stop_lock:
            if not self.loop_stopped:
                self.loop_stopped = True
                self.loop.stop()

    def finalize(self) -> None:
        self.watcher.done.set()
        self._stop_loop()


def _as_numpy(tensor):
    return None if tensor is None else tensor.as_numpy()
