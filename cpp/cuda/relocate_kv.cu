// SPDX-License-Identifier: Apache-2.0
// The relocation kernel. Layout, addressing and preconditions: relocate_kv.cuh.
//
// Grid: x = one move, y = a chunk of that move's (row, vector) pairs. Each thread copies
// `Vec`-sized pieces with a grid-stride loop over the chunk; a warp reads row_bytes-long
// contiguous runs (256 B for head_dim 128 in bf16), so loads and stores stay coalesced.
#include "relocate_kv.cuh"

#include <algorithm>

namespace {

constexpr int kThreads = 256;
constexpr int kVecsPerThread = 4;  // work per thread and y-chunk before another chunk is worth it

template <typename Vec>
__global__ void relocate_kv_kernel(char* __restrict__ pool, int64_t rows_per_block,
                                   int64_t tokens_per_block, int64_t row_vecs,
                                   const int64_t* __restrict__ src_slots,
                                   const int64_t* __restrict__ dst_slots, int64_t chunk) {
  const int64_t move = blockIdx.x;
  const int64_t src = src_slots[move];
  const int64_t dst = dst_slots[move];
  // Vector (row, i) of a slot sits at ((block * R + row) * tpb + offset) * row_vecs + i.
  const int64_t src_base = (src / tokens_per_block) * rows_per_block * tokens_per_block + src % tokens_per_block;
  const int64_t dst_base = (dst / tokens_per_block) * rows_per_block * tokens_per_block + dst % tokens_per_block;
  Vec* vecs = reinterpret_cast<Vec*>(pool);
  const int64_t total = rows_per_block * row_vecs;
  const int64_t begin = blockIdx.y * chunk;
  const int64_t end = begin + chunk < total ? begin + chunk : total;
  // rows_per_block * row_vecs is small (a block's worth of one token), so 32-bit division suffices.
  const auto vecs_per_row = static_cast<uint32_t>(row_vecs);
  for (int64_t k = begin + threadIdx.x; k < end; k += blockDim.x) {
    const uint32_t row = static_cast<uint32_t>(k) / vecs_per_row;
    const int64_t i = static_cast<uint32_t>(k) - row * vecs_per_row;
    const int64_t row_offset = row * tokens_per_block;
    vecs[(dst_base + row_offset) * row_vecs + i] = vecs[(src_base + row_offset) * row_vecs + i];
  }
}

template <typename Vec>
cudaError_t launch(void* pool, int64_t rows_per_block, int64_t tokens_per_block, int64_t row_bytes,
                   const int64_t* src, const int64_t* dst, int64_t num_moves, cudaStream_t stream) {
  const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t total = rows_per_block * row_vecs;
  if (total > UINT32_MAX) return cudaErrorInvalidValue;
  const int64_t per_block = static_cast<int64_t>(kThreads) * kVecsPerThread;
  const int64_t chunks = std::min<int64_t>((total + per_block - 1) / per_block, 65535);
  const int64_t chunk = (total + chunks - 1) / chunks;
  // gridDim.x is limited to 2^31 - 1 moves per launch; split larger plans.
  constexpr int64_t kMaxMoves = 2147483647;
  for (int64_t first = 0; first < num_moves; first += kMaxMoves) {
    const int64_t n = std::min(kMaxMoves, num_moves - first);
    dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(chunks));
    relocate_kv_kernel<Vec><<<grid, kThreads, 0, stream>>>(
        static_cast<char*>(pool), rows_per_block, tokens_per_block, row_vecs, src + first,
        dst + first, chunk);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

extern "C" cudaError_t vtoken_relocate_kv(void* pool, int64_t rows_per_block,
                                          int64_t tokens_per_block, int64_t row_bytes,
                                          const int64_t* src_slots, const int64_t* dst_slots,
                                          int64_t num_moves, cudaStream_t stream) {
  if (num_moves < 0 || rows_per_block <= 0 || tokens_per_block <= 0 || row_bytes <= 0 ||
      row_bytes % 2 != 0) {
    return cudaErrorInvalidValue;
  }
  if (num_moves == 0) return cudaSuccess;
  const auto address = reinterpret_cast<uintptr_t>(pool);
  if (row_bytes % 16 == 0 && address % 16 == 0) {
    return launch<uint4>(pool, rows_per_block, tokens_per_block, row_bytes, src_slots, dst_slots,
                         num_moves, stream);
  }
  if (row_bytes % 4 == 0 && address % 4 == 0) {
    return launch<uint32_t>(pool, rows_per_block, tokens_per_block, row_bytes, src_slots,
                            dst_slots, num_moves, stream);
  }
  return launch<uint16_t>(pool, rows_per_block, tokens_per_block, row_bytes, src_slots, dst_slots,
                          num_moves, stream);
}

// 2: the library also exports vtoken_rerotate_k (rerotate_k.cu).
extern "C" int vtoken_relocate_kv_abi_version() { return 2; }
