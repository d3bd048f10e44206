"""One measurement before and after a change, alternating: each round runs it in a fresh process
of the tree before, then of the tree after, each tree with its own C++ core built in it (its
``trtllm_vtoken/_native/_core*.so``), so both meet the machine at about the same moment.

    python ab.py pass  BEFORE_TREE AFTER_TREE ROUNDS > ab.jsonl   H2O's native pass alone
                                                                  (``bench/h2o_pass.py``, one thread)
    python ab.py alone BEFORE_TREE AFTER_TREE ROUNDS > ab.jsonl   the step alone, C++ core
                                                                  (``bench/step_alone.py``, 40 steps)
    python ab.py engine BEFORE_TREE AFTER_TREE ROUNDS > ab.jsonl  ``vtoken bench step``'s paired engine
                                                                  runs (20 steps): native, indirection-
                                                                  only, dense StreamingLLM
    python ab.py engine-h2o BEFORE_TREE AFTER_TREE ROUNDS > ab.jsonl  the same for dense and lazy H2O
    python ab.py engine-at-once BEFORE_TREE AFTER_TREE ROUNDS > ab.jsonl  ``engine``'s rows with the
                                                                  call at once (``cpp-at-once``)
    python ab.py schedule BEFORE_TREE AFTER_TREE ROUNDS > ab.jsonl  a native engine's step and the
                                                                  decode rows' reservation in it
    python ab.py phases BEFORE_TREE AFTER_TREE ROUNDS > ab.jsonl  an indirection-only engine's step
                                                                  beside a native one's, phase by phase
                                                                  (300 steps; see PHASES)
    python ab.py --table ab.jsonl                                 the medians of the rounds
"""

import json
import subprocess
import sys

IMPORT = """
import json, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
for name in [m for m in sys.modules if m.startswith("trtllm_vtoken")]:  # the start-up hook's import
    del sys.modules[name]
sys.path.insert(0, sys.argv[1])
import trtllm_vtoken
assert trtllm_vtoken.__file__.startswith(sys.argv[1]), trtllm_vtoken.__file__
"""
ENGINE = """
# The bench's own helpers, private there: the only names the trees before and after share.
from trtllm_vtoken.bench.step import NATIVE, StepBenchConfig, _run
cfg = StepBenchConfig(steps=20, impls=("cpp",))
rows = %(rows)s
for batch in (64, 256):
    for label, row in rows:
        out = _run(cfg, batch, row)
        print(json.dumps({"batch": batch, "label": label, **{k: out[k] for k in (
            "native_us_p50", "host_us_p50", "added_us_p50", "added_pct", "step_us")}}))
"""
"""``vtoken bench step``'s paired engine runs (20 steps) of the rows given."""
MEASURE = {
    "pass": """
from trtllm_vtoken.bench.h2o_pass import time_pass
for batch in (64, 256):
    for row in time_pass(batch, 4096, 32, threads=(1,)):
        print(json.dumps(row))
""",
    "alone": """
from trtllm_vtoken.bench.step import StepBenchConfig
from trtllm_vtoken.bench.step_alone import time_step_alone
for batch in (1, 64, 256):
    for row in time_step_alone(StepBenchConfig(steps=40, impls=("cpp",)), batch, "cpp"):
        row.pop("split_us")
        print(json.dumps(row))
""",
    "engine": ENGINE % dict(rows="""[("native", NATIVE),
        ("indirection-only", dict(variant="indirection-only", mode="dense", policy="streaming_llm", impl="cpp")),
        ("vtoken dense streaming_llm", dict(variant="vtoken", mode="dense", policy="streaming_llm", impl="cpp"))]"""),
    "engine-at-once": ENGINE % dict(rows="""[("native", NATIVE),
        ("indirection-only", dict(variant="indirection-only", mode="dense", policy="streaming_llm",
                                  impl="cpp-at-once")),
        ("vtoken dense streaming_llm", dict(variant="vtoken", mode="dense", policy="streaming_llm",
                                            impl="cpp-at-once"))]"""),
    "engine-h2o": ENGINE % dict(rows="""[
        ("vtoken dense h2o", dict(variant="vtoken", mode="dense", policy="h2o", impl="cpp")),
        ("vtoken lazy h2o", dict(variant="vtoken", mode="lazy", policy="h2o", impl="cpp"))]"""),
    "schedule": """
import gc, time
import numpy as np
from trtllm_vtoken.bench.step import NATIVE, StepBenchConfig, _prefilled, _timed_step
for batch in (64, 256):
    engine, spent = _prefilled(StepBenchConfig(steps=40), batch, NATIVE), []
    schedule = engine._schedule_decode
    def timed():
        start = time.perf_counter()
        rows = schedule()
        spent.append(1e6 * (time.perf_counter() - start))
        return rows
    engine._schedule_decode = timed
    gc.disable()
    steps = [_timed_step(engine) for _ in range(40)]
    gc.enable()
    print(json.dumps({"batch": batch, "label": "native", "host_us_p50": float(np.median(steps)),
                      "schedule_us_p50": float(np.median(spent))}))
""",
}
PHASES = """
# Both engines step in alternating order; each engine.step() is cut at the KV manager's start_step
# and finish_step (start_step's own call of finish_step passes through):
#   before  scheduling, the (simulated) forward      sample  sampling (the call beside it)
#   start   start_step: the batch to the step /       finish  finish_step: the call waited for,
#           native's block lists                              the output, the freed blocks
#   after   admission's counters, prefix caching's keys
# Per phase: the vToken engine's median and the median over the steps of (vToken - native).
import gc, time
import numpy as np
from trtllm_vtoken.bench.step import NATIVE, StepBenchConfig, _prefilled
def cut(engine):
    kv, rec, inside = engine.kv, [], [False]
    start_step, finish_step = kv.start_step, kv.finish_step
    def timed_start(*args, **kwargs):
        begin = time.perf_counter()
        inside[0] = True
        start_step(*args, **kwargs)
        inside[0] = False
        rec.append([begin, time.perf_counter()])
    def timed_finish(*args, **kwargs):
        if inside[0]:
            return finish_step(*args, **kwargs)
        begin = time.perf_counter()
        out = finish_step(*args, **kwargs)
        rec[-1] += [begin, time.perf_counter()]
        return out
    kv.start_step, kv.finish_step = timed_start, timed_finish
    return rec
for batch in (64, 256):
    cfg = StepBenchConfig(batches=(batch,), steps=320, warmup=5, impls=("cpp",))
    engines = {"native": _prefilled(cfg, batch, NATIVE), "vtoken": _prefilled(cfg, batch, dict(
        variant="indirection-only", mode="dense", policy="streaming_llm", impl="cpp"))}
    marks = {name: cut(engine) for name, engine in engines.items()}
    for engine in engines.values():
        for _ in range(5):
            engine.step()
    for rec in marks.values():
        rec.clear()
    gc.disable()
    for i in range(300):
        for name, engine in (engines.items() if i % 2 else reversed(engines.items())):
            begin = time.perf_counter()
            engine.step()
            marks[name][-1] += [begin, time.perf_counter()]
    gc.enable()
    phases = {}
    for name, rec in marks.items():
        a = np.array([r[:6] for r in rec])  # start_step in, out; finish_step in, out; step in, out
        phases[name] = dict(before=a[:, 0] - a[:, 4], start=a[:, 1] - a[:, 0], sample=a[:, 2] - a[:, 1],
                            finish=a[:, 3] - a[:, 2], after=a[:, 5] - a[:, 3], step=a[:, 5] - a[:, 4])
    mine, theirs = phases["vtoken"], phases["native"]
    for k in mine:
        print(json.dumps({"batch": batch, "label": k, "phase_us_p50": 1e6 * float(np.median(mine[k])),
                          "added_us_p50": 1e6 * float(np.median(mine[k] - theirs[k]))}))
    print(json.dumps({"batch": batch, "label": "step, added %", "phase_us_p50": float(
        100 * (np.median(mine["step"] / theirs["step"]) - 1)), "added_us_p50": 0.0}))
"""
"""``PHASES``: an indirection-only engine's host time beside a native engine's, phase by phase."""
MEASURE["phases"] = PHASES
CELL = {"pass": (("batch", "placement", "caches"), "pass_us_p50", "blocks"),
        "alone": (("batch", "label", "caches"), "step_us_p50", "row"),
        "engine": (("batch", "label"), ("native_us_p50", "added_us_p50", "added_pct"), "row"),
        "engine-at-once": (("batch", "label"), ("native_us_p50", "added_us_p50", "added_pct"), "row"),
        "engine-h2o": (("batch", "label"), ("native_us_p50", "added_us_p50", "added_pct"), "row"),
        "schedule": (("batch", "label"), ("host_us_p50", "schedule_us_p50"), "row"),
        "phases": (("batch", "label"), ("phase_us_p50", "added_us_p50"), "phase")}
"""What a row of each measurement is keyed by, its value, and the table's name for the middle key."""


def table(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    what = next(w for w, key in (("pass", "pass_us_p50"), ("alone", "step_us_p50"), ("schedule", "schedule_us_p50"),
                                 ("phases", "phase_us_p50"), ("engine", "added_us_p50")) if key in rows[0])
    keys, values, middle = CELL[what]
    values = (values,) if isinstance(values, str) else values
    cells: dict[tuple, dict[tuple, list[float]]] = {}
    for r in rows:
        for value in values:
            cells.setdefault(tuple(r[k] for k in keys), {}).setdefault((value, r["tree"]), []).append(r[value])
    unit = {"added_pct": "%"}
    header = " | ".join(f"{v.removesuffix('_p50')} before (median of rounds, min-max) | after | after / before"
                        for v in values) if len(values) > 1 else \
        "before us (median of rounds, min-max) | after us | after / before"
    print(f"| batch | {middle} | {'caches | ' if len(keys) == 3 else ''}{header} |")
    print("|---:|---|" + ("---|" if len(keys) == 3 else "") + "---:|---:|---:|" * len(values))
    for key, by in sorted(cells.items()):
        parts = []
        for value in values:
            b, a = sorted(by[(value, "before")]), sorted(by[(value, "after")])
            mb, ma = b[len(b) // 2], a[len(a) // 2]
            percent = value in unit or "%" in str(key[-1])  # e.g. the phases' "step, added %" row
            digits = 1 if percent else 0
            parts.append(f"{mb:,.{digits}f} ({b[0]:,.{digits}f}-{b[-1]:,.{digits}f}) | "
                         f"{ma:,.{digits}f} ({a[0]:,.{digits}f}-{a[-1]:,.{digits}f}) | "
                         + (f"{ma / mb:.2f}" if not percent and mb > 0 else "-"))
        print("| " + " | ".join(str(k) for k in key) + " | " + " | ".join(parts) + " |")


if __name__ == "__main__":
    if sys.argv[1] == "--table":
        table(sys.argv[2])
        sys.exit(0)
    what, before, after, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    for i in range(rounds):
        for name, tree in (("before", before), ("after", after)):
            out = subprocess.run([sys.executable, "-c", IMPORT + MEASURE[what], tree], capture_output=True, text=True,
                                 check=True)
            for line in out.stdout.splitlines():
                print(json.dumps({**json.loads(line), "tree": name, "round": i}), flush=True)
