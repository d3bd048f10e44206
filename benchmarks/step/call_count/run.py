"""Python calls per engine step, indirection-only against native (batch 64, ``vtoken bench step``'s
engines): every Python function call and C function call ``sys.setprofile`` sees in 10 steps
after 10 warm-up steps, per step, and the calls one engine makes that the other does not.

    python benchmarks/step/call_count/run.py > benchmarks/step/call_count/output.txt
"""

import collections
import sys

from trtllm_vtoken.bench.step import NATIVE, StepBenchConfig, _prefilled

ROWS = {"native": NATIVE,
        "indirection-only": dict(variant="indirection-only", mode="dense", policy="streaming_llm", impl="cpp")}
STEPS = 10


def count(row) -> collections.Counter:
    engine = _prefilled(StepBenchConfig(batches=(64,), steps=40, warmup=5, impls=("cpp",)), 64, row)
    for _ in range(10):
        engine.step()
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            calls[f"{frame.f_code.co_filename.split('trtllm_vtoken/')[-1]}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            calls[f"C {getattr(arg, '__qualname__', arg)}"] += 1

    sys.setprofile(profile)
    for _ in range(STEPS):
        engine.step()
    sys.setprofile(None)
    return calls


counts = {name: count(row) for name, row in ROWS.items()}
for name, calls in counts.items():
    print(f"{name}: {sum(calls.values()) / STEPS:,.1f} calls per step")
mine, theirs = counts["indirection-only"], counts["native"]
print("\nper step, indirection-only minus native (nonzero only):")
for key in sorted(set(mine) | set(theirs), key=lambda k: (mine[k] - theirs[k], k)):
    if mine[key] != theirs[key]:
        print(f"{(mine[key] - theirs[key]) / STEPS:+8.1f}  {key}")
