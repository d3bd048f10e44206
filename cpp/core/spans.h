// SPDX-License-Identifier: Apache-2.0
// The statistic pass's spans (select.cpp): a row's positions in runs of contiguous slots, where
// blocks whose ids follow one another continue each other (a fresh pool hands a request its blocks
// in order), and the vectorised loops over one span.
//
//   row's blocks   [17][18][19][20][21] [4] [90][91]       (tokens_per_block slots each)
//   spans          [17 .............. 21] [4] [90 .. 91]   (at most kSpanBlocks blocks each)
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "select.h"
#include "token_table.h"

namespace vtoken::spans {

constexpr int64_t kAhead = 4;  // blocks prefetched ahead: a row's blocks lie anywhere in the pool
constexpr int64_t kLine = 64;  // bytes per cache line
constexpr int64_t kSpanBlocks = 8;  // blocks per span at most: one minimum per span gates its exact scan

// The statistic's loops, compiled for AVX2 beside the baseline where GCC can pick at run time
// (x86-64: target_clones). Element-wise adds and an exact minimum: the same bits either way.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define VTOKEN_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VTOKEN_SIMD_CLONES
#endif

// The statistic is float32 (4 bytes a slot: the pass over every slot is bound by memory traffic,
// 16 bytes a slot with the id and the mass, against 24 with a double statistic). One addition is
// rounded once to float, whatever the mass's type: float + float in float; with a double mass,
// in double, then to float (numpy's float32 += float64 does the same; the Python path relies on it).
template <typename Mass>
inline float accumulate(float value, Mass mass) {
  return static_cast<float>(static_cast<Mass>(value) + mass);
}

// values[o] += mass[o] for o in [0, n).
template <typename Mass>
VTOKEN_SIMD_CLONES inline void add_mass(float* values, const Mass* mass, int64_t n) {
#pragma omp simd
  for (int64_t o = 0; o < n; ++o) values[o] = accumulate(values[o], mass[o]);
}

// Over n slots: values += mass first (kMass); returns the lowest key among the candidates (ids t
// with t - low in [0, width) as unsigned: a -1 or an id below low wraps past it) whose key is not
// NaN, +inf if none, and counts them all. The key: values[o] (kStat, a float, exact as a double), else the id.
template <bool kStat, bool kMass, typename Mass>
VTOKEN_SIMD_CLONES inline double span_minimum(float* values, const Mass* mass, const int32_t* tokens, int32_t low,
                                              uint32_t width, int64_t n, int64_t* candidates) {
  // The reduction runs in the key's own type: float lanes (8 per AVX2 vector) for the statistic.
  using Key = std::conditional_t<kStat, float, double>;
  constexpr Key kNone = std::numeric_limits<Key>::infinity();
  Key minimum = kNone;
  int64_t count = 0;
#pragma omp simd reduction(min : minimum) reduction(+ : count)
  for (int64_t o = 0; o < n; ++o) {
    Key key;
    if constexpr (kStat) {
      key = kMass ? accumulate(values[o], mass[o]) : values[o];
      if constexpr (kMass) values[o] = key;
    } else {
      key = static_cast<double>(tokens[o]);
    }
    const bool candidate = static_cast<uint32_t>(tokens[o] - low) < width;
    // std::min(minimum, NaN) is minimum (it takes the second only if it compares less): a NaN key
    // is left out, as it ranks after +inf. IEEE semantics kept: no -ffast-math for this target.
    minimum = std::min(minimum, candidate ? key : kNone);
    count += candidate;
  }
  *candidates = count;
  return static_cast<double>(minimum);
}

// The end of the span that starts at blocks[block]: the blocks after it whose ids follow on (their
// slots continue the span's), at most `limit` blocks in all; a block that shared_of (optional)
// holds as shared is a span alone.
inline int64_t span_end(const int32_t* blocks, int64_t block, int64_t num_blocks, int64_t limit,
                        const TokenTable* shared_of) {
  auto shared = [&](int64_t j) { return shared_of != nullptr && shared_of->is_shared(blocks[j]); };
  if (shared(block)) return block + 1;
  int64_t next = block + 1;
  while (next < num_blocks && next - block < limit && blocks[next] == blocks[next - 1] + 1 && !shared(next)) ++next;
  return next;
}

// Prefetches blocks [from, to) of a row that do not follow their predecessor in the pool (the
// hardware prefetcher follows the rest); returns `to`.
inline int64_t prefetch_jumps(const SlotLayout& layout, const int32_t* blocks, int64_t from, int64_t to,
                              const float* stat) {
  const int64_t tpb = layout.tokens_per_block;
  for (int64_t j = from; j < to; ++j) {
    if (j > 0 && blocks[j] == blocks[j - 1] + 1) continue;
    const int64_t slot = static_cast<int64_t>(blocks[j]) * tpb;
    for (int64_t o = 0; o < tpb; o += kLine / sizeof(int32_t)) __builtin_prefetch(layout.tokens + slot + o);
    if (stat != nullptr) {
      for (int64_t o = 0; o < tpb; o += kLine / sizeof(float)) __builtin_prefetch(stat + slot + o, 1);
    }
  }
  return to;
}

}  // namespace vtoken::spans
