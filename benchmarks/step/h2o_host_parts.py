"""The H2O rows' host-thread parts per step: "table" (the step's input checks and the batch's
registration on the engine's thread: the bench's mass is a function of the layout, so the host
registers first) and "copy" (the step's one copy of the moves, metadata only here, with the parts
of the output it reads). Dense H2O at batch 64 and 256, each engine step beside a native one's,
100 steps after 10 warm-up steps, in the tree given (with its own C++ core built in it), as
``ab.py`` runs a tree:

    for r in 1 2 3 4 5 6; do for t in BEFORE AFTER; do echo -n "$t "; python benchmarks/step/h2o_host_parts.py $t | tr "\\n" " "; echo; done; done

(``list_registration/output.txt`` was printed before the copy's keys were added.)
"""

import json
import sys

sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
for name in [m for m in sys.modules if m.startswith("trtllm_vtoken")]:
    del sys.modules[name]
sys.path.insert(0, sys.argv[1])
import trtllm_vtoken
assert trtllm_vtoken.__file__.startswith(sys.argv[1])
import gc
import numpy as np
from trtllm_vtoken.bench.step import NATIVE, StepBenchConfig, _prefilled
for batch in (64, 256):
    cfg = StepBenchConfig(batches=(batch,), steps=200, warmup=5, impls=("cpp",))
    eng = _prefilled(cfg, batch, dict(variant="vtoken", mode="dense", policy="h2o", impl="cpp"))
    nat = _prefilled(cfg, batch, NATIVE)
    for _ in range(5): eng.step(); nat.step()
    st = eng.kv.step.stats
    per = []
    gc.disable()
    for i in range(100):
        t, c = st.seconds["table"], st.seconds["copy"]
        nat.step(); eng.step()
        per.append((st.seconds["table"] - t, st.seconds["copy"] - c))
    gc.enable()
    per = np.array(per); print(json.dumps({"batch": batch, "table_us_p50": 1e6 * float(np.median(per[:, 0])), "copy_us_p50": 1e6 * float(np.median(per[:, 1])), "copy_us_mean": 1e6 * float(np.mean(per[:, 1]))}))
