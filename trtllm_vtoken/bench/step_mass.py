# SPDX-License-Identifier: Apache-2.0
"""Where ``vtoken bench step``'s attention mass comes from (``--mass``): ``batch_mass`` functions
with ``SimulatedModel``'s signature that hand the step fixed random float32 values, so that no
host work of making them is timed (see ``bench/step.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def buffer_mass(seed: int, width: int, tensor: bool = False):
    """A ``batch_mass`` (``SimulatedModel``'s signature) returning one fixed random float32 array
    [B, width] per batch size, the same object every step: a host's staging buffer for its
    attention's output, rewritten by the device's copy (not by these cores) each step. ``tensor``:
    a torch tensor instead, a forward's mass as the model's forward returns it to the host, which
    the engine hands to the step as a new numpy view each step, as on the real model."""
    arrays: dict[int, Any] = {}

    def batch_mass(req_ids: list[int], num_queries: list[int]):
        if len(req_ids) not in arrays:
            values = np.random.default_rng(seed).random((len(req_ids), width), dtype=np.float32)
            arrays[len(req_ids)] = torch.from_numpy(values) if tensor else values
        return arrays[len(req_ids)]

    return batch_mass


def fixed_mass(seed: int):
    """A ``batch_mass`` (``SimulatedModel``'s signature) whose function returns one fixed random
    float32 array per layout shape [B, L]: nothing runs on the host's cores to make it."""
    arrays: dict[tuple[int, ...], np.ndarray] = {}

    def batch_mass(req_ids: list[int], num_queries: list[int]):
        def mass(tokens: np.ndarray) -> np.ndarray:
            if tokens.shape not in arrays:
                arrays[tokens.shape] = np.random.default_rng(seed).random(tokens.shape, dtype=np.float32)
            return arrays[tokens.shape]

        return mass

    return batch_mass
