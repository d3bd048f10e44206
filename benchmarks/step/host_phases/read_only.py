# The C++ core's registration call (slots_register: five int64 arrays, 64 requests, no new
# tokens) with the arrays writeable and read-only; microseconds per call, best of 5 x 20,000.
# nanobind takes a read-only numpy array by a slower path, so the step passes its reused batch
# arrays writeable (aec050e). Run from the repository root:
#     python benchmarks/step/host_phases/read_only.py > benchmarks/step/host_phases/read_only.txt
import timeit

import numpy as np

from trtllm_vtoken.core.native import load
from trtllm_vtoken.step import DecodeStep, StepConfig, StepInput

B = 64
native = load()
step = DecodeStep(StepConfig("dense", impl="cpp"), 4 * B, 32)
for req in range(B):
    step.add_request(req)
step.run(StepInput(list(range(B)), [32] * B, list(range(B + 1)), list(range(B))))
arrays = {"req_ids": np.arange(B, dtype=np.int64), "rows": step.slots.rows(list(range(B))).copy(),
          "offsets": np.zeros(B + 1, dtype=np.int64), "blocks": np.zeros(0, dtype=np.int64),
          "num_new": np.zeros(B, dtype=np.int64)}
layout, table = step.slots.native_layout(), step.core.table
for writeable in (True, False):
    args = {}
    for name, values in arrays.items():
        args[name] = values.copy()
        args[name].flags.writeable = writeable
    call = lambda: native.slots_register(layout, args["req_ids"], args["rows"], args["offsets"], args["blocks"],
                                         args["num_new"], 4 * B, table)
    best = min(timeit.repeat(call, number=20000, repeat=5)) / 20000
    print(f"slots_register, 64 requests, arrays {'writeable' if writeable else 'read-only'}: {1e6 * best:.2f} us")
