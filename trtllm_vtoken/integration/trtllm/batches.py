# SPDX-License-Identifier: Apache-2.0
"""The batches TensorRT-LLM's executor has prepared and not yet updated, as vToken's manager sees
them in each of its loops (``PyExecutor`` in ``py_executor.py``):

    _executor_loop           prepare(N)  forward(N)  update(N)  prepare(N+1) ...   one in flight
    _executor_loop_overlap   prepare(N+1)  forward(N+1)  update(N)  ...            two
    _executor_loop_pp        prepare(N+1)  forward(N+1)  ... update(N)             up to pp_size

Per batch it keeps what ``update_resources`` needs once the batch's forward has run:

- the tokens of each request that the forwards launched so far write (``through``): the prompt
  up to the end of this batch's chunk (the whole prompt without chunked prefill), then one per
  decode row; the decode queries the batch recorded attended to exactly that many tokens;
- which of its context rows have more of their prompt to come (``continues``): with chunked
  prefill a request's next chunk is scheduled while this one's forward may be in flight;
- speculative decoding (NGram): a decode row carries its token and ``k`` draft tokens, all
  allocated and written; ``update_resources`` rewinds the rejected ones (``py_rewind_len``)
  before vToken's step, which then takes in the row's token and the accepted drafts only
  (``rewound``), and the mass of their queries only;
- its recordings for the policy: each context row's prefill mass and each decode row's queries.
  The query recorder is one static buffer (captured CUDA graphs write into it on replay), which
  the next batch's forward overwrites: a batch still in flight when the next one is prepared has
  its mass enqueued from them first (``mass_copy.py``), or else its rows copied out ("parked";
  a copy on the stream, after its forward and before the next one).

The rows of a batch's recordings follow its request lists as the forward saw them: context
requests first, then generation requests (those with draft tokens first), each decode row 1 +
its draft tokens' queries (the overlap loop sorts the generation list after
``prepare_resources``; the lists are read when the rows are needed, not before).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trtllm_vtoken.integration.trtllm.scores import QueryRecorder

if TYPE_CHECKING:
    import torch

    from trtllm_vtoken.integration.trtllm.mass_copy import MassCopy

Recording = tuple[str, "torch.Tensor | None"]
"""("prefill", a prompt's mass [prompt_len] or None) or ("decode", its queries [1 + drafts, layers,
heads, dim])."""


@dataclass
class PreparedBatch:
    batch: object
    """TensorRT-LLM's ``ScheduledRequests``: ``update_resources`` receives the same object."""
    through: dict[int, int]
    """Request -> its tokens that this batch's forward and those before it write."""
    prompt_after: dict[int, int]
    """Context request -> prompt tokens after this batch's chunk (0: its chunk ends the prompt)."""
    parked: dict[int, Recording] | None = None
    """The batch's recordings, copied out of the recorder before the next forward (else None)."""
    mass: MassCopy | None = None
    """Its attention mass, enqueued before the next forward (``mass_copy.py``), else None."""
    stepped: set[int] = field(default_factory=set)
    """Its requests whose step was taken before the next forward (``prepare_resources``):
    ``update_resources`` leaves them out."""

    def continuing(self) -> set[int]:
        """Its context requests with more of their prompt to prefill (chunked prefill)."""
        return {req_id for req_id, after in self.prompt_after.items() if after}

    _rows: dict[int, tuple[str, int, int]] | None = field(default=None, init=False, repr=False)

    def recording_rows(self) -> dict[int, tuple[str, int, int]]:
        """Request -> where the forward recorded it: ("prefill", context row, 0), or ("decode",
        first query, end) in the recorder's decode queries (its token, then its draft tokens').
        Read from the request lists the first time it is asked, after the forward (the lists are
        final then), and kept: the step asks for every row of the batch."""
        if self._rows is None:
            contexts = self.batch.context_requests
            rows = {r.py_request_id: ("prefill", i, 0) for i, r in enumerate(contexts)}
            start = 0
            for request in decode_row_order(self.batch.generation_requests):
                end = start + 1 + len(getattr(request, "py_draft_tokens", None) or ())
                rows[request.py_request_id] = ("decode", start, end)
                start = end
            self._rows = rows
        return self._rows


def decode_row_order(generation_requests) -> list:
    """The generation requests in the order of the forward's rows: those with draft tokens first,
    then those without (``_prepare_tp_inputs``, ``model_engine.py``; NGram pads every row's drafts
    to the same count, so the order is the list's whenever it drafts)."""
    drafts = [bool(getattr(r, "py_draft_tokens", None)) for r in generation_requests]
    return [r for r, d in zip(generation_requests, drafts) if d] + \
        [r for r, d in zip(generation_requests, drafts) if not d]


class PreparedBatches:
    """The manager's batches in flight, oldest first, and the tokens TensorRT-LLM allocated per request."""

    def __init__(self, recorder: QueryRecorder, records: bool) -> None:
        self.recorder, self.records = recorder, records
        self.allocated: dict[int, int] = {}
        """Request -> its tokens the forwards launched so far write (logical: rewinds do not lower it)."""
        self.reserved: dict[int, int] = {}
        """Request -> tokens TensorRT-LLM allocated for it (logical): its whole prompt at the first
        chunk (``add_sequence``), then one per ``add_token``. Past ``allocated`` lie the prompt
        tokens of chunks still to come, whose blocks it holds already."""
        self._batches: list[PreparedBatch] = []

    def prepared(self, batch) -> None:
        """After ``prepare_resources`` allocated the batch's tokens, before its forward runs."""
        # An earlier batch's forward ran; the one about to run overwrites the recorder (its mass,
        # if enqueued already, read the recordings before).
        for earlier in self._batches:
            if earlier.parked is None and earlier.mass is None and self.records:
                earlier.parked = self._park(earlier)
        prompt_after = {}
        for req in batch.context_requests:
            end = req.context_current_position + req.context_chunk_size
            self.allocated[req.py_request_id] = end
            if req.is_first_context_chunk:
                self.reserved[req.py_request_id] = req.prompt_len
            prompt_after[req.py_request_id] = req.prompt_len - end
        for req in batch.generation_requests:  # its token and its draft tokens (add_token each)
            count = 1 + len(getattr(req, "py_draft_tokens", None) or ())
            self.allocated[req.py_request_id] = self.allocated.get(req.py_request_id, 0) + count
            self.reserved[req.py_request_id] = self.reserved.get(req.py_request_id, 0) + count
        through = {r.py_request_id: self.allocated.get(r.py_request_id, 0) for r in batch.all_requests()}
        self._batches.append(PreparedBatch(batch, through, prompt_after))
        if self.records:
            self.recorder.start_batch()

    def take(self, batch) -> PreparedBatch:
        """The batch ``update_resources`` was called with, no longer in flight."""
        for i, prepared in enumerate(self._batches):
            if prepared.batch is batch:
                return self._batches.pop(i)
        raise RuntimeError("update_resources got a batch prepare_resources never saw")

    def latest(self) -> PreparedBatch:
        """The batch prepared last (its forward's recordings are the recorder's)."""
        if not self._batches:
            raise RuntimeError("no batch is in flight")
        return self._batches[-1]

    def in_flight(self) -> list[PreparedBatch]:
        """The batches prepared and not yet updated, oldest first (their forwards were launched)."""
        return list(self._batches)

    def rewound(self, prepared: PreparedBatch, req_id: int, count: int) -> None:
        """TensorRT-LLM rewound the request's last ``count`` tokens of this batch (its rejected
        draft tokens): they were never written for the table."""
        for counts in (self.allocated, self.reserved, prepared.through):
            if req_id in counts:
                counts[req_id] -= count

    def forget(self, req_id: int) -> None:
        """The request left TensorRT-LLM's manager (finished, cancelled or paused)."""
        self.allocated.pop(req_id, None)
        self.reserved.pop(req_id, None)

    def prompt_after(self, req_id: int) -> int:
        """Prompt tokens after the chunk of the batch prepared last (0 for a decode row)."""
        return self.latest().prompt_after.get(req_id, 0) if self._batches else 0

    def recording(self, prepared: PreparedBatch, req_id: int) -> Recording:
        """What the batch's forward recorded for a request (parked, or still in the recorder)."""
        if prepared.parked is not None:
            return prepared.parked.get(req_id, ("decode", None))
        return self._recorded(*prepared.recording_rows()[req_id])

    def _recorded(self, kind: str, start: int, end: int) -> Recording:
        if kind == "prefill":
            return kind, self.recorder.prefill.get(start)
        q = self.recorder.q
        if q is None or end > q.shape[0]:  # not recorded (rows past the buffer: padding)
            return kind, None
        return kind, q[start:end]

    def _park(self, prepared: PreparedBatch) -> dict[int, Recording]:
        parked: dict[int, Recording] = {}
        for req_id, where in prepared.recording_rows().items():
            kind, recorded = self._recorded(*where)
            if kind == "prefill":
                parked[req_id] = (kind, recorded)
            elif recorded is not None:
                parked[req_id] = (kind, recorded.clone())
        return parked
