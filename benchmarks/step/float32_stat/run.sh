#!/usr/bin/env bash
# H2O's statistic in float64 (a0072ed) against float32 (9e7f9fa), alternating fresh processes,
# each tree with its own C++ core (pip wheel of the tree, its _core*.so copied into it).
# Run from anywhere; writes pass.jsonl / engine_h2o.jsonl and their tables beside this script
# (or into OUT).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(git -C "$here" rev-parse --show-toplevel)
python=${PYTHON:-$repo/.venv/bin/python}
work=${WORK:-/tmp/float32_stat}
out=${OUT:-$here}
mkdir -p "$work" "$out"
for spec in before:a0072ed after:9e7f9fa; do
  name=${spec%%:*}; rev=${spec#*:}; tree=$work/$name
  [ -d "$tree" ] || git -C "$repo" worktree add -f "$tree" "$rev" >/dev/null
  rm -rf "$work/wheel_$name"
  "$python" -m pip wheel -q --no-deps "$tree" -w "$work/wheel_$name"
  (cd "$work/wheel_$name" && "$python" -m zipfile -e ./*.whl x && cp x/trtllm_vtoken/_native/_core*.so "$tree/trtllm_vtoken/_native/")
done
"$python" "$repo/benchmarks/step/ab.py" pass "$work/before" "$work/after" 5 > "$out/pass.jsonl"
"$python" "$repo/benchmarks/step/ab.py" engine-h2o "$work/before" "$work/after" 3 > "$out/engine_h2o.jsonl"
for m in pass engine_h2o; do "$python" "$repo/benchmarks/step/ab.py" --table "$out/$m.jsonl" > "$out/$m.md"; done
