# SPDX-License-Identifier: Apache-2.0
"""Host values (slot indices, block tables, lengths) onto the device without a host wait.

``torch.as_tensor(values, device="cuda")`` or ``tensor.to("cuda")`` of pageable host memory
copies and then synchronizes the current stream (torch's ``memcpy_and_sync``): the host waits
for everything enqueued before the copy, a forward in flight included. Under TensorRT-LLM's
overlap loop that forward is the one the host should be preparing the next batch beside:

    stream:  forward(N) ........................ | upload | mass(N) | forward(N+1)
    host:    prepare(N+1) ... upload: waits for forward(N) ... launches forward(N+1) late

From pinned memory and non-blocking, the copy is ordered on the stream like a kernel and the host
goes on; the caching host allocator keeps the pinned block until the copy has run (it records an
event on the stream when the copy is enqueued).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


def to_device(values: np.ndarray | Iterable[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` as a tensor of ``dtype`` on ``device``; onto a CUDA device through pinned
    memory, without waiting for the current stream (the copy is enqueued on it)."""
    host = torch.as_tensor(np.asarray(values if isinstance(values, np.ndarray) else list(values)), dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
