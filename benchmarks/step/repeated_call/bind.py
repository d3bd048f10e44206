"""The host's part of starting the fused call on the worker (``DecodeWorker.start`` with all its
arguments) against a repeated call (``DecodeWorker.repeat`` with arguments bound once), at batch
64 on an indirection-only engine prefilled as ``vtoken bench step`` prefills it: 1 ms after the
thread's last use (median of 300, alternating) and warm (start and wait, best of 5 x 300). The
calls pass no new tokens, so the engine's table is not advanced.

    python benchmarks/step/repeated_call/bind.py > benchmarks/step/repeated_call/bind.txt
"""

import gc
import time
import timeit

import numpy as np

from trtllm_vtoken.bench.step import StepBenchConfig, _prefilled

BATCH = 64


def main() -> None:
    cfg = StepBenchConfig(batches=(BATCH,), steps=320, warmup=5, impls=("cpp",))
    engine = _prefilled(cfg, BATCH, dict(variant="indirection-only", mode="dense", policy="streaming_llm", impl="cpp"))
    for _ in range(10):
        engine.step()
    step = engine.kv.step
    last, worker = step._repeated, step._native_worker  # the engine's own repeated call and worker
    if last is None:
        raise SystemExit("the engine's steps did not repeat their call")
    lists, none_new = tuple([] for _ in range(BATCH)), np.zeros(BATCH, dtype=np.int64)
    req_ids, rows, _ = last.arrays
    arguments = (step.slots.native_layout(), step.core.table, req_ids, rows, none_new, None, lists,
                 last.decision.selector, tuple(last.rule), 0, 1, False, None, None, last.decision.skip_shared,
                 last.decision.threads, None, 0)
    bound = worker.bind(*arguments[:5], *arguments[7:11], None, last.decision.skip_shared, last.decision.threads, 0)
    calls = {"start (every argument)": lambda: worker.start(*arguments),
             "repeat (bound once)": lambda: worker.repeat(bound, lists, False)}
    after_sleep = {name: [] for name in calls}
    gc.disable()
    for i in range(300):
        for name, call in (calls.items() if i % 2 else reversed(calls.items())):
            time.sleep(0.001)
            begin = time.perf_counter()
            call()
            after_sleep[name].append(time.perf_counter() - begin)
            worker.wait()
    gc.enable()
    print(f"the host's part of starting the call at batch {BATCH}")
    print("| call | after 1 ms asleep us (median of 300) | warm, start and wait us (best of 5 x 300) |")
    print("|---|---:|---:|")
    for name, call in calls.items():
        warm = min(timeit.repeat(lambda: (call(), worker.wait()), number=300, repeat=5)) / 300 * 1e6
        print(f"| {name} | {1e6 * np.median(after_sleep[name]):.1f} | {warm:.1f} |")


if __name__ == "__main__":
    main()
