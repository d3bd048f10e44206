# SPDX-License-Identifier: Apache-2.0
"""The engine's host work to hand the step a batch's mass: staged in one array, rewritten in place
(``MassStaging.stage``, since 419b1cc; one copy per forward since the commit that adds this
sentence), against a new zero-padded tensor each step, filled row by row (what
``Engine._batch_mass`` did before 419b1cc; written out below). One decode forward's mass, 64 rows
of 4,000 float32 positions, staging width 4,096; mean of 50 calls, three rounds in alternating
order.

    python benchmarks/step/mass_staging/run.py > benchmarks/step/mass_staging/output.txt
"""

from __future__ import annotations

import json
import time

import torch

from trtllm_vtoken.runtime.mass_staging import MassStaging

BATCH, LENGTH, WIDTH, CALLS = 64, 4000, 4096, 50


def main() -> None:
    forward = torch.rand(BATCH, LENGTH)  # the decode forward's mass; each row's, as the engine had it
    rows = list(forward)
    staging = MassStaging(BATCH, WIDTH)

    def new_tensor() -> torch.Tensor:  # the engine before 419b1cc
        out = torch.zeros(len(rows), max(m.shape[0] for m in rows))
        for i, m in enumerate(rows):
            out[i, : m.shape[0]] = m
        return out

    def staged():
        return staging.stage([forward])

    for round_ in range(3):
        order = [("new_tensor", new_tensor), ("staged", staged)]
        result = {"round": round_, "batch": BATCH, "length": LENGTH}
        for name, fn in order if round_ % 2 == 0 else order[::-1]:
            fn()
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            result[f"{name}_us"] = round((time.perf_counter() - start) / CALLS * 1e6)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
