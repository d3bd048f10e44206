// SPDX-License-Identifier: Apache-2.0
// The prefill mass pass's packing (prefill_layout.h): each KV head's keys once, each tile's
// queries, converted exactly to float32 where the scorer takes float32.
#include <cmath>
#include <cstring>
#include <vector>

#include "prefill_layout.h"

namespace vtoken::prefill {
namespace {

int64_t element_bytes(Element e) { return e == Element::kF32 ? 4 : 2; }

// IEEE half to float, exactly (subnormals, infinities and NaN included).
float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0) {
    const float value = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -value : value;
  }
  const uint32_t bits = sign | (exponent == 0x1f ? 0x7f800000u : (exponent + 112) << 23) | (mantissa << 13);
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// n elements of `element` from src as float32 into dst (exact for all three types).
void to_float(const void* src, Element element, int64_t n, float* dst) {
  const auto* halves = static_cast<const uint16_t*>(src);
  if (element == Element::kF32) {
    std::memcpy(dst, src, n * 4);
  } else if (element == Element::kBf16) {
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(halves[i]) << 16;
      std::memcpy(dst + i, &bits, 4);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(halves[i]);
  }
}

const void* row_at(const Rows& rows, Element element, int64_t token, int64_t head) {
  return static_cast<const uint8_t*>(rows.data) +
         (token * rows.token_stride + head * rows.head_stride) * element_bytes(element);
}

const void* key_row(const PrefillMassArgs& a, int64_t key, int64_t kv_head) {
  return key < a.num_past ? row_at(a.past_k, a.element, key, kv_head)
                          : row_at(a.k, a.element, key - a.num_past, kv_head);
}

}  // namespace

// Pairs: packed[block][chunk][pair][key in block][2], one 64-key pass reads four 1 KiB B tiles per
// chunk. Float32: packed[block][dim][key in block].
void pack_keys(const PrefillMassArgs& a, const Layout& l, Scorer scorer, int64_t kv_head, uint8_t* packed) {
  std::memset(packed, 0, l.packed_bytes);
  const int64_t num_keys = a.num_past + a.num_tokens;
  float* floats = reinterpret_cast<float*>(packed);
  std::vector<float> row(scorer == Scorer::kFma ? a.head_dim : 0);
  for (int64_t key = 0; key < num_keys; ++key) {
    if (scorer == Scorer::kFma) {
      to_float(key_row(a, key, kv_head), a.element, a.head_dim, row.data());
      float* block = floats + (key / 16) * a.head_dim * 16 + key % 16;
      for (int64_t d = 0; d < a.head_dim; ++d) block[d * 16] = row[d];
      continue;
    }
    const auto* src = static_cast<const uint16_t*>(key_row(a, key, kv_head));
    uint16_t* block = reinterpret_cast<uint16_t*>(packed) + (key / 16) * l.chunks * kChunk * 16;
    for (int64_t d = 0; d < a.head_dim; ++d) {
      const int64_t chunk = d / kChunk, pair = (d % kChunk) / 2;
      block[((chunk * 16 + pair) * 16 + key % 16) * 2 + d % 2] = src[d];
    }
  }
}

// The tile's `rows` queries of head `head` from `first` on: bf16 rows as they are (pairs), else as float32.
void pack_queries(const PrefillMassArgs& a, const Layout& l, Scorer scorer, int64_t head, int64_t first, int64_t rows,
                  uint8_t* queries) {
  std::memset(queries, 0, l.queries_bytes);
  for (int64_t r = 0; r < rows; ++r) {
    const void* src = row_at(a.q, a.element, first + r, head);
    if (scorer == Scorer::kFma)
      to_float(src, a.element, a.head_dim, reinterpret_cast<float*>(queries) + r * a.head_dim);
    else
      std::memcpy(queries + r * l.chunks * kChunk * 2, src, a.head_dim * 2);
  }
}

}  // namespace vtoken::prefill
