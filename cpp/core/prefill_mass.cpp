// SPDX-License-Identifier: Apache-2.0
// The bf16 prefill mass pass (prefill_mass.h). Per KV head, its keys are packed once into the
// pair layout of an AMX B tile; per query head of its group and per tile of 16 queries:
//
//   scores [16, width] float32  = A (16 queries x 32 dims, bf16) . B (32 dims x 16 keys)  per 64 keys,
//                                 summed over the head's 32-dim chunks
//   row r: e = exp(scale * scores - max), sum -> 1 / sum       (keys past the query's own: none)
//   partial[h, key] += sum_r e[r, key] / sum_r                  (float32, AVX-512)
//
// and at the end mass[key] = sum over KV heads of partial[h, key], in head order.
//
// The scores come from four AMX C tiles, or without AMX, on AVX-512 BF16 (AMD Zen 4, Intel Cooper
// Lake), from the same packed keys: each query's dim pair broadcast against a 16-key vector of
// pairs (vdpbf16ps, float32 sums), 4 queries x 64 keys in 16 registers. Softmax and sums are shared.
//
// Workspace, per thread, then the partials (64-byte aligned regions):
//   packed keys  [keys/16][chunks][16 pairs][16 keys][2] bf16   (keys padded to 64, dims to 32)
//   scores       [16][keys padded to 64] float32
//   queries      [16][chunks * 32] bf16                        (zero-padded rows and dims)
//   partials     [num_kv_heads][keys padded to 16] float32
#include "prefill_mass.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "amx.h"

namespace vtoken {
namespace {

constexpr int64_t kTileRows = 16;   // queries per tile (an AMX tile's rows)
constexpr int64_t kChunk = 32;      // bf16 dims per tile row (64 bytes)
constexpr int64_t kSuperBlock = 64; // keys per pass of the four C tiles

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

struct Layout {
  int64_t keys64, keys16, chunks;
  int64_t packed_bytes, scores_bytes, queries_bytes, per_thread, partials_bytes;

  Layout(int64_t num_keys, int64_t num_kv_heads, int64_t head_dim)
      : keys64(round_up(num_keys, kSuperBlock)), keys16(round_up(num_keys, 16)),
        chunks(round_up(head_dim, kChunk) / kChunk) {
    packed_bytes = round_up(keys64 * chunks * kChunk * 2, kWorkspaceAlign);
    scores_bytes = round_up(kTileRows * keys64 * 4, kWorkspaceAlign);
    queries_bytes = round_up(kTileRows * chunks * kChunk * 2, kWorkspaceAlign);
    per_thread = packed_bytes + scores_bytes + queries_bytes;
    partials_bytes = round_up(num_kv_heads * keys16 * 4, kWorkspaceAlign);
  }
  int64_t total(int64_t threads) const { return kWorkspaceAlign + threads * per_thread + partials_bytes; }
};


#if VTOKEN_AMX
const uint16_t* key_row(const PrefillMassArgs& a, int64_t key, int64_t kv_head) {
  const Bf16Rows& src = key < a.num_past ? a.past_k : a.k;
  const int64_t t = key < a.num_past ? key : key - a.num_past;
  return src.data + t * src.token_stride + kv_head * src.head_stride;
}

// packed[block][chunk][pair][key in block][2]: one 64-key pass reads four 1 KiB B tiles per chunk.
void pack_keys(const PrefillMassArgs& a, const Layout& l, int64_t kv_head, uint16_t* packed) {
  std::memset(packed, 0, l.packed_bytes);
  const int64_t num_keys = a.num_past + a.num_tokens;
  for (int64_t key = 0; key < num_keys; ++key) {
    const uint16_t* row = key_row(a, key, kv_head);
    uint16_t* block = packed + (key / 16) * l.chunks * kChunk * 16;
    for (int64_t d = 0; d < a.head_dim; ++d) {
      const int64_t chunk = d / kChunk, pair = (d % kChunk) / 2;
      block[((chunk * 16 + pair) * 16 + key % 16) * 2 + d % 2] = row[d];
    }
  }
}

// scores[r, 0 : width rounded up to 64] = queries[r] . keys, for the tile's 16 rows.
VTOKEN_AMX_TARGET void tile_scores(const Layout& l, const uint16_t* queries, const uint16_t* packed, int64_t width,
                                   float* scores) {
  const int64_t b_stride = l.chunks * kChunk * 16;  // elements between consecutive 16-key blocks
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

// The same scores without AMX: per 4 queries and 64 keys, 16 float32 sums in registers; per dim
// pair, each query's pair (one 32-bit broadcast) against four 16-key vectors of that pair.
VTOKEN_AVX512_TARGET void tile_scores_dot(const Layout& l, const uint16_t* queries, const uint16_t* packed,
                                          int64_t width, float* scores) {
  const int64_t b_stride = l.chunks * kChunk * 16, q_stride = l.chunks * kChunk;
  for (int64_t first = 0; first < width; first += kSuperBlock) {
    const uint16_t* b = packed + (first / 16) * b_stride;
    for (int64_t row = 0; row < kTileRows; row += 4) {
      __m512 sums[4][4];
      for (auto& per_query : sums)
        for (__m512& sum : per_query) sum = _mm512_setzero_ps();
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
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(scores + (row + i) * l.keys64 + first + 16 * j, sums[i][j]);
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

VTOKEN_AVX512_TARGET void one_kv_head(const PrefillMassArgs& a, const Layout& l, int64_t kv_head, bool amx,
                                      uint8_t* region, float* partial) {
  uint16_t* packed = reinterpret_cast<uint16_t*>(region);
  float* scores = reinterpret_cast<float*>(region + l.packed_bytes);
  uint16_t* queries = reinterpret_cast<uint16_t*>(region + l.packed_bytes + l.scores_bytes);
  pack_keys(a, l, kv_head, packed);
  std::memset(partial, 0, l.keys16 * 4);
  const int64_t group = a.num_heads / a.num_kv_heads;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(a.head_dim)));
  float inverse[kTileRows];
  for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
    for (int64_t first = a.first_query; first < a.num_tokens; first += kTileRows) {
      const int64_t rows = std::min(kTileRows, a.num_tokens - first);
      std::memset(queries, 0, l.queries_bytes);
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(queries + r * l.chunks * kChunk,
                    a.q.data + (first + r) * a.q.token_stride + head * a.q.head_stride, a.head_dim * 2);
      const int64_t width = a.num_past + first + rows;  // the tile's last query sees every key before it
      if (amx)
        tile_scores(l, queries, packed, width, scores);
      else
        tile_scores_dot(l, queries, packed, width, scores);
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

// Thread `thread`'s KV heads (every `threads`-th), with the tiles configured around them where they score.
VTOKEN_AMX_TARGET void worker(const PrefillMassArgs& a, const Layout& l, int64_t thread, int64_t threads, bool amx,
                              uint8_t* region, float* partials) {
  if (amx) {
    TileConfig config;
    for (int t = 0; t < 6; ++t) {
      config.colsb[t] = 64;
      config.rows[t] = kTileRows;
    }
    _tile_loadconfig(&config);
  }
  for (int64_t h = thread; h < a.num_kv_heads; h += threads)
    one_kv_head(a, l, h, amx, region, partials + h * l.keys16);
  if (amx) _tile_release();
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

int64_t prefill_mass_workspace_bytes(int64_t num_keys, int64_t num_kv_heads, int64_t head_dim, int64_t threads) {
  if (num_keys < 1 || num_kv_heads < 1 || head_dim < 1 || threads < 1)
    throw std::invalid_argument("prefill mass workspace: keys, kv heads, head_dim and threads must be positive");
  return Layout(num_keys, num_kv_heads, head_dim).total(threads_used(threads, num_kv_heads));
}

void prefill_mass_bf16(const PrefillMassArgs& a, uint8_t* workspace, int64_t workspace_bytes, int64_t threads,
                       float* mass) {
  check_args(a);
  const int64_t num_keys = a.num_past + a.num_tokens;
  const int64_t needed = prefill_mass_workspace_bytes(num_keys, a.num_kv_heads, a.head_dim, threads);
  const char* kind = require_workspace_and_kind("prefill mass", workspace_bytes, needed);
#if VTOKEN_AMX
  const Layout l(num_keys, a.num_kv_heads, a.head_dim);
  const int64_t n = threads_used(threads, a.num_kv_heads);
  const bool amx = std::string(kind) == "amx";
  uint8_t* base = aligned_start(workspace);
  float* partials = reinterpret_cast<float*>(base + n * l.per_thread);
  run_workers(n, [&](int64_t t) { worker(a, l, t, n, amx, base + t * l.per_thread, partials); });
  for (int64_t j = 0; j < num_keys; ++j) {  // head order: the same sum for any thread count
    float sum = 0.0f;
    for (int64_t h = 0; h < a.num_kv_heads; ++h) sum += partials[h * l.keys16 + j];
    mass[j] = sum;
  }
#else
  (void)workspace;
  (void)mass;
  (void)kind;
#endif
}

}  // namespace vtoken
