// SPDX-License-Identifier: Apache-2.0
// The prefill mass pass (prefill_mass.h). Per KV head, its keys are packed once; per query head of
// its group and per tile of 16 queries:
//
//   scores [16, width] float32  = queries (16 x head_dim) . keys (head_dim x 16)   per 64 keys
//   row r: e = exp(scale * scores - max), sum -> 1 / sum       (keys past the query's own: none)
//   partial[h, key] += sum_r e[r, key] / sum_r                  (float32, AVX-512)
//
// and at the end mass[key] = sum over KV heads of partial[h, key], in head order.
//
// The scores, by kind (prefill_mass_kind):
//   amx          bf16 pairs in four AMX C tiles of 16 x 16, summed over the head's 32-dim chunks
//   avx512-bf16  the same packed pairs: each query's dim pair broadcast against a 16-key vector of
//                pairs (vdpbf16ps), 4 queries x 64 keys in 16 registers
//   avx512       float32: each query's dim broadcast against a 16-key vector of that dim (FMA),
//                4 queries x 64 keys in 16 registers
// Softmax and sums are shared. The keys and queries are laid out for them by prefill_pack.cpp.
//
// Workspace, per thread, then the partials (64-byte aligned regions):
//   packed keys  bf16 pairs: [keys/16][chunks][16 pairs][16 keys][2]   (keys padded to 64, dims to 32)
//                float32:    [keys/16][head_dim][16 keys]             (keys padded to 64)
//   scores       [16][keys padded to 64] float32
//   queries      [16][chunks * 32] bf16, or [16][head_dim] float32    (zero-padded rows and dims)
//   partials     [num_kv_heads][keys padded to 16] float32
#include "prefill_mass.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "prefill_layout.h"

namespace vtoken {
namespace {

using namespace prefill;

#if VTOKEN_AMX
// scores[r, 0 : width rounded up to 64] = queries[r] . keys, for the tile's 16 rows.
VTOKEN_AMX_TARGET void tile_scores(const Layout& l, const uint16_t* queries, const uint16_t* packed, int64_t width,
                                   float* scores) {
  const int64_t b_stride = l.chunks * kChunk * 16;  // elements between consecutive 16-key blocks
  before_tile_loads();
  for (int64_t first = 0; first < width; first += kSuperBlock) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t chunk = 0; chunk < l.chunks; ++chunk) {
      _tile_loadd(4, queries + chunk * kChunk, l.chunks * kChunk * 2);
      const uint16_t* b = packed + (first / 16) * b_stride + chunk * kChunk * 16;
      _tile_loadd(5, b, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(5, b + b_stride, 64);
      _tile_dpbf16ps(1, 4, 5);
      _tile_loadd(5, b + 2 * b_stride, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(5, b + 3 * b_stride, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    float* out = scores + first;
    _tile_stored(0, out, l.keys64 * 4);
    _tile_stored(1, out + 16, l.keys64 * 4);
    _tile_stored(2, out + 32, l.keys64 * 4);
    _tile_stored(3, out + 48, l.keys64 * 4);
  }
}

// The register block of the two kernels below: 4 queries x 4 vectors of 16 keys' float32 sums.
VTOKEN_AVX512_TARGET inline void zero_sums(__m512 (&sums)[4][4]) {
  for (auto& per_query : sums)
    for (__m512& sum : per_query) sum = _mm512_setzero_ps();
}

// Query i's 64 sums to out[i * stride, i * stride + 64).
VTOKEN_AVX512_TARGET inline void store_sums(const __m512 (&sums)[4][4], float* out, int64_t stride) {
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + i * stride + 16 * j, sums[i][j]);
}

// The same scores without AMX, for the first `rows` queries (rounded up to 4): per 4 queries and
// 64 keys, 16 float32 sums in registers; per dim pair, each query's pair (one 32-bit broadcast)
// against four 16-key vectors of that pair.
VTOKEN_AVX512_BF16_TARGET void tile_scores_dot(const Layout& l, const uint16_t* queries, const uint16_t* packed,
                                               int64_t width, int64_t rows, float* scores) {
  const int64_t b_stride = l.chunks * kChunk * 16, q_stride = l.chunks * kChunk;
  for (int64_t first = 0; first < width; first += kSuperBlock) {
    const uint16_t* b = packed + (first / 16) * b_stride;
    for (int64_t row = 0; row < rows; row += 4) {
      __m512 sums[4][4];
      zero_sums(sums);
      for (int64_t pair = 0; pair < l.chunks * 16; ++pair) {  // pair p of chunk c lies at c * 512 + (p % 16) * 32
        const int64_t at = (pair / 16) * kChunk * 16 + (pair % 16) * 32;
        __m512bh keys[4];
        for (int j = 0; j < 4; ++j) keys[j] = (__m512bh)_mm512_loadu_si512(b + j * b_stride + at);
        for (int i = 0; i < 4; ++i) {
          int32_t dims;
          std::memcpy(&dims, queries + (row + i) * q_stride + pair * 2, 4);
          const __m512bh query = (__m512bh)_mm512_set1_epi32(dims);
          for (int j = 0; j < 4; ++j) sums[i][j] = _mm512_dpbf16_ps(sums[i][j], keys[j], query);
        }
      }
      store_sums(sums, scores + row * l.keys64 + first, l.keys64);
    }
  }
}

// The same in float32, for the first `rows` queries (rounded up to 4): per 4 queries and 64 keys,
// 16 sums in registers; per dim, each query's value broadcast against four 16-key vectors of it.
VTOKEN_AVX512_TARGET void tile_scores_fma(const Layout& l, int64_t head_dim, const float* queries,
                                          const float* packed, int64_t width, int64_t rows, float* scores) {
  const int64_t b_stride = head_dim * 16;
  for (int64_t first = 0; first < width; first += kSuperBlock) {
    const float* b = packed + (first / 16) * b_stride;
    for (int64_t row = 0; row < rows; row += 4) {
      __m512 sums[4][4];
      zero_sums(sums);
      for (int64_t d = 0; d < head_dim; ++d) {
        __m512 keys[4];
        for (int j = 0; j < 4; ++j) keys[j] = _mm512_loadu_ps(b + j * b_stride + d * 16);
        for (int i = 0; i < 4; ++i) {
          const __m512 query = _mm512_set1_ps(queries[(row + i) * head_dim + d]);
          for (int j = 0; j < 4; ++j) sums[i][j] = _mm512_fmadd_ps(query, keys[j], sums[i][j]);
        }
      }
      store_sums(sums, scores + row * l.keys64 + first, l.keys64);
    }
  }
}

// Row r of scores (keys [0, seen)): softmax in place, zeros from `seen` to `width` rounded up to
// 16; returns 1 / (the row's sum of exponentials).
VTOKEN_AVX512_TARGET float softmax_row(float* s, int64_t seen, int64_t width, float scale) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= seen; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
  const __mmask16 tail = static_cast<__mmask16>((1u << (seen - j)) - 1);
  if (seen > j) m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, s + j));
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(m) * scale);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= seen; j += 16) {
    const __m512 e = exp_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), vscale, vmax));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (seen > j) {
    const __m512 e = _mm512_maskz_mov_ps(
        tail, exp_nonpositive(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(tail, s + j), vscale, vmax)));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
    j += 16;
  }
  for (; j < width; j += 16) _mm512_storeu_ps(s + j, _mm512_setzero_ps());
  return 1.0f / _mm512_reduce_add_ps(sum);
}

VTOKEN_AVX512_TARGET void one_kv_head(const PrefillMassArgs& a, const Layout& l, Scorer scorer, int64_t kv_head,
                                      uint8_t* region, float* partial) {
  uint8_t* packed = region;
  float* scores = reinterpret_cast<float*>(region + l.packed_bytes);
  uint8_t* queries = region + l.packed_bytes + l.scores_bytes;
  pack_keys(a, l, scorer, kv_head, packed);
  std::memset(partial, 0, l.keys16 * 4);
  const int64_t group = a.num_heads / a.num_kv_heads;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(a.head_dim)));
  float inverse[kTileRows];
  for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
    for (int64_t first = a.first_query; first < a.num_tokens; first += kTileRows) {
      const int64_t rows = std::min(kTileRows, a.num_tokens - first);
      pack_queries(a, l, scorer, head, first, rows, queries);
      const int64_t width = a.num_past + first + rows;  // the tile's last query sees every key before it
      if (scorer == Scorer::kAmx)
        tile_scores(l, reinterpret_cast<uint16_t*>(queries), reinterpret_cast<uint16_t*>(packed), width, scores);
      else if (scorer == Scorer::kDotBf16)
        tile_scores_dot(l, reinterpret_cast<uint16_t*>(queries), reinterpret_cast<uint16_t*>(packed), width, rows,
                        scores);
      else
        tile_scores_fma(l, a.head_dim, reinterpret_cast<float*>(queries), reinterpret_cast<float*>(packed), width,
                        rows, scores);
      const int64_t width16 = round_up(width, 16);
      for (int64_t r = 0; r < rows; ++r)
        inverse[r] = softmax_row(scores + r * l.keys64, a.num_past + first + r + 1, width16, scale);
      for (int64_t j = 0; j < width16; j += 16) {
        __m512 acc = _mm512_loadu_ps(partial + j);
        for (int64_t r = 0; r < rows; ++r)
          acc = _mm512_fmadd_ps(_mm512_set1_ps(inverse[r]), _mm512_loadu_ps(scores + r * l.keys64 + j), acc);
        _mm512_storeu_ps(partial + j, acc);
      }
    }
  }
}

// The tiles of tile_scores: 16 rows of 64 bytes each.
VTOKEN_AMX_TARGET void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 6; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kTileRows;
  }
  load_tile_config(config);
}

// Thread `thread`'s KV heads (every `threads`-th), with the tiles configured around them where they score.
VTOKEN_AVX512_TARGET void worker(const PrefillMassArgs& a, const Layout& l, Scorer scorer, int64_t thread,
                                 int64_t threads, uint8_t* region, float* partials) {
  if (scorer == Scorer::kAmx) configure_tiles();
  for (int64_t h = thread; h < a.num_kv_heads; h += threads)
    one_kv_head(a, l, scorer, h, region, partials + h * l.keys16);
  if (scorer == Scorer::kAmx) release_tiles();
}

#endif

void check_args(const PrefillMassArgs& a) {
  if (a.num_tokens < 1 || a.num_past < 0 || a.num_heads < 1 || a.num_kv_heads < 1 || a.head_dim < 1)
    throw std::invalid_argument("prefill mass: tokens, heads, kv heads and head_dim must be positive, past >= 0");
  if (a.num_heads % a.num_kv_heads)
    throw std::invalid_argument("prefill mass: " + std::to_string(a.num_heads) + " query heads do not share " +
                                std::to_string(a.num_kv_heads) + " KV heads evenly");
  if (a.first_query < 0 || a.first_query >= a.num_tokens)
    throw std::invalid_argument("prefill mass: first observing query " + std::to_string(a.first_query) +
                                " outside [0, " + std::to_string(a.num_tokens) + ")");
  if (!a.q.data || !a.k.data || (a.num_past && !a.past_k.data))
    throw std::invalid_argument("prefill mass: missing queries or keys");
}

}  // namespace

const char* prefill_mass_kind(Element element) {
  const char* bf16 = element == Element::kBf16 ? bf16_mass_kind() : nullptr;
  return bf16 != nullptr ? bf16 : avx512_supported() ? "avx512" : nullptr;
}

int64_t prefill_mass_workspace_bytes(int64_t num_keys, int64_t num_kv_heads, int64_t head_dim, int64_t threads,
                                     Element element) {
  if (num_keys < 1 || num_kv_heads < 1 || head_dim < 1 || threads < 1)
    throw std::invalid_argument("prefill mass workspace: keys, kv heads, head_dim and threads must be positive");
  const Layout l(num_keys, num_kv_heads, head_dim, scorer_of(prefill_mass_kind(element)));
  return l.total(threads_used(threads, num_kv_heads));
}

void prefill_mass(const PrefillMassArgs& a, uint8_t* workspace, int64_t workspace_bytes, int64_t threads,
                  float* mass) {
  check_args(a);
  const int64_t num_keys = a.num_past + a.num_tokens;
  require_workspace("prefill mass", workspace_bytes,
                    prefill_mass_workspace_bytes(num_keys, a.num_kv_heads, a.head_dim, threads, a.element));
  const Scorer scorer = scorer_of(require_kind("prefill mass", prefill_mass_kind(a.element), "AVX-512"));
#if VTOKEN_AMX
  const Layout l(num_keys, a.num_kv_heads, a.head_dim, scorer);
  const int64_t n = threads_used(threads, a.num_kv_heads);
  uint8_t* base = aligned_start(workspace);
  float* partials = reinterpret_cast<float*>(base + n * l.per_thread);
  run_workers(n, [&](int64_t t) { worker(a, l, scorer, t, n, base + t * l.per_thread, partials); });
  for (int64_t j = 0; j < num_keys; ++j) {  // head order: the same sum for any thread count
    float sum = 0.0f;
    for (int64_t h = 0; h < a.num_kv_heads; ++h) sum += partials[h * l.keys16 + j];
    mass[j] = sum;
  }
#else
  (void)workspace;
  (void)mass;
  (void)scorer;
#endif
}

}  // namespace vtoken
