# SPDX-License-Identifier: Apache-2.0
"""The batch's attention mass, staged in one host array and rewritten in place.

The step takes the mass as one ``[B, >= L]`` array. An iteration with one forward (a decode
batch, or one prefill) hands that forward's host array over as it is; the step's call on the
worker repeats with it (``step/beside.py``: a new array of the same rows and dtype each step,
its width checked by the C++ core). An iteration whose rows come from several forwards (the
decode rows', then each prefill's) needs them in one array: the engine copies each forward's mass
into one float32 array, one copy per forward, and hands over its first B rows, one view object
per batch size B (the same object each time):

    array [max_rows, width] (width = max_seq_len rounded up to a block), B = 3:
      rows 0-1  the decode forward's mass [2, 9] ........ | 0 0 0 ...
      row  2    a prefill's mass [1, 12] ............ | 0 0 ...
      row  3    (not handed over)

A row's columns past its forward's width are zero, as in a freshly padded batch: a row that held
a wider one before is cleared up to what it held.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class MassStaging:
    """One float32 ``[max_rows, width]`` host array, rewritten by ``stage``.

    Args:
        max_rows: the most rows a batch has (the engine's ``max_batch_size``).
        width: the widest mass it takes (the engine's ``max_seq_len`` rounded up to a block).
    """

    def __init__(self, max_rows: int, width: int) -> None:
        if max_rows < 1 or width < 1:
            raise ValueError(f"max_rows and width must be positive, got {max_rows} and {width}")
        self.width = width
        self._array = np.zeros((max_rows, width), dtype=np.float32)
        self._rows = torch.from_numpy(self._array)  # the same memory, for one copy per forward
        self._views: dict[int, np.ndarray] = {}  # batch size -> its rows, one object each
        self._written = np.zeros(max_rows, dtype=np.int64)  # columns each row may hold now

    def stage(self, forwards: Sequence[torch.Tensor]) -> np.ndarray:
        """The batch's mass: each forward's float32 ``[rows, L]`` host tensor, in order, as the
        first rows of the array (one copy each): the same object as the last batch of this size
        got, rewritten. Raises ``ValueError`` for more rows than ``max_rows`` or a mass wider
        than ``width`` (nothing rewritten)."""
        batch = sum(int(m.shape[0]) for m in forwards)
        if batch > len(self._written):
            raise ValueError(f"{batch} mass rows, the staging holds {len(self._written)}")
        widest = max((int(m.shape[1]) for m in forwards), default=0)
        if widest > self.width:
            raise ValueError(f"a mass of {widest} positions is wider than the staging width {self.width}")
        row = 0
        for mass in forwards:
            n, length = mass.shape
            self._rows[row : row + n, :length] = mass
            held = int(self._written[row : row + n].max())
            if held > length:
                self._rows[row : row + n, length:held] = 0.0
            self._written[row : row + n] = length
            row += n
        view = self._views.get(batch)
        if view is None:
            view = self._views[batch] = self._array[:batch]
        return view
