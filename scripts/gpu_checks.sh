#!/usr/bin/env bash
# Everything GPU-specific, in one run on a CUDA machine (e.g. a lent H200):
#   1. build cpp/ (the CUDA relocation kernel) for the local GPU
#   2. relocate_kv_check, rerotate_k_check: each kernel against its CPU reference, then its
#      bandwidth vs memcpy
#   3. every CUDA test (graph replay after an offset rewrite, delayed side-stream copy + event,
#      kernel bit-exactness, key re-rotation kernel vs its torch reference, CUDA vs CPU and graph
#      vs eager engines, shift vs keep positions on CUDA)
#   4. vtoken bench gpu: copy bandwidth, eager vs graph decode, every variant end to end
# Uses the machine's python3 and its torch; the repository is put on PYTHONPATH, nothing is
# installed. Logs and gpu.json go to $OUT (default out/gpu). Exit status 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
status=0
banner() { echo; echo "=== $* ($(date +%T))"; }

banner environment
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  nvcc --version | tail -1
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
} 2>&1 | tee "$out/environment.txt"

banner build
arch=$($py -c "import torch; print('%d%d' % torch.cuda.get_device_capability())")
generator=$(command -v ninja >/dev/null && echo "-G Ninja")
if cmake -S cpp -B build/gpu $generator -DCMAKE_CUDA_ARCHITECTURES="$arch-real" -DVTOKEN_NATIVE_CORE=OFF >/dev/null \
    && cmake --build build/gpu -j "$(nproc)"; then
  export VTOKEN_RELOCATE_LIB=$PWD/build/gpu/libvtoken_relocate.so
else
  echo "build failed: the tests and benchmark run with torch-indexing copies"; status=1
fi

banner relocate_kv_check
if [ -x build/gpu/relocate_kv_check ]; then
  timeout 90 build/gpu/relocate_kv_check 2>&1 | tee "$out/relocate_kv_check.txt" || status=1
fi

banner rerotate_k_check
if [ -x build/gpu/rerotate_k_check ]; then
  timeout 90 build/gpu/rerotate_k_check 2>&1 | tee "$out/rerotate_k_check.txt" || status=1
fi

banner CUDA tests
timeout 180 $py -m pytest -q -m cuda tests/runtime tests/reclaim -p no:cacheprovider 2>&1 \
  | tee "$out/cuda_tests.txt" || status=1

banner vtoken bench gpu
timeout 420 $py -m trtllm_vtoken.cli bench gpu --out "$out" 2>&1 | tee "$out/bench_gpu.txt" || status=1

banner "done: status $status"
exit $status
