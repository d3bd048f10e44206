# SPDX-License-Identifier: Apache-2.0
"""Triton Python-backend model ``ensemble``: TensorRT-LLM's ensemble fields, served by forwarding
each request to the ``tensorrt_llm`` model through BLS (as TensorRT-LLM's ``tensorrt_llm_bls``).

Why not ``platform: "ensemble"``: Triton checks a client's cancellation only between ensemble
steps and never passes it on to the step running, so a client that left an ensemble stream kept
its request generating to ``max_tokens``. Here the model sees its own client's cancellation and
passes it on with a ``stop`` request (the BLS API of this Triton version cannot cancel a BLS
request itself):

    client --text_input, max_tokens, stream...--> ensemble --BLS, same id, streaming--> tensorrt_llm
           <--- each piece (stream), or the joined text ---+
    client gone (response sender cancelled) -> ensemble --{stop: true, id=<same>}--> tensorrt_llm
                                                            (the request is cancelled, blocks freed)

The inner request carries the client's request id (a fresh unique one if it has none), so a
client can also end it with ``stop`` on ``tensorrt_llm``, as a direct one would; ``stop`` ends
every running request with that id.

The inner request always streams, so a cancellation is noticed between pieces however the client
asked; a watcher thread also checks every ``CHECK_PERIOD_S`` (a request may wait for its first
token). Errors of ``tensorrt_llm`` reach the client with the ensemble's field names; one that
happens after the first piece (cancelled, server shutting down) arrives as the final piece's
``finish_reason`` "error: <message>", because this Triton's BLS loses later error responses (see
``stream_end_without_error``).
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
TARGET = "tensorrt_llm"
CHECK_PERIOD_S = 0.05


class _Forward:
    """One client request and its inner request to ``tensorrt_llm``."""

    def __init__(self, request) -> None:
        self.request = request
        self.sender = request.get_response_sender()
        self.inner_id = request.request_id() or f"ensemble-{uuid.uuid4().hex}"
        self.stop_sent = False


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.lock = threading.Lock()
        self.active: set[_Forward] = set()
        self.closing = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="vtoken-ensemble-watcher", daemon=True)
        self.watcher.start()

    def execute(self, requests):
        from trtllm_vtoken.serving.fields import ENSEMBLE_INPUTS, check_parameters

        for request in requests:
            forward = _Forward(request)
            try:
                check_parameters(request.parameters(), ENSEMBLE_INPUTS, allowed=("id",))
            except ValueError as error:
                forward.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))),
                                    flags=FINAL)
                continue
            with self.lock:
                self.active.add(forward)
            threading.Thread(target=self._forward, args=(forward,), daemon=True).start()
        return None

    def finalize(self) -> None:
        self.closing.set()

    # ---- one request, on its own thread ----------------------------------------------------------
    def _forward(self, forward: _Forward) -> None:
        from trtllm_vtoken.serving.fields import END_WITHOUT_ERROR, as_ensemble_message

        stream = _bool_input(forward.request, "stream")
        pieces: list[str] = []
        error = None
        try:
            inner = pb_utils.InferenceRequest(
                model_name=TARGET, requested_output_names=["text_output", "finish_reason"],
                inputs=_inner_inputs(forward.request), request_id=forward.inner_id,
                parameters={END_WITHOUT_ERROR: True})
            for response in inner.exec(decoupled=True):
                if response.has_error():
                    error = response.error()
                    continue  # the iterator ends after the final response; the error is sent then
                reason = _text(response, "finish_reason")
                if reason.startswith("error: "):
                    error = pb_utils.TritonError(reason[len("error: "):])
                    continue
                piece = _text(response, "text_output")
                if stream and piece:
                    forward.sender.send(_text_response(piece), flags=0)
                elif not stream:
                    pieces.append(piece)
                if forward.sender.is_cancelled():
                    self._send_stop(forward)
        except Exception as exc:  # BLS failure (tensorrt_llm unloaded or not ready)
            error = pb_utils.TritonError(f"ensemble: {exc}")
        finally:
            with self.lock:
                self.active.discard(forward)
        if error is not None:
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(as_ensemble_message(error.message()),
                                                                             error.code()))
            forward.sender.send(response, flags=FINAL)
        elif stream:
            forward.sender.send(flags=FINAL)
        else:
            forward.sender.send(_text_response("".join(pieces)), flags=FINAL)

    # ---- cancellation ----------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self.closing.wait(CHECK_PERIOD_S):
            with self.lock:
                gone = [f for f in self.active if not f.stop_sent and f.sender.is_cancelled()]
            for forward in gone:
                self._send_stop(forward)

    def _send_stop(self, forward: _Forward) -> None:
        """Asks tensorrt_llm to cancel the inner request; its answer is a CANCELLED error."""
        with self.lock:
            if forward.stop_sent:
                return
            forward.stop_sent = True
        inputs = [pb_utils.Tensor("text_input", np.array([b""], dtype=np.object_)),
                  pb_utils.Tensor("stop", np.array([True]))]
        stop = pb_utils.InferenceRequest(model_name=TARGET, requested_output_names=["text_output"], inputs=inputs,
                                         request_id=forward.inner_id)
        try:
            for _ in stop.exec(decoupled=True):
                pass
        except Exception as exc:  # tensorrt_llm unloading: its requests end anyway
            pb_utils.Logger.log_warn(f"ensemble: could not stop {forward.inner_id}: {exc}")


def _inner_inputs(request) -> list:
    from trtllm_vtoken.serving.fields import ENSEMBLE_TO_TENSORRT_LLM

    inputs = [pb_utils.Tensor("streaming", np.array([True]))]
    for outer, inner in ENSEMBLE_TO_TENSORRT_LLM.items():
        tensor = pb_utils.get_input_tensor_by_name(request, outer)
        if tensor is not None:
            inputs.append(pb_utils.Tensor(inner, tensor.as_numpy()))
    return inputs


def _bool_input(request, name: str) -> bool:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return tensor is not None and bool(tensor.as_numpy().reshape(-1)[0])


def _text(response, name: str) -> str:
    tensor = pb_utils.get_output_tensor_by_name(response, name)
    if tensor is None:
        return ""
    return "".join(v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in tensor.as_numpy().reshape(-1))


def _text_response(text: str):
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))])
