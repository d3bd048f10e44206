// SPDX-License-Identifier: Apache-2.0
// Validation and micro-benchmark of the key re-rotation kernel, in one program:
//
//   1. validation: random pools (fp32, fp16, bf16; neox and gptj pairs; full and partial rotary
//      dimensions; odd head counts), random distinct slots with random shifts. The CPU reference
//      does the specification's arithmetic (double angle, cosine and sine; separately rounded
//      products; double -> float -> storage). Every rotated element must match it to 1 unit in the
//      last place of the storage type (the device and host cosines may differ in their last bit);
//      every other byte of the pool (V, unselected slots, dimensions past rotary_dim) must be
//      unchanged, bit for bit. A second check turns keys by d and then by -d and compares with the
//      originals within a few units in the last place.
//   2. benchmark: Llama-3.1-8B KV shapes (32 layers, 8 KV heads, head_dim 128, bf16,
//      tokens_per_block 32), passes of 256 to 16384 slots; bandwidth counts each key read and
//      written once, next to a device-to-device cudaMemcpyAsync of the same bytes.
//
// Usage: rerotate_k_check [--quick]. Exit code 0 only if every validation passed.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "check_common.cuh"
#include "rerotate_k.cuh"

namespace {

struct Shape {
  int64_t blocks, layers, heads, tpb, head_dim, rotary_dim;
  int style;  // 0 neox, 1 gptj
  int64_t elements() const { return blocks * layers * 2 * heads * tpb * head_dim; }
  int64_t slots() const { return blocks * tpb; }
  int64_t at(int64_t slot, int64_t layer, int64_t field, int64_t head, int64_t j) const {
    const int64_t block = slot / tpb, offset = slot % tpb;
    return ((((block * layers + layer) * 2 + field) * heads + head) * tpb + offset) * head_dim + j;
  }
};

// Host twins of the storage types: float <-> bits, round to nearest even like the device.
struct F32 {
  using T = float;
  static constexpr int code = 0;
  static constexpr const char* name = "fp32";
  static double to_double(T v) { return v; }
  static T from_double(double v) { return static_cast<float>(v); }
  static int64_t ulps(T a, T b) {
    int32_t x, y;
    std::memcpy(&x, &a, 4);
    std::memcpy(&y, &b, 4);
    if (x < 0) x = INT32_MIN - x;
    if (y < 0) y = INT32_MIN - y;
    return std::llabs(static_cast<int64_t>(x) - y);
  }
};
struct F16 {
  using T = __half;
  static constexpr int code = 1;
  static constexpr const char* name = "fp16";
  static double to_double(T v) { return __half2float(v); }
  static T from_double(double v) { return __float2half_rn(static_cast<float>(v)); }
  static int64_t ulps(T a, T b) {
    int16_t x, y;
    std::memcpy(&x, &a, 2);
    std::memcpy(&y, &b, 2);
    int32_t u = x < 0 ? INT16_MIN - x : x, w = y < 0 ? INT16_MIN - y : y;
    return std::llabs(static_cast<int64_t>(u) - w);
  }
};
struct BF16 {
  using T = __nv_bfloat16;
  static constexpr int code = 2;
  static constexpr const char* name = "bf16";
  static double to_double(T v) { return __bfloat162float(v); }
  static T from_double(double v) { return __float2bfloat16_rn(static_cast<float>(v)); }
  static int64_t ulps(T a, T b) { return F16::ulps(*reinterpret_cast<__half*>(&a), *reinterpret_cast<__half*>(&b)); }
};

std::vector<float> inv_freq_of(const Shape& s) {
  std::vector<float> f(s.rotary_dim / 2);
  for (int64_t i = 0; i < s.rotary_dim / 2; ++i) {
    f[i] = static_cast<float>(1.0 / std::pow(10000.0, 2.0 * i / s.rotary_dim));
  }
  return f;
}

template <typename D>
void reference(const Shape& s, std::vector<typename D::T>& pool, const std::vector<float>& inv_freq,
               const std::vector<int64_t>& slots, const std::vector<int64_t>& shifts) {
  const int64_t half = s.rotary_dim / 2;
  for (size_t n = 0; n < slots.size(); ++n) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = -static_cast<double>(shifts[n]) * static_cast<double>(inv_freq[i]);
      const double c = std::cos(angle), sn = std::sin(angle);
      const int64_t a = s.style == 0 ? i : 2 * i, b = s.style == 0 ? i + half : 2 * i + 1;
      for (int64_t layer = 0; layer < s.layers; ++layer) {
        for (int64_t head = 0; head < s.heads; ++head) {
          auto& x = pool[s.at(slots[n], layer, 0, head, a)];
          auto& y = pool[s.at(slots[n], layer, 0, head, b)];
          const double xv = D::to_double(x), yv = D::to_double(y);
          const double xc = xv * c, ys = -yv * sn, yc = yv * c, xs = xv * sn;
          x = D::from_double(xc + ys);
          y = D::from_double(yc + xs);
        }
      }
    }
  }
}

template <typename D>
void run_kernel(const Shape& s, typename D::T* pool, const float* d_freq, const int64_t* d_slots,
                const int64_t* d_shifts, int64_t n) {
  CUDA_CHECK(vtoken_rerotate_k(pool, D::code, s.layers, s.heads, s.tpb, s.head_dim, s.rotary_dim,
                               s.style, d_freq, d_slots, d_shifts, n, nullptr));
}

template <typename D>
bool validate(const Shape& s, int64_t count, std::mt19937_64& rng) {
  using T = typename D::T;
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<T> host(s.elements());
  for (auto& v : host) v = D::from_double(normal(rng));
  std::vector<int64_t> slots(s.slots());
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(count);
  std::uniform_int_distribution<int64_t> pick(1, 5000);
  std::vector<int64_t> shifts(count), back(count);
  for (int64_t i = 0; i < count; ++i) {
    shifts[i] = pick(rng);
    back[i] = -shifts[i];
  }
  const std::vector<float> freq = inv_freq_of(s);
  T* pool;
  float* d_freq;
  int64_t *d_slots, *d_shifts, *d_back;
  CUDA_CHECK(cudaMalloc(&pool, host.size() * sizeof(T)));
  CUDA_CHECK(cudaMalloc(&d_freq, freq.size() * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&d_slots, count * sizeof(int64_t)));
  CUDA_CHECK(cudaMalloc(&d_shifts, count * sizeof(int64_t)));
  CUDA_CHECK(cudaMalloc(&d_back, count * sizeof(int64_t)));
  CUDA_CHECK(cudaMemcpy(pool, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(d_freq, freq.data(), freq.size() * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(d_slots, slots.data(), count * sizeof(int64_t), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(d_shifts, shifts.data(), count * sizeof(int64_t), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(d_back, back.data(), count * sizeof(int64_t), cudaMemcpyHostToDevice));
  run_kernel<D>(s, pool, d_freq, d_slots, d_shifts, count);
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<T> got(host.size());
  CUDA_CHECK(cudaMemcpy(got.data(), pool, host.size() * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<T> expected = host;
  reference<D>(s, expected, freq, slots, shifts);
  // Rotated elements: within 1 ulp of the reference. Everything else: bit for bit.
  std::vector<char> rotated(host.size(), 0);
  for (int64_t slot : slots)
    for (int64_t l = 0; l < s.layers; ++l)
      for (int64_t h = 0; h < s.heads; ++h)
        for (int64_t j = 0; j < s.rotary_dim; ++j) rotated[s.at(slot, l, 0, h, j)] = 1;
  int64_t off_by_one = 0, wrong = 0;
  for (size_t i = 0; i < host.size(); ++i) {
    const int64_t d = D::ulps(got[i], expected[i]);
    if (rotated[i]) {
      off_by_one += d == 1;
      wrong += d > 1;
    } else {
      wrong += std::memcmp(&got[i], &host[i], sizeof(T)) != 0;
    }
  }
  // Turning back by -d returns to the original keys within a few ulps (two roundings each way).
  run_kernel<D>(s, pool, d_freq, d_slots, d_back, count);
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(got.data(), pool, host.size() * sizeof(T), cudaMemcpyDeviceToHost));
  double worst = 0;
  for (size_t i = 0; i < host.size(); ++i) {
    worst = std::max(worst, std::fabs(D::to_double(got[i]) - D::to_double(host[i])));
  }
  const double tolerance = D::code == 0 ? 1e-5 : D::code == 1 ? 1e-2 : 6e-2;
  const bool ok = wrong == 0 && worst <= tolerance;
  std::printf("validate %s %s layers=%lld heads=%lld tpb=%lld dim=%lld/%lld slots=%-5lld %s "
              "(%lld elements 1 ulp off, %lld wrong, round trip max error %.2e)\n",
              D::name, s.style == 0 ? "neox" : "gptj", (long long)s.layers, (long long)s.heads,
              (long long)s.tpb, (long long)s.rotary_dim, (long long)s.head_dim, (long long)count,
              ok ? "ok" : "FAIL", (long long)off_by_one, (long long)wrong, worst);
  CUDA_CHECK(cudaFree(pool));
  CUDA_CHECK(cudaFree(d_freq));
  CUDA_CHECK(cudaFree(d_slots));
  CUDA_CHECK(cudaFree(d_shifts));
  CUDA_CHECK(cudaFree(d_back));
  return ok;
}

void benchmark(const Shape& s, const std::vector<int64_t>& counts, int reps) {
  std::mt19937_64 rng(7);
  __nv_bfloat16* pool;
  unsigned char* scratch;
  const int64_t max_count = *std::max_element(counts.begin(), counts.end());
  const int64_t key_bytes = s.layers * s.heads * s.head_dim * 2;  // one token's K, bf16
  CUDA_CHECK(cudaMalloc(&pool, s.elements() * 2));
  CUDA_CHECK(cudaMalloc(&scratch, 2 * max_count * key_bytes));
  CUDA_CHECK(cudaMemset(pool, 0x3c, s.elements() * 2));
  CUDA_CHECK(cudaMemset(scratch, 0x3c, 2 * max_count * key_bytes));
  const std::vector<float> freq = inv_freq_of(s);
  float* d_freq;
  int64_t *d_slots, *d_shifts;
  CUDA_CHECK(cudaMalloc(&d_freq, freq.size() * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&d_slots, max_count * sizeof(int64_t)));
  CUDA_CHECK(cudaMalloc(&d_shifts, max_count * sizeof(int64_t)));
  CUDA_CHECK(cudaMemcpy(d_freq, freq.data(), freq.size() * sizeof(float), cudaMemcpyHostToDevice));
  std::printf("\n%-8s %-10s %-12s %-12s %-12s %-12s %-8s\n", "slots", "MiB keys", "kernel us",
              "kernel GB/s", "memcpy us", "memcpy GB/s", "ratio");
  for (int64_t count : counts) {
    std::vector<int64_t> slots(s.slots());
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    slots.resize(count);
    std::vector<int64_t> shifts(count, 32);
    CUDA_CHECK(cudaMemcpy(d_slots, slots.data(), count * sizeof(int64_t), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_shifts, shifts.data(), count * sizeof(int64_t), cudaMemcpyHostToDevice));
    const int64_t bytes = count * key_bytes;  // read once and written once by both
    float kernel_ms = median_ms([&] { run_kernel<BF16>(s, pool, d_freq, d_slots, d_shifts, count); }, reps);
    float copy_ms = median_ms([&] {
      CUDA_CHECK(cudaMemcpyAsync(scratch + bytes, scratch, bytes, cudaMemcpyDeviceToDevice));
    }, reps);
    const double kernel_gbs = 2.0 * bytes / (kernel_ms * 1e6), copy_gbs = 2.0 * bytes / (copy_ms * 1e6);
    std::printf("%-8lld %-10.1f %-12.1f %-12.1f %-12.1f %-12.1f %-8.3f\n", (long long)count,
                bytes / 1048576.0, kernel_ms * 1e3, kernel_gbs, copy_ms * 1e3, copy_gbs,
                kernel_gbs / copy_gbs);
  }
  CUDA_CHECK(cudaFree(pool));
  CUDA_CHECK(cudaFree(scratch));
  CUDA_CHECK(cudaFree(d_freq));
  CUDA_CHECK(cudaFree(d_slots));
  CUDA_CHECK(cudaFree(d_shifts));
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  std::mt19937_64 rng(4321);
  bool ok = true;
  // {blocks, layers, kv heads, tokens_per_block, head_dim, rotary_dim, style}
  const Shape checks[] = {
      {16, 2, 2, 4, 16, 16, 0},    // the tiny test model
      {24, 30, 3, 16, 64, 64, 0},  // SmolLM2-135M
      {12, 4, 8, 32, 128, 128, 1}, // gptj pairs, head_dim 128
      {20, 3, 5, 16, 80, 40, 0},   // partial rotary (half the head), odd head count
      {20, 3, 1, 48, 64, 32, 1},   // partial rotary, gptj
  };
  for (const Shape& s : checks) {
    for (int64_t count : {int64_t(1), int64_t(29), s.slots() / 2}) {
      ok &= validate<F32>(s, count, rng);
      ok &= validate<F16>(s, count, rng);
      ok &= validate<BF16>(s, count, rng);
    }
  }
  std::printf("validation: %s\n", ok ? "PASS" : "FAIL");
  const Shape llama{quick ? 1024 : 4096, 32, 8, 32, 128, 128, 0};
  std::printf("\nbenchmark: Llama-3.1-8B keys (bf16, tpb 32), pool %.1f GiB, %lld KiB of K per token\n",
              llama.elements() * 2 / 1073741824.0, (long long)(llama.layers * llama.heads * llama.head_dim * 2 / 1024));
  benchmark(llama, {256, 1024, 4096, 16384}, quick ? 10 : 30);
  return ok ? 0 : 1;
}
