#!/usr/bin/env bash
# Everything GPU-specific, in one run on a CUDA machine (e.g. a lent H200):
#   1. build cpp/ (the CUDA relocation kernel) for the local GPU
#   2. relocate_kv_check, rerotate_k_check: each kernel against its CPU reference, then its
#      bandwidth vs memcpy
#   3. every CUDA test (graph replay after an offset rewrite, delayed side-stream copy + event,
#      kernel bit-exactness, key re-rotation kernel vs its torch reference, CUDA vs CPU and graph
#      vs eager engines, shift vs keep positions on CUDA, a background lazy copy the forward does
#      not wait for)
#   4. vtoken bench gpu: copy bandwidth, eager vs graph decode, every variant end to end (each
#      through the one batched step: vtoken info says which core serves it) under the overlap
#      scheduler, shift positions among them; native and vtoken dense also in the plain order
#   5. vtoken bench step: the step's host time per decode step against native, C++ (its fused
#      decode call on the step's worker beside sampling), C++ with that call at once on the
#      engine's thread (cpp-at-once) and Python, on this machine's quieter cores
#      (the C++ core is built in place when nanobind is there), then the step alone with caches
#      warm and flushed and H2O's pass alone; again with H2O's pass over up to 4 threads; then
#      under the overlap scheduler with a 2 ms simulated forward (cpp-at-once-overlap, cpp-overlap)
#   6. H2O's attention mass on the TensorRT-LLM path: the Triton kernels compiled, against their
#      torch specification (tests/integration/test_mass_triton.py, -m cuda); a batch's mass
#      enqueued behind a forward in flight and read back behind the next one under
#      torch.cuda.set_sync_debug_mode("error") (test_mass_copy_stream.py); the kernels timed
#      against torch's flash SDPA of the same shapes, with their peak memory (vtoken bench trtllm-mass)
#   7. where tensorrt_llm imports and the package is installed (the gpu Docker image) and
#      $VTOKEN_TRTLLM_MODEL names a model folder: examples/trtllm/run_llm.py --check
# Usage: scripts/gpu_checks.sh [STEP ...], STEP one of: build core checks cuda-tests bench-gpu
# bench-step mass trtllm (default: all, in that order; the environment is always recorded). A
# step run without the build uses the relocation library an earlier build left, if any.
# Uses the machine's python3 and its torch; the repository is put on PYTHONPATH, nothing is
# installed. Logs and JSON go to $GPU_CHECKS_LOGS (default out/gpu); where $OUT is set (a lent
# device machine, which returns at most 8 files from it) they are packed into
# $OUT/gpu_checks.tar.gz after every step, so a run cut off by its limit returns the steps it
# finished. Exit status 1 if any step failed, 2 for an unknown step.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
all="build core checks cuda-tests bench-gpu bench-step mass trtllm"
for step in "$@"; do
  [[ " $all " == *" $step "* ]] || { echo "unknown step '$step' (steps: $all)"; exit 2; }
done
steps=" ${*:-$all} "
want() { [[ $steps == *" $1 "* ]]; }
out=${GPU_CHECKS_LOGS:-out/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
status=0
pack() { if [ -n "${OUT:-}" ]; then tar czf "$OUT/gpu_checks.tar.gz" -C "$out" .; fi; }
banner() { pack; echo; echo "=== $* ($(date +%T))"; }

banner environment
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  nvcc --version | tail -1
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  $py -c "import triton; print('triton', triton.__version__)"
  echo "steps:$steps"
} 2>&1 | tee "$out/environment.txt"
if [ -f build/gpu/libvtoken_relocate.so ]; then export VTOKEN_RELOCATE_LIB=$PWD/build/gpu/libvtoken_relocate.so; fi

if want build; then
  banner build
  arch=$($py -c "import torch; print('%d%d' % torch.cuda.get_device_capability())")
  generator=$(command -v ninja >/dev/null && echo "-G Ninja")
  if cmake -S cpp -B build/gpu $generator -DCMAKE_CUDA_ARCHITECTURES="$arch-real" -DVTOKEN_NATIVE_CORE=OFF >/dev/null \
      && cmake --build build/gpu -j "$(nproc)"; then
    export VTOKEN_RELOCATE_LIB=$PWD/build/gpu/libvtoken_relocate.so
  else
    echo "build failed: the tests and benchmark run with torch-indexing copies"; status=1
  fi
fi

if want core; then
  banner "C++ core for the step"
  # The step runs on the host: build the nanobind core in place if this machine can, so the engine
  # runs are timed with it (the Python core serves otherwise, and vtoken info says so).
  generator=$(command -v ninja >/dev/null && echo "-G Ninja")
  if nb_dir=$($py -m nanobind --cmake_dir 2>/dev/null) \
      && cmake -S cpp -B build/core $generator -DVTOKEN_CUDA=OFF -Dnanobind_DIR="$nb_dir" \
           -DPython_EXECUTABLE="$(command -v $py)" >/dev/null \
      && cmake --build build/core -j "$(nproc)" >/dev/null; then
    cp build/core/_core*.so trtllm_vtoken/_native/
  else
    echo "no nanobind here: the step runs on the Python core"
  fi
  $py -m trtllm_vtoken.cli info 2>&1 | tee "$out/info.txt"
fi

if want checks; then
  for check in relocate_kv_check rerotate_k_check; do
    banner $check
    if [ -x build/gpu/$check ]; then
      timeout 90 build/gpu/$check 2>&1 | tee "$out/$check.txt" || status=1
    else
      echo "not built (the build step builds it)"; status=1
    fi
  done
fi

if want cuda-tests; then
  banner CUDA tests
  timeout 180 $py -m pytest -q -m cuda tests/runtime tests/reclaim tests/step -p no:cacheprovider 2>&1 \
    | tee "$out/cuda_tests.txt" || status=1
fi

if want bench-gpu; then
  banner vtoken bench gpu
  timeout 420 $py -m trtllm_vtoken.cli bench gpu --out "$out" 2>&1 | tee "$out/bench_gpu.txt" || status=1
fi

if want bench-step; then
  banner vtoken bench step
  timeout 240 $py -m trtllm_vtoken.cli bench step --steps 10 --repeats 2 --impl cpp,cpp-at-once,python --out "$out" 2>&1 \
    | tee "$out/bench_step.txt" || status=1
  # The step under the overlap scheduler, in the shadow of a 2 ms forward (the TensorRT-LLM manager's order)
  timeout 150 $py -m trtllm_vtoken.cli bench step --steps 10 --repeats 2 --impl cpp-at-once,cpp-at-once-overlap,cpp-overlap \
    --forward-us 2000 --out "$out/step_overlap" 2>&1 | tee "$out/bench_step_overlap.txt" || status=1
  # H2O's native pass on one thread, against the rows above (the default: the cores, up to 4)
  timeout 120 $py -m trtllm_vtoken.cli bench step --steps 10 --repeats 2 --impl cpp --threads 1 --out "$out/step_threads" \
    2>&1 | tee "$out/bench_step_threads.txt" || status=1
fi

if want mass; then
  banner "H2O's attention mass: Triton kernels"
  timeout 180 $py -m pytest -q -m cuda tests/integration/test_mass_triton.py tests/integration/test_mass_copy_stream.py \
    -p no:cacheprovider 2>&1 \
    | tee "$out/mass_kernel_tests.txt" || status=1
  timeout 180 $py -m trtllm_vtoken.cli bench trtllm-mass --device cuda --batch 64 --context 4096 \
    --prompts 512,2048,8192,32768 --prompt-dtypes bfloat16 --rounds 3 --out "$out/trtllm_mass" 2>&1 \
    | tee "$out/bench_trtllm_mass.txt" || status=1
fi

if want trtllm; then
  banner "TensorRT-LLM check"
  if $py -c "import tensorrt_llm" >/dev/null 2>&1 && [ -n "${VTOKEN_TRTLLM_MODEL:-}" ]; then
    timeout 600 $py examples/trtllm/run_llm.py "$VTOKEN_TRTLLM_MODEL" --check 2>&1 | tee "$out/trtllm_check.txt" \
      || status=1
  else
    echo "skipped: needs tensorrt_llm 1.2.1 (the gpu Docker image) and VTOKEN_TRTLLM_MODEL (a model folder)"
  fi
fi

banner "done: status $status"
exit $status
