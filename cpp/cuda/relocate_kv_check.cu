// SPDX-License-Identifier: Apache-2.0
// Validation and micro-benchmark of the relocation kernel, in one program:
//
//   1. validation: random plans on small pools of several vector widths (fp32, fp16/bf16 head
//      dims, and odd row sizes that take the 4- and 2-byte paths); every byte of the pool after
//      the kernel must equal the CPU reference, which applies the moves one by one.
//   2. benchmark: Llama-3.1-8B KV shapes (32 layers, 8 KV heads, head_dim 128, bf16,
//      tokens_per_block 32), plans of 256 to 16384 moves; the kernel's bandwidth (bytes read +
//      written) next to a plain device-to-device cudaMemcpyAsync of the same byte count.
//
// Usage: relocate_kv_check [--quick]. Exit code 0 only if every validation passed.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "check_common.cuh"
#include "relocate_kv.cuh"

namespace {

struct Shape {
  int64_t num_blocks, rows_per_block, tokens_per_block, row_bytes;
  int64_t block_bytes() const { return rows_per_block * tokens_per_block * row_bytes; }
  int64_t bytes() const { return num_blocks * block_bytes(); }
  int64_t slots() const { return num_blocks * tokens_per_block; }
};

// A plan in the form the planner produces: distinct destinations, no destination is a source.
void random_plan(const Shape& s, int64_t moves, std::mt19937_64& rng, std::vector<int64_t>& src,
                 std::vector<int64_t>& dst) {
  std::vector<int64_t> slots(s.slots());
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  dst.assign(slots.begin(), slots.begin() + moves);
  src.resize(moves);
  std::uniform_int_distribution<int64_t> pick(moves, s.slots() - 1);
  for (auto& x : src) x = slots[pick(rng)];  // sources may repeat (a token copied twice is fine)
}

void reference(const Shape& s, std::vector<unsigned char>& pool, const std::vector<int64_t>& src,
               const std::vector<int64_t>& dst) {
  const int64_t tpb = s.tokens_per_block;
  for (size_t m = 0; m < src.size(); ++m) {
    for (int64_t row = 0; row < s.rows_per_block; ++row) {
      auto at = [&](int64_t slot) {
        return ((slot / tpb * s.rows_per_block + row) * tpb + slot % tpb) * s.row_bytes;
      };
      std::memcpy(&pool[at(dst[m])], &pool[at(src[m])], s.row_bytes);
    }
  }
}

bool validate(const Shape& s, int64_t moves, std::mt19937_64& rng) {
  std::vector<unsigned char> host(s.bytes());
  for (auto& b : host) b = static_cast<unsigned char>(rng());
  std::vector<int64_t> src, dst;
  random_plan(s, moves, rng, src, dst);
  void* pool;
  int64_t *d_src, *d_dst;
  CUDA_CHECK(cudaMalloc(&pool, s.bytes()));
  CUDA_CHECK(cudaMalloc(&d_src, moves * sizeof(int64_t)));
  CUDA_CHECK(cudaMalloc(&d_dst, moves * sizeof(int64_t)));
  CUDA_CHECK(cudaMemcpy(pool, host.data(), s.bytes(), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(d_src, src.data(), moves * sizeof(int64_t), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(d_dst, dst.data(), moves * sizeof(int64_t), cudaMemcpyHostToDevice));
  CUDA_CHECK(vtoken_relocate_kv(pool, s.rows_per_block, s.tokens_per_block, s.row_bytes, d_src,
                                d_dst, moves, nullptr));
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<unsigned char> got(s.bytes());
  CUDA_CHECK(cudaMemcpy(got.data(), pool, s.bytes(), cudaMemcpyDeviceToHost));
  reference(s, host, src, dst);
  int64_t wrong = 0;
  for (int64_t i = 0; i < s.bytes(); ++i) wrong += got[i] != host[i];
  std::printf("validate rows=%-4lld tpb=%-3lld row_bytes=%-4lld moves=%-6lld %s (%lld bytes differ)\n",
              (long long)s.rows_per_block, (long long)s.tokens_per_block, (long long)s.row_bytes,
              (long long)moves, wrong ? "FAIL" : "ok", (long long)wrong);
  CUDA_CHECK(cudaFree(pool));
  CUDA_CHECK(cudaFree(d_src));
  CUDA_CHECK(cudaFree(d_dst));
  return wrong == 0;
}

void benchmark(const Shape& s, const std::vector<int64_t>& move_counts, int reps) {
  std::mt19937_64 rng(7);
  unsigned char* pool;
  unsigned char* scratch;
  int64_t max_moves = *std::max_element(move_counts.begin(), move_counts.end());
  int64_t move_bytes = s.rows_per_block * s.row_bytes;
  CUDA_CHECK(cudaMalloc(&pool, s.bytes()));
  CUDA_CHECK(cudaMalloc(&scratch, 2 * max_moves * move_bytes));
  CUDA_CHECK(cudaMemset(pool, 0x5a, s.bytes()));
  CUDA_CHECK(cudaMemset(scratch, 0x3c, 2 * max_moves * move_bytes));
  int64_t *d_src, *d_dst;
  CUDA_CHECK(cudaMalloc(&d_src, max_moves * sizeof(int64_t)));
  CUDA_CHECK(cudaMalloc(&d_dst, max_moves * sizeof(int64_t)));
  std::printf("\n%-8s %-10s %-12s %-12s %-12s %-12s %-8s\n", "moves", "MiB moved", "kernel us",
              "kernel GB/s", "memcpy us", "memcpy GB/s", "ratio");
  for (int64_t moves : move_counts) {
    std::vector<int64_t> src, dst;
    random_plan(s, moves, rng, src, dst);
    CUDA_CHECK(cudaMemcpy(d_src, src.data(), moves * sizeof(int64_t), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_dst, dst.data(), moves * sizeof(int64_t), cudaMemcpyHostToDevice));
    const int64_t bytes = moves * move_bytes;  // read once and written once by both
    float kernel_ms = median_ms([&] {
      CUDA_CHECK(vtoken_relocate_kv(pool, s.rows_per_block, s.tokens_per_block, s.row_bytes,
                                    d_src, d_dst, moves, nullptr));
    }, reps);
    float copy_ms = median_ms([&] {
      CUDA_CHECK(cudaMemcpyAsync(scratch + bytes, scratch, bytes, cudaMemcpyDeviceToDevice));
    }, reps);
    double kernel_gbs = 2.0 * bytes / (kernel_ms * 1e6), copy_gbs = 2.0 * bytes / (copy_ms * 1e6);
    std::printf("%-8lld %-10.1f %-12.1f %-12.1f %-12.1f %-12.1f %-8.3f\n", (long long)moves,
                bytes / 1048576.0, kernel_ms * 1e3, kernel_gbs, copy_ms * 1e3, copy_gbs,
                kernel_gbs / copy_gbs);
  }
  CUDA_CHECK(cudaFree(pool));
  CUDA_CHECK(cudaFree(scratch));
  CUDA_CHECK(cudaFree(d_src));
  CUDA_CHECK(cudaFree(d_dst));
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, abi %d\n", prop.name, prop.multiProcessorCount,
              vtoken_relocate_kv_abi_version());
  std::mt19937_64 rng(1234);
  bool ok = true;
  // {blocks, rows (layers * 2 * kv heads), tokens_per_block, row_bytes}
  const Shape checks[] = {
      {64, 2 * 2 * 2, 16, 16 * 4},   // tiny model, fp32, head_dim 16: 16-byte vectors
      {48, 4 * 2 * 3, 32, 64 * 2},   // fp16/bf16 head_dim 64
      {32, 30 * 2 * 3, 16, 64 * 2},  // SmolLM2-135M shapes
      {16, 8 * 2 * 8, 32, 128 * 4},  // fp32 head_dim 128
      {40, 3 * 2 * 1, 48, 10},       // odd row: 2-byte path
      {40, 3 * 2 * 1, 64, 12},       // 4-byte path
  };
  for (const Shape& s : checks) {
    for (int64_t moves : {int64_t(1), int64_t(37), s.slots() / 3}) ok &= validate(s, moves, rng);
  }
  std::printf("validation: %s\n", ok ? "PASS" : "FAIL");
  const Shape llama{quick ? 1024 : 4096, 32 * 2 * 8, 32, 128 * 2};
  std::printf("\nbenchmark: Llama-3.1-8B KV (bf16, tpb 32), pool %.1f GiB, %lld KiB per move\n",
              llama.bytes() / 1073741824.0, (long long)(llama.rows_per_block * llama.row_bytes / 1024));
  benchmark(llama, {256, 1024, 4096, 16384}, quick ? 10 : 30);
  return ok ? 0 : 1;
}
