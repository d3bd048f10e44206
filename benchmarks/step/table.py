"""The main table of benchmarks/RESULTS.md's ``vtoken bench step`` section, from a step.json:

    python benchmarks/step/table.py benchmarks/step/step.json
"""

import json
import sys


def main(path: str) -> None:
    rows = json.load(open(path))
    print("| batch | row | impl | host us/step | paired native us | added us | added runs min-max | added % | "
          "added % runs | step us | step runs | waited | table | policy | core | copy |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s = r["split_us"]
        print(f"| {r['batch']} | {r['label'].removesuffix(' ' + r['impl'])} | {r['impl']} | {r['host_us_p50']:,.0f} | {r['native_us_p50']:,.0f} | "
              f"{r['added_us_p50']:,.0f} | {r['added_us_p50_min']:,.0f} to {r['added_us_p50_max']:,.0f} | "
              f"{r['added_pct']:.1f} | {r['added_pct_min']:.1f} to {r['added_pct_max']:.1f} | {r['step_us']:,.0f} | "
              f"{r['step_us_min']:,.0f}-{r['step_us_max']:,.0f} | {r.get('waited_us', 0):,.0f} | {s['table']:,.0f} | {s['policy']:,.0f} | "
              f"{s['core']:,.0f} | {s['copy']:,.0f} |")


if __name__ == "__main__":
    main(sys.argv[1])
