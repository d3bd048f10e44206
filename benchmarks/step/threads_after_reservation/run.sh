#!/usr/bin/env bash
# Alternating runs of bench step at one batch size (BATCH=64 or 256), C++ core, H2O's pass on one
# thread and on automatic threads (the cores, up to 4: two on the 2-core VM). Usage: BATCH=256 run.sh
set -e
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."  # the repository root
for round in 1 2 3; do
  for threads in 1 0; do
    .venv/bin/vtoken bench step --batches $BATCH --impl cpp --repeats 3 --steps 20 --threads $threads \
      --out benchmarks/step/threads_after_reservation/b${BATCH}_round${round}_threads${threads} \
      > benchmarks/step/threads_after_reservation/b${BATCH}_round${round}_threads${threads}.txt 2>&1
  done
done
