# SPDX-License-Identifier: Apache-2.0
"""The batch's attention mass, staged in one host array per batch size and rewritten in place.

The step takes the mass as ``[B, >= L]`` and, where the host hands it the same array step after
step, repeats its call on the worker with the last one's bound arguments (``step/repeat.py``): the
C++ core reads the array again and checks its width. A host that built a new array each step
would always take the whole path. So the engine copies each forward's mass rows into one float32
array per batch size, as a CUDA-graph host copies its attention's static output into one pinned
staging buffer:

    array (B = 3, width = max_seq_len rounded up to a block):
      row 0  | mass of request a, kv_len 9 ........ | 0 0 0 ...
      row 1  | mass of request b, kv_len 5 ...| 0 0 0 0 0 0 ...
      row 2  | mass of request c, kv_len 12 ............ | 0 ...

A row's columns past its length are zero, as in a freshly padded batch: a row that held a longer
request before is cleared up to what it held.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class MassStaging:
    """One float32 ``[B, width]`` host array per batch size B, rewritten by ``stage``.

    Args:
        width: the longest row it takes (the engine's ``max_seq_len`` rounded up to a block).
    """

    def __init__(self, width: int) -> None:
        if width < 1:
            raise ValueError(f"width must be positive, got {width}")
        self.width = width
        self._arrays: dict[int, np.ndarray] = {}
        self._written: dict[int, list[int]] = {}  # batch size -> columns each row holds now

    def stage(self, masses: Sequence[torch.Tensor]) -> np.ndarray:
        """The batch's mass, one row per tensor (float32 [kv_len] on the host), in the array of
        this batch size: the same object as the last batch of this size got, rewritten. Raises
        ``ValueError`` for a row wider than ``width`` (nothing rewritten)."""
        lengths = [int(m.shape[0]) for m in masses]
        if max(lengths, default=0) > self.width:
            raise ValueError(f"a mass row of {max(lengths)} positions is wider than the staging width {self.width}")
        batch = len(masses)
        array = self._arrays.get(batch)
        if array is None:
            array = self._arrays[batch] = np.zeros((batch, self.width), dtype=np.float32)
            self._written[batch] = [0] * batch
        written = self._written[batch]
        for i, (mass, length) in enumerate(zip(masses, lengths)):
            array[i, :length] = mass.numpy()
            if written[i] > length:
                array[i, length : written[i]] = 0.0
            written[i] = length
        return array
