// SPDX-License-Identifier: Apache-2.0
// The key re-rotation kernel. Layout, arithmetic and preconditions: rerotate_k.cuh.
//
// Grid: x = one slot, y = a chunk of that slot's (layer, head) rows. A thread owns rotating pairs
// (strided over rotary_dim / 2), computes each pair's cosine and sine once, and applies them to
// every row of its chunk: the trigonometry is paid once per (slot, pair, chunk), the bytes once.
#include "rerotate_k.cuh"

#include <algorithm>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

constexpr int kThreads = 64;
constexpr int64_t kRowsPerChunk = 16;

__device__ __forceinline__ double load(const float* p) { return static_cast<double>(*p); }
__device__ __forceinline__ double load(const __half* p) {
  return static_cast<double>(__half2float(*p));
}
__device__ __forceinline__ double load(const __nv_bfloat16* p) {
  return static_cast<double>(__bfloat162float(*p));
}

// double -> float -> storage type, as torch's .to(dtype) from float64 does on the host.
__device__ __forceinline__ void store(float* p, double v) { *p = __double2float_rn(v); }
__device__ __forceinline__ void store(__half* p, double v) {
  *p = __float2half_rn(__double2float_rn(v));
}
__device__ __forceinline__ void store(__nv_bfloat16* p, double v) {
  *p = __float2bfloat16_rn(__double2float_rn(v));
}

template <typename T>
__global__ void rerotate_k_kernel(T* __restrict__ pool, int64_t num_layers, int64_t num_kv_heads,
                                  int64_t tokens_per_block, int64_t head_dim, int64_t rotary_dim,
                                  int style, const float* __restrict__ inv_freq,
                                  const int64_t* __restrict__ slots,
                                  const int64_t* __restrict__ shifts) {
  const int64_t slot = slots[blockIdx.x];
  const double shift = static_cast<double>(shifts[blockIdx.x]);
  const int64_t block = slot / tokens_per_block;
  const int64_t offset = slot % tokens_per_block;
  const int64_t rows = num_layers * num_kv_heads;
  const int64_t row_begin = blockIdx.y * kRowsPerChunk;
  const int64_t row_end = row_begin + kRowsPerChunk < rows ? row_begin + kRowsPerChunk : rows;
  const int64_t half = rotary_dim / 2;
  for (int64_t i = threadIdx.x; i < half; i += blockDim.x) {
    double s, c;
    sincos(-shift * static_cast<double>(inv_freq[i]), &s, &c);
    const int64_t a = style == 0 ? i : 2 * i;         // the pair's first element
    const int64_t b = style == 0 ? i + half : 2 * i + 1;  // and its partner
    for (int64_t row = row_begin; row < row_end; ++row) {
      const int64_t layer = row / num_kv_heads;
      const int64_t head = row % num_kv_heads;
      T* k = pool + ((((block * num_layers + layer) * 2) * num_kv_heads + head) * tokens_per_block + offset) *
                        head_dim;
      const double x = load(k + a);
      const double y = load(k + b);
      // x' = x cos - y sin, y' = y cos + x sin (the specification's order of operations).
      store(k + a, __dadd_rn(__dmul_rn(x, c), __dmul_rn(-y, s)));
      store(k + b, __dadd_rn(__dmul_rn(y, c), __dmul_rn(x, s)));
    }
  }
}

template <typename T>
cudaError_t launch(void* pool, int64_t num_layers, int64_t num_kv_heads, int64_t tokens_per_block,
                   int64_t head_dim, int64_t rotary_dim, int style, const float* inv_freq,
                   const int64_t* slots, const int64_t* shifts, int64_t num_slots,
                   cudaStream_t stream) {
  const int64_t rows = num_layers * num_kv_heads;
  const int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  if (chunks > 65535) return cudaErrorInvalidValue;
  constexpr int64_t kMaxSlots = 2147483647;  // gridDim.x limit: split larger passes
  for (int64_t first = 0; first < num_slots; first += kMaxSlots) {
    const int64_t n = std::min(kMaxSlots, num_slots - first);
    dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(chunks));
    rerotate_k_kernel<T><<<grid, kThreads, 0, stream>>>(
        static_cast<T*>(pool), num_layers, num_kv_heads, tokens_per_block, head_dim, rotary_dim,
        style, inv_freq, slots + first, shifts + first);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

extern "C" cudaError_t vtoken_rerotate_k(void* pool, int dtype, int64_t num_layers,
                                         int64_t num_kv_heads, int64_t tokens_per_block,
                                         int64_t head_dim, int64_t rotary_dim, int style,
                                         const float* inv_freq, const int64_t* slots,
                                         const int64_t* shifts, int64_t num_slots,
                                         cudaStream_t stream) {
  if (num_slots < 0 || num_layers <= 0 || num_kv_heads <= 0 || tokens_per_block <= 0 ||
      head_dim <= 0 || rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim ||
      (style != 0 && style != 1)) {
    return cudaErrorInvalidValue;
  }
  if (num_slots == 0) return cudaSuccess;
  switch (dtype) {
    case 0:
      return launch<float>(pool, num_layers, num_kv_heads, tokens_per_block, head_dim, rotary_dim,
                           style, inv_freq, slots, shifts, num_slots, stream);
    case 1:
      return launch<__half>(pool, num_layers, num_kv_heads, tokens_per_block, head_dim, rotary_dim,
                            style, inv_freq, slots, shifts, num_slots, stream);
    case 2:
      return launch<__nv_bfloat16>(pool, num_layers, num_kv_heads, tokens_per_block, head_dim,
                                   rotary_dim, style, inv_freq, slots, shifts, num_slots, stream);
    default:
      return cudaErrorInvalidValue;
  }
}
