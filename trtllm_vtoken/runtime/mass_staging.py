# SPDX-License-Identifier: Apache-2.0
"""The batch's attention mass, staged in one host array and rewritten in place.

The step takes the mass as ``[B, >= L]`` and, where the host hands it the same array step after
step, repeats its call on the worker with the last one's bound arguments (``step/repeat.py``): the
C++ core reads the array again and checks its width. A host that built a new array each step
would always take the whole path. So the engine copies each forward's mass rows into one float32
array, as a CUDA-graph host copies its attention's static output into one pinned staging buffer,
and hands over its first B rows, one view object per batch size B (the same object each time):

    array [max_rows, width] (width = max_seq_len rounded up to a block), B = 3:
      row 0  | mass of request a, kv_len 9 ........ | 0 0 0 ...
      row 1  | mass of request b, kv_len 5 ...| 0 0 0 0 0 0 ...
      row 2  | mass of request c, kv_len 12 ............ | 0 ...
      row 3  (not handed over)

A row's columns past its length are zero, as in a freshly padded batch: a row that held a longer
request before is cleared up to what it held.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class MassStaging:
    """One float32 ``[max_rows, width]`` host array, rewritten by ``stage``.

    Args:
        max_rows: the most rows a batch has (the engine's ``max_batch_size``).
        width: the longest row it takes (the engine's ``max_seq_len`` rounded up to a block).
    """

    def __init__(self, max_rows: int, width: int) -> None:
        if max_rows < 1 or width < 1:
            raise ValueError(f"max_rows and width must be positive, got {max_rows} and {width}")
        self.width = width
        self._array = np.zeros((max_rows, width), dtype=np.float32)
        self._views: dict[int, np.ndarray] = {}  # batch size -> its rows, one object each
        self._written = [0] * max_rows  # columns each row holds now

    def stage(self, masses: Sequence[torch.Tensor]) -> np.ndarray:
        """The batch's mass, one row per tensor (float32 [kv_len] on the host), as the first
        ``len(masses)`` rows of the array: the same object as the last batch of this size got,
        rewritten. Raises ``ValueError`` for more rows than ``max_rows`` or a row wider than
        ``width`` (nothing rewritten)."""
        batch, lengths = len(masses), [int(m.shape[0]) for m in masses]
        if batch > len(self._written):
            raise ValueError(f"{batch} mass rows, the staging holds {len(self._written)}")
        if max(lengths, default=0) > self.width:
            raise ValueError(f"a mass row of {max(lengths)} positions is wider than the staging width {self.width}")
        array, written = self._array, self._written
        for i, (mass, length) in enumerate(zip(masses, lengths)):
            array[i, :length] = mass.numpy()
            if written[i] > length:
                array[i, length : written[i]] = 0.0
            written[i] = length
        view = self._views.get(batch)
        if view is None:
            view = self._views[batch] = array[:batch]
        return view
