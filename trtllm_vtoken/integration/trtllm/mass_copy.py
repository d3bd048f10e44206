# SPDX-License-Identifier: Apache-2.0
"""A batch's attention mass on its way to the host, without the host waiting on a later forward.

Under TensorRT-LLM's overlap loop (``_executor_loop_overlap`` in ``py_executor.py``) batch N is
updated after batch N+1's forward has been launched on the same stream:

    prepare_resources(N+1)  forward(N+1) enqueued  ...  update_resources(N)

Computing N's decode mass in ``update_resources(N)`` and copying it to the host would make the
host wait for forward N+1 too (the copy is behind it on the stream), so the host could not
prepare N+2 meanwhile. Instead the manager enqueues N's mass in ``prepare_resources(N+1)``,
before ``super().prepare_resources`` and before forward N+1 is launched, copies it to pinned host
memory without blocking and marks the stream there; ``update_resources(N)`` waits for that mark
only. The values are those the update would compute (the same kernels on the same queries, block
lists and lengths), so no decision changes:

    stream:  ... forward(N) | mass(N), copy to host, mark | forward(N+1) ...
    host:    prepare(N+1) enqueues mass(N) ...... update(N) waits for the mark, not for forward(N+1)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


class StreamMarks:
    """Points of the current CUDA stream the host can wait for (CUDA events). On a CPU device
    work is done when it is enqueued: nothing to mark or wait for."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def mark(self) -> Any:
        """A mark after everything enqueued on the current stream so far."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, mark: Any) -> None:
        """The host waits until the stream has passed ``mark``, not beyond."""
        if mark is not None:
            mark.synchronize()

    def wait_all(self) -> None:
        """The host waits for everything enqueued on the current stream (what a blocking copy to
        the host does)."""
        if self.cuda:
            torch.cuda.current_stream().synchronize()


class MassCopy:
    """One batch's mass, enqueued: [rows, width] float32 computed on the device, copied to pinned
    host memory behind it, and the stream marked after the copy."""

    def __init__(self, rows: Sequence[tuple[int, int, Sequence[int]]], mass: torch.Tensor, stream: StreamMarks) -> None:
        """rows: (request id, positions its forward attended to, block ids), the rows of ``mass``."""
        self.attended = {req_id: attended for req_id, attended, _ in rows}
        self.row_of = {req_id: i for i, (req_id, _, _) in enumerate(rows)}
        if mass.device.type == "cuda":
            self.host = torch.empty(mass.shape, dtype=mass.dtype, pin_memory=True)
            self.host.copy_(mass, non_blocking=True)
        else:
            self.host = mass
        self._device = mass  # alive until the copy is read
        self._stream = stream
        self.mark = stream.mark()

    def rows(self, rows: Sequence[tuple[int, int, Sequence[int]]], width: int) -> np.ndarray:
        """The mass of ``rows`` (those of the batch still running when it is updated) as the step
        takes it, [len(rows), width], zero past each row's attended positions. Waits for the
        copy's mark only. RuntimeError if a row attends to other positions than when enqueued
        (the table changed in between: the mass would be laid out wrongly)."""
        self._stream.wait(self.mark)
        self._device = None
        host = self.host.numpy()
        out = np.zeros((len(rows), width), dtype=np.float32)
        for i, (req_id, attended, _) in enumerate(rows):
            if self.attended.get(req_id) != attended:
                raise RuntimeError(f"request {req_id} attends to {attended} positions at its update, "
                                   f"{self.attended.get(req_id)} when its mass was enqueued")
            n = min(width, host.shape[1])
            out[i, :n] = host[self.row_of[req_id], :n]
        return out
