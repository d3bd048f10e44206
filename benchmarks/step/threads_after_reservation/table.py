"""The alternating runs of run.sh side by side: per batch and row, the three rounds' added us and
added % (each round's value is its median run of 3), one thread against automatic threads.

    python table.py   (in this folder)
"""

import json
from pathlib import Path

here = Path(__file__).parent
cells: dict[tuple, dict[str, list[tuple[float, float]]]] = {}
for path in sorted(here.glob("b*_round*_threads*/step.json")):
    threads = "1" if path.parent.name.endswith("threads1") else "auto"
    for row in json.loads(path.read_text()):
        key = (row["batch"], row["label"])
        cells.setdefault(key, {}).setdefault(threads, []).append((row["added_us_p50"], row["added_pct"]))


def cell(values: list[float], digits: int) -> str:
    values = sorted(values)
    return f"{values[len(values) // 2]:,.{digits}f} ({values[0]:,.{digits}f} to {values[-1]:,.{digits}f})"


print("| batch | row | added us, 1 thread (median of rounds, min to max) | added us, automatic | "
      "added %, 1 thread | added %, automatic |")
print("|---:|---|---:|---:|---:|---:|")
for (batch, label), by in sorted(cells.items()):
    one, auto = by["1"], by["auto"]
    print(f"| {batch} | {label} | {cell([u for u, _ in one], 0)} | {cell([u for u, _ in auto], 0)} | "
          f"{cell([p for _, p in one], 1)} | {cell([p for _, p in auto], 1)} |")
