"""What one operation costs the host's thread in warm caches, and right after the thread slept
1 ms (its caches, TLB and branch history left to others, as the engine's own work between two
steps leaves them): the median over alternating rounds. Shows why the step's host-thread work
counts numpy calls and Python objects rather than arithmetic.

    python benchmarks/step/cold_host/run.py > benchmarks/step/cold_host/output.txt
"""

import gc
import time
import timeit
from itertools import accumulate, chain

import numpy as np

B = 64
LISTS = tuple([] for _ in range(B))
LISTS[5].append(3)
LISTS[40].append(9)  # a decode step at batch 64: two requests cross into a new block
FLAT = np.arange(1000, dtype=np.int64)


def csr_in_numpy():  # what the engine ran before: offsets and blocks as numpy arrays
    flat = list(chain.from_iterable(LISTS))
    offsets = np.array(list(accumulate(map(len, LISTS), initial=0)), dtype=np.int64)
    return offsets, np.asarray(flat, dtype=np.int64)


def lists_as_they_are():  # what the engine passes now (the C++ core takes the lists)
    return None, LISTS


OPS = {
    "np.zeros(65)": lambda: np.zeros(B + 1, dtype=np.int64),
    "np.cumsum of 65": lambda: np.cumsum(FLAT[: B + 1]),
    "np.array(a list of 65 ints)": lambda: np.array(list(range(B + 1)), dtype=np.int64),
    "one slice of an array": lambda: FLAT[3:9],
    "twelve slices of an array": lambda: [FLAT[i : i + 5] for i in range(0, 60, 5)],
    "an empty Python call": lambda: None,
    "the batch's new blocks as numpy CSR": csr_in_numpy,
    "the batch's new blocks as lists": lists_as_they_are,
}


def main() -> None:
    cold = {name: [] for name in OPS}
    gc.disable()
    for i in range(400):
        for name, op in (OPS.items() if i % 2 else reversed(OPS.items())):
            time.sleep(0.001)
            start = time.perf_counter()
            op()
            cold[name].append(time.perf_counter() - start)
    gc.enable()
    print(f"host-thread cost of one operation at batch {B}: warm (best of 5 x 2000) and after 1 ms asleep "
          "(median of 400)")
    print("| operation | warm us | after 1 ms asleep us | ratio |")
    print("|---|---:|---:|---:|")
    for name, op in OPS.items():
        warm = min(timeit.repeat(op, number=2000, repeat=5)) / 2000 * 1e6
        after = float(np.median(cold[name])) * 1e6
        print(f"| {name} | {warm:.2f} | {after:.1f} | {after / warm:.0f}x |")


if __name__ == "__main__":
    main()
