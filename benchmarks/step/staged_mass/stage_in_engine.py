"""The engine's staging copy of a forward's mass, timed inside the bench's engine (``--mass
staged`` at fa32b10, where the simulated forward's tensor went through ``MassStaging.stage``), next
to ``--mass buffer`` (the same values, one host array, no copy), dense H2O, batch 64, C++ call
beside sampling; then the same copy alone, warm, 50 times. It needs the package of a tree at
fa32b10 (at c44baa7 and later one forward's mass is no longer staged, and ``--mass staged``
became ``--mass forward``), with its C++ core, imported first (as ``overlap_real/across_commits.py``
imports each tree's); the recorded output, ``stage_in_engine.txt``, was made so from the tree
``git worktree add TREE fa32b10`` with the built ``_core`` module copied into ``TREE/trtllm_vtoken/_native/``.
"""

import time

import numpy as np
import torch

from trtllm_vtoken.bench import step as step_bench
from trtllm_vtoken.runtime import mass_staging

timed = {"seconds": 0.0, "calls": 0}
stage = mass_staging.MassStaging.stage


def timed_stage(self, forwards):
    start = time.perf_counter()
    view = stage(self, forwards)
    timed["seconds"] += time.perf_counter() - start
    timed["calls"] += 1
    return view


mass_staging.MassStaging.stage = timed_stage
row = dict(variant="vtoken", mode="dense", policy="h2o", impl="cpp")
for _ in range(2):
    for mass in ("buffer", "staged"):
        timed.update(seconds=0.0, calls=0)
        cfg = step_bench.StepBenchConfig(batches=(64,), steps=40, repeats=1, impls=("cpp",), mass=mass)
        r = step_bench._run(cfg, 64, row)
        per_call = 1e6 * timed["seconds"] / max(timed["calls"], 1)
        print(f"{mass:7s} added {r['added_us_p50']:6.0f} us, staging {per_call:4.0f} us per call ({timed['calls']} calls)")
staging = mass_staging.MassStaging(64, 4160)
source = torch.from_numpy(np.random.default_rng(0).random((64, 4160), dtype=np.float32))
times = []
for _ in range(50):
    start = time.perf_counter()
    staging.stage([source])
    times.append(time.perf_counter() - start)
print(f"alone, warm: staging {1e6 * np.median(times):.0f} us per call (min {1e6 * min(times):.0f})")
