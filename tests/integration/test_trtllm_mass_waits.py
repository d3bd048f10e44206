# SPDX-License-Identifier: Apache-2.0
"""Where vToken's manager makes the host wait on the execution stream, under TensorRT-LLM's
executor loops (the 1.2.1 double of ``PyExecutor``, ``trtllm121/.../py_executor.py``: plain
``_executor_loop`` and ``_executor_loop_overlap``): an attention-observing policy's step reads
its batch's mass from a copy enqueued before the next forward, and no step waits for a forward
launched after its batch's, deciding at once or lagged. The executor and its request mixes are
``test_trtllm_executor_loop.py``'s."""

from __future__ import annotations

import pytest

from tests.integration.test_trtllm_executor_loop import Mix, build_executor, random_requests, trace_victims


class StreamDouble:
    """The execution stream as the loop's thread sees it. It imitates ``torch.cuda``'s current
    stream and ``torch.cuda.Event.synchronize`` (a host wait covers everything enqueued before
    the event), on which ``PyExecutor._executor_loop_overlap`` (1.2-era ``py_executor.py``,
    search-index id 736889464) relies: ``model_engine.forward`` and vToken's work are enqueued
    on it in the loop's order. It stands in for the manager's ``StreamMarks``
    (``mass_copy.py``): every forward the engine launches and every mark vToken makes is one item
    in order, and every host wait records how far the host waited and who waited."""

    def __init__(self) -> None:
        self.launched = 0  # forwards launched (batch objects' ids are reused once they are freed)
        self.work: list[tuple[str, int]] = []  # ("forward", k) or ("vtoken mass", k)
        self.waits: list[tuple[int, int]] = []  # (forward whose batch the waiting update takes, items waited for)
        self.full_waits = 0  # waits for everything enqueued (a blocking copy)
        self.updating: int | None = None  # the forward whose batch update_resources is taking now
        self.forwards: dict[int, int] = {}  # id(batch) -> its forward

    def forward(self, batch) -> None:
        self.forwards[id(batch)] = self.launched
        self.work.append(("forward", self.launched))
        self.launched += 1

    def mark(self) -> int:
        self.work.append(("vtoken mass", self.launched - 1))
        return len(self.work)

    def wait(self, mark: int) -> None:
        self.waits.append((self._waiting_for(), mark))

    def wait_all(self) -> None:
        self.waits.append((self._waiting_for(), len(self.work)))
        self.full_waits += 1

    def _waiting_for(self) -> int:
        """The forward whose batch the host is stepping: update_resources' batch, else (a step in
        prepare_resources of the next batch) the batch in flight, whose forward is the newest."""
        return self.updating if self.updating is not None else self.launched - 1

    def later_forwards_waited_for(self) -> list[tuple[int, int]]:
        """(forward updated, a later forward its update waited for)."""
        return [(updated, k) for updated, through in self.waits for kind, k in self.work[:through]
                if kind == "forward" and k > updated]


@pytest.mark.parametrize("decision", ["at_once", "lagged"])
@pytest.mark.parametrize("loop", ["plain", "overlap"])
@pytest.mark.parametrize("policy", ["h2o", "scissorhands"])
def test_no_update_waits_for_a_later_forward_and_decisions_stay(trtllm121, policy, loop, decision):
    """Attention-observing policies under both loops: each batch's mass is enqueued before the
    next forward is launched (prepare_resources of the next batch) and the steps that read it
    wait for that copy only, never for a forward launched after their batch's: update_resources,
    and, deciding at once, prepare_resources for the requests that may evict. Their decisions are
    those of computing the mass where the step runs (the mass copy switched off), victim for victim."""
    traces, streams = {}, {}
    for enqueue in (True, False):
        mix = Mix(1, num_blocks=120)
        executor = build_executor(policy, mix, overlap=loop == "overlap", decode_decision=decision)
        manager, engine = executor.resources["kv_cache_manager"], executor.model_engine
        stream = streams[enqueue] = StreamDouble()
        manager._vtoken_stream = stream
        if not enqueue:
            manager._vtoken_enqueue_mass = lambda prepared: None
        forward, update = engine.forward, executor.resource_manager.update_resources

        def forward_on_stream(batch, *args, _forward=forward, _stream=stream, **kwargs):
            out = _forward(batch, *args, **kwargs)
            _stream.forward(batch)
            return out

        def update_after_its_forward(batch, *args, _update=update, _stream=stream, **kwargs):
            _stream.updating = _stream.forwards[id(batch)]
            _update(batch, *args, **kwargs)
            _stream.updating = None

        engine.forward, executor.resource_manager.update_resources = forward_on_stream, update_after_its_forward
        traces[enqueue] = trace_victims(manager)
        for req, arrival, _ in random_requests(mix):
            executor.enqueue_request(req, arrival)
        executor.run()
    assert traces[True] == traces[False] and sum(len(v) for t in traces[True].values() for _, v in t) > 0
    assert streams[True].waits and not streams[True].later_forwards_waited_for()
    marks = sum(kind == "vtoken mass" for kind, _ in streams[True].work)
    if loop == "overlap":  # every step took an enqueued copy; computed at the update, it waits for N+1
        assert marks > 0 and streams[True].full_waits == 0
        if decision == "lagged":  # one read of each copy (deciding at once: a prepare's and an update's)
            assert marks >= len(streams[True].waits)
        assert streams[False].later_forwards_waited_for()
    else:  # nothing is in flight at an update: it computes the mass then
        assert marks == 0 and streams[True].full_waits == len(streams[True].waits)
