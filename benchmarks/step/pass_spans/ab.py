"""H2O's native pass alone before and after a change, alternating: each round times
``trtllm_vtoken.bench.h2o_pass.time_pass`` (one thread, 15 calls per cell) in a fresh process of
the tree before, then of the tree after, each tree with its own C++ core built in it.

    python ab.py BEFORE_TREE AFTER_TREE ROUNDS > ab.jsonl   (then: python ab.py --table ab.jsonl)
"""

import json
import subprocess
import sys

CHILD = """
import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
for name in [m for m in sys.modules if m.startswith("trtllm_vtoken")]:  # the start-up hook's import
    del sys.modules[name]
sys.path.insert(0, sys.argv[1])
import trtllm_vtoken
assert trtllm_vtoken.__file__.startswith(sys.argv[1]), trtllm_vtoken.__file__
from trtllm_vtoken.bench.h2o_pass import time_pass
for batch in (64, 256):
    for row in time_pass(batch, 4096, 32, threads=(1,)):
        print(json.dumps(row))
"""


def table(path: str) -> None:
    cells: dict[tuple, dict[str, list[float]]] = {}
    for line in open(path):
        r = json.loads(line)
        key = (r["batch"], r["placement"], r["caches"])
        cells.setdefault(key, {}).setdefault(r["tree"], []).append(r["pass_us_p50"])
    print("| batch | blocks | caches | before us (median of rounds, min-max) | after us | after / before |")
    print("|---:|---|---|---:|---:|---:|")
    for (batch, placement, caches), by in sorted(cells.items()):
        b, a = sorted(by["before"]), sorted(by["after"])
        mb, ma = b[len(b) // 2], a[len(a) // 2]
        print(f"| {batch} | {placement} | {caches} | {mb:,.0f} ({b[0]:,.0f}-{b[-1]:,.0f}) | "
              f"{ma:,.0f} ({a[0]:,.0f}-{a[-1]:,.0f}) | {ma / mb:.2f} |")


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        table(sys.argv[2])
        sys.exit(0)
    before, after, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    for i in range(rounds):
        for name, tree in (("before", before), ("after", after)):
            out = subprocess.run([sys.executable, "-c", CHILD, tree], capture_output=True, text=True, check=True)
            for line in out.stdout.splitlines():
                print(json.dumps({**json.loads(line), "tree": name, "round": i}), flush=True)
