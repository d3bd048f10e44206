# SPDX-License-Identifier: Apache-2.0
"""Per-request statistics indexed by logical id, for policies that learn from attention."""

from __future__ import annotations

import numpy as np


class PerTokenAccumulator:
    """A float per logical id per request, growing with the request: O(L) per request.

    ``dtype``: the values' type. float32 accumulates as the step's per-slot statistic does (each
    addition rounded once to float32: a float32 amount added in float32, a float64 one in float64,
    then rounded), so a policy's per-request and batched decisions agree bit for bit."""

    def __init__(self, dtype: type = np.float64) -> None:
        self.dtype = np.dtype(dtype)
        self._values: dict[int, np.ndarray] = {}

    def add(self, req_id: int, token_ids: np.ndarray, amounts: np.ndarray) -> None:
        token_ids = np.asarray(token_ids, dtype=np.int64)
        values = self._values.get(req_id, np.zeros(0, dtype=self.dtype))
        needed = int(token_ids.max()) + 1 if len(token_ids) else 0
        if needed > len(values):
            grown = np.zeros(max(needed, 2 * len(values)), dtype=self.dtype)
            grown[: len(values)] = values
            values = self._values[req_id] = grown
        amounts = np.asarray(amounts)
        with np.errstate(invalid="ignore"):  # +inf and -inf (an attention that overflowed) add to NaN
            np.add.at(values, token_ids,
                      amounts if amounts.dtype == np.float32 else np.asarray(amounts, dtype=np.float64))

    def get(self, req_id: int, token_ids: np.ndarray) -> np.ndarray:
        """Values of ``token_ids`` (0 for ids never observed). Shape: token_ids.shape."""
        values = self._values.get(req_id, np.zeros(0))
        out = np.zeros(len(token_ids))
        seen = token_ids < len(values)
        out[seen] = values[token_ids[seen]]
        return out

    def forget(self, req_id: int) -> None:
        self._values.pop(req_id, None)
