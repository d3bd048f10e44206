// SPDX-License-Identifier: Apache-2.0
// The bf16 decode mass pass (decode_mass.h). Per row, layer, KV head and (up to) 16 query heads of
// its group, the keys are read once, where the pool holds them. With AMX:
//
//   tile [16 keys, 16 lanes] float32 = A (16 keys x 32 dims, bf16, loaded from the block)
//                                      . B (32 dims x 16 query heads, the queries in pairs)
//                                      summed over the head's 32-dim chunks
//   scores[h, key]  = tile[key, h]    for the group's heads h only (a gather per head and tile)
//   head h: e = exp(scale * s - scale * max_h), 1 / sum_h         (16 positions per vector)
//   mass[key] += sum_h e[h, key] / sum_h                            (float32, AVX-512 FMAs)
//
// Keys lie [tokens_per_block, head_dim] per block and KV head, so 16 consecutive keys are one tile
// load (rows token_stride apart); keys past a row's kv_len are scored with the tile but never read
// back. With positions along the vector, the exponentials are the group's heads' only (3 of 16
// lanes at SmolLM2's group of 3) and the sum over heads needs no horizontal reduction.
//
// Without AMX, on AVX-512 BF16 (AMD Zen 4, Intel Cooper Lake): each key's dot product with each of
// the group's queries, 32 bf16 pairs a vdpbf16ps with float32 sums, summed across the vector into
// scores[h, key]; the same softmax and sums follow.
//
// Workspace, per thread (64-byte aligned regions):
//   scores   [16 lanes][kv_len + 16, padded to 16] float32
//   tile     [16][16] float32                          (one tile product, L1-resident)
//   queries  [chunks][16 pairs][16 lanes][2] bf16      (dims zero-padded to the chunk; AMX)
//            [16 lanes][chunks][32] bf16              (the same bytes; AVX-512 BF16)
#include "decode_mass.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "amx.h"

namespace vtoken {
namespace {

constexpr int64_t kLanes = 16;               // query heads per tile product (a C tile's float32 columns)
constexpr int64_t kChunk = 32;               // bf16 dims per key tile row (64 bytes)
constexpr int64_t kChunkElements = 16 * kLanes * 2;  // one chunk of packed queries: 16 pairs x 16 lanes x 2

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

struct Layout {
  int64_t rows;    // keys per tile: 16, or the whole block where tokens_per_block is smaller
  int64_t chunks;  // whole 32-dim chunks of head_dim
  int64_t tail;    // dims in a last, partial chunk (0: none)
  int64_t row_floats;  // one lane's row of scores: max_kv_len and a tile's 16 positions past it
  int64_t scores_bytes, tile_bytes, queries_bytes, per_thread;

  Layout(int64_t max_kv_len, int64_t tokens_per_block, int64_t head_dim)
      : rows(std::min<int64_t>(16, tokens_per_block)), chunks(head_dim / kChunk), tail(head_dim % kChunk),
        row_floats(round_up(max_kv_len + 16, 16)) {
    scores_bytes = kLanes * row_floats * 4;
    tile_bytes = kLanes * kLanes * 4;
    queries_bytes = round_up((chunks + (tail ? 1 : 0)) * kChunkElements * 2, kWorkspaceAlign);
    per_thread = scores_bytes + tile_bytes + queries_bytes;
  }
  int64_t total(int64_t threads) const { return kWorkspaceAlign + threads * per_thread; }
};


#if VTOKEN_AMX
// Tiles: 0 scores (C), 1 keys (A), 2 queries (B); 3 and 4 the keys and queries of a partial last chunk.
VTOKEN_AMX_TARGET void configure_tiles(const Layout& l) {
  TileConfig config;
  config.rows[0] = config.rows[1] = static_cast<uint8_t>(l.rows);
  config.colsb[0] = config.colsb[1] = config.colsb[2] = 64;
  config.rows[2] = 16;
  if (l.tail) {
    config.rows[3] = static_cast<uint8_t>(l.rows);
    config.colsb[3] = static_cast<uint16_t>(l.tail * 2);
    config.rows[4] = static_cast<uint8_t>(l.tail / 2);
    config.colsb[4] = 64;
  }
  load_tile_config(config);
}

// packed[chunk][pair][lane][2] = query head (first_head + lane)'s dims 2 pair and 2 pair + 1 of
// the chunk, for lane < lanes; zero elsewhere.
void pack_queries(const DecodeMassArgs& a, const Layout& l, const uint16_t* row_q, int64_t first_head, int64_t lanes,
                  uint16_t* packed) {
  std::memset(packed, 0, l.queries_bytes);
  for (int64_t lane = 0; lane < lanes; ++lane) {
    const uint16_t* src = row_q + (first_head + lane) * a.q_head_stride;
    for (int64_t d = 0; d < a.head_dim; ++d)
      packed[(d / kChunk) * kChunkElements + ((d % kChunk) / 2 * kLanes + lane) * 2 + d % 2] = src[d];
  }
}

// The next block lies anywhere in the pool: ask for its keys while block `block` is scored.
// Always inlined: as a function of its own GCC 12 found it free of side effects (a prefetch is
// none) and deleted every call, so each block's keys came from memory at the tile load.
VTOKEN_AVX512_TARGET __attribute__((always_inline)) inline void prefetch_next_block(const DecodeMassArgs& a, const int64_t* blocks, int64_t block,
                                              int64_t num_blocks, const uint16_t* head_keys) {
  if (block + 1 >= num_blocks) return;
  const char* next = reinterpret_cast<const char*>(head_keys + blocks[block + 1] * a.block_stride);
  for (int64_t t = 0; t < a.tokens_per_block; ++t)
    for (int64_t byte = 0; byte < a.head_dim * 2; byte += 64) _mm_prefetch(next + t * a.token_stride * 2 + byte, _MM_HINT_T0);
}

// packed[lane][chunk][32] = query head (first_head + lane)'s dims of the chunk, for lane < lanes
// (dims zero-padded to whole chunks).
void pack_query_rows(const DecodeMassArgs& a, const Layout& l, const uint16_t* row_q, int64_t first_head,
                     int64_t lanes, uint16_t* packed) {
  const int64_t width = (l.chunks + (l.tail ? 1 : 0)) * kChunk;
  std::memset(packed, 0, l.queries_bytes);
  for (int64_t lane = 0; lane < lanes; ++lane)
    std::memcpy(packed + lane * width, row_q + (first_head + lane) * a.q_head_stride, a.head_dim * 2);
}

// scores[lane, p] (row stride l.row_floats) for lanes < `lanes` and positions p < kv_len: the key's
// dims against the lane's in bf16 pairs, 32 a vdpbf16ps, with float32 sums; then across the vector.
VTOKEN_AVX512_BF16_TARGET void score_keys_dot(const DecodeMassArgs& a, const Layout& l, const int64_t* blocks,
                                              int64_t kv_len, const uint16_t* head_keys, const uint16_t* queries,
                                              int64_t lanes, float* scores) {
  const int64_t tpb = a.tokens_per_block, num_blocks = (kv_len + tpb - 1) / tpb;
  const int64_t width = (l.chunks + (l.tail ? 1 : 0)) * kChunk;
  const __mmask32 tail = static_cast<__mmask32>((1ull << l.tail) - 1);
  for (int64_t p = 0; p < kv_len; ++p) {
    if (p % tpb == 0) prefetch_next_block(a, blocks, p / tpb, num_blocks, head_keys);
    const uint16_t* k = head_keys + blocks[p / tpb] * a.block_stride + (p % tpb) * a.token_stride;
    for (int64_t lane = 0; lane < lanes; ++lane) {
      const uint16_t* q = queries + lane * width;
      __m512 sum = _mm512_setzero_ps();
      for (int64_t chunk = 0; chunk < l.chunks; ++chunk)
        sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(k + chunk * kChunk),
                               (__m512bh)_mm512_loadu_si512(q + chunk * kChunk));
      if (l.tail)
        sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_maskz_loadu_epi16(tail, k + l.chunks * kChunk),
                               (__m512bh)_mm512_loadu_si512(q + l.chunks * kChunk));
      scores[lane * l.row_floats + p] = _mm512_reduce_add_ps(sum);
    }
  }
}

// scores[lane, p] (row stride l.row_floats) for lanes < `lanes` and positions p < kv_len (and
// up to 16 past it, unread): each tile's [keys, 16 lanes] product goes through `tile` (L1-hot)
// and each live lane's column is gathered into its row, so that softmax and sums run with
// positions along the vector (exponentials for the group's heads only, no horizontal sums).
VTOKEN_AMX_TARGET void score_keys(const DecodeMassArgs& a, const Layout& l, const int64_t* blocks, int64_t kv_len,
                                  const uint16_t* head_keys, const uint16_t* queries, int64_t lanes, float* tile,
                                  float* scores) {
  const int64_t tpb = a.tokens_per_block, key_bytes = a.token_stride * 2;
  const int64_t num_blocks = (kv_len + tpb - 1) / tpb;
  before_tile_loads();
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(kLanes));
  for (int64_t first = 0; first < kv_len; first += l.rows) {
    const uint16_t* k = head_keys + blocks[first / tpb] * a.block_stride + (first % tpb) * a.token_stride;
    if (first % tpb == 0) prefetch_next_block(a, blocks, first / tpb, num_blocks, head_keys);
    _tile_zero(0);
    for (int64_t chunk = 0; chunk < l.chunks; ++chunk) {
      _tile_loadd(1, k + chunk * kChunk, key_bytes);
      _tile_loadd(2, queries + chunk * kChunkElements, kLanes * 4);
      _tile_dpbf16ps(0, 1, 2);
    }
    if (l.tail) {
      _tile_loadd(3, k + l.chunks * kChunk, key_bytes);
      _tile_loadd(4, queries + l.chunks * kChunkElements, kLanes * 4);
      _tile_dpbf16ps(0, 3, 4);
    }
    _tile_stored(0, tile, kLanes * 4);
    for (int64_t lane = 0; lane < lanes; ++lane)
      _mm512_storeu_ps(scores + lane * l.row_floats + first, _mm512_i32gather_ps(column, tile + lane, 4));
  }
}

// Each lane's softmax over positions [0, kv_len) of its row (overwritten by the exponentials),
// its weights added to mass[p].
VTOKEN_AVX512_TARGET void add_softmax_mass(const Layout& l, float* scores, int64_t kv_len, int64_t lanes, float scale,
                                        float* mass) {
  const int64_t whole = kv_len / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (kv_len - whole)) - 1);
  const __m512 vscale = _mm512_set1_ps(scale);
  float inverse[kLanes];
  for (int64_t lane = 0; lane < lanes; ++lane) {
    float* row = scores + lane * l.row_floats;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t p = 0; p < whole; p += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + p));
    if (tail) top = _mm512_mask_max_ps(top, tail, top, _mm512_loadu_ps(row + whole));
    const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(top) * scale);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t p = 0; p < whole; p += 16) {
      const __m512 e = exp_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(row + p), vscale, vmax));
      _mm512_storeu_ps(row + p, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
      const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(row + whole), vscale, vmax);
      const __m512 e = _mm512_maskz_mov_ps(tail, exp_nonpositive(x));
      _mm512_storeu_ps(row + whole, e);
      sum = _mm512_add_ps(sum, e);
    }
    inverse[lane] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  for (int64_t p = 0; p < whole + (tail ? 16 : 0); p += 16) {
    const __mmask16 live = p < whole ? static_cast<__mmask16>(0xFFFF) : tail;
    __m512 acc = _mm512_maskz_loadu_ps(live, mass + p);
    for (int64_t lane = 0; lane < lanes; ++lane)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(scores + lane * l.row_floats + p), _mm512_set1_ps(inverse[lane]), acc);
    _mm512_mask_storeu_ps(mass + p, live, acc);
  }
}

// One thread's regions of the workspace, and what scores a KV head's (up to) 16 query heads of a
// row: AMX tiles or AVX-512 BF16 dot products; then the same softmax and sums into the row's mass.
struct Heads {
  float* scores;
  float* tile;
  uint16_t* queries;
  bool amx;

  Heads(const Layout& l, uint8_t* region, bool amx)
      : scores(reinterpret_cast<float*>(region)), tile(reinterpret_cast<float*>(region + l.scores_bytes)),
        queries(reinterpret_cast<uint16_t*>(region + l.scores_bytes + l.tile_bytes)), amx(amx) {}

  void add(const DecodeMassArgs& a, const Layout& l, const uint16_t* row_q, const int64_t* blocks, int64_t kv_len,
           const uint16_t* head_keys, int64_t first_head, int64_t lanes, float scale, float* row_mass) {
    if (amx) {
      pack_queries(a, l, row_q, first_head, lanes, queries);
      score_keys(a, l, blocks, kv_len, head_keys, queries, lanes, tile, scores);
    } else {
      pack_query_rows(a, l, row_q, first_head, lanes, queries);
      score_keys_dot(a, l, blocks, kv_len, head_keys, queries, lanes, scores);
    }
    add_softmax_mass(l, scores, kv_len, lanes, scale, row_mass);
  }
};

// Thread `thread`'s rows (every `threads`-th): each row's mass zeroed, then per layer, KV head and
// (up to) 16 query heads of its group at a time, their softmax weights added.
void rows_of_thread(const DecodeMassArgs& a, const Layout& l, int64_t thread, int64_t threads, Heads& heads,
                    float* mass, int64_t mass_width) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(a.head_dim)));
  for (int64_t b = thread; b < a.batch; b += threads) {
    float* row_mass = mass + b * mass_width;
    std::fill(row_mass, row_mass + mass_width, 0.0f);
    for (int64_t layer = 0; layer < a.num_layers; ++layer) {
      const uint16_t* row_q = a.q + b * a.q_row_stride + layer * a.q_layer_stride;
      for (int64_t kv_head = 0; kv_head < a.num_kv_heads; ++kv_head) {
        const uint16_t* head_keys = a.keys + a.layers[layer] * a.layer_stride + kv_head * a.kv_head_stride;
        for (int64_t first = 0; first < group; first += kLanes)
          heads.add(a, l, row_q, a.block_table + b * a.table_width, a.kv_lens[b], head_keys, kv_head * group + first,
                    std::min(kLanes, group - first), scale, row_mass);
      }
    }
  }
}

VTOKEN_AVX512_TARGET void worker(const DecodeMassArgs& a, const Layout& l, int64_t thread, int64_t threads,
                                 uint8_t* region, bool amx, float* mass, int64_t mass_width) {
  Heads heads(l, region, amx);
  if (amx) configure_tiles(l);
  rows_of_thread(a, l, thread, threads, heads, mass, mass_width);
  if (amx) release_tiles();
}
#endif

void check_args(const DecodeMassArgs& a, int64_t mass_width) {
  if (a.batch < 1 || a.num_layers < 1 || a.num_heads < 1 || a.num_kv_heads < 1 || a.head_dim < 1 ||
      a.tokens_per_block < 1 || a.table_width < 1)
    throw std::invalid_argument("decode mass: batch, layers, heads, kv heads, head_dim, tokens_per_block and the "
                                "table's width must be positive");
  if (a.num_heads % a.num_kv_heads)
    throw std::invalid_argument("decode mass: " + std::to_string(a.num_heads) + " query heads do not share " +
                                std::to_string(a.num_kv_heads) + " KV heads evenly");
  if (!decode_mass_bf16_applies(a.tokens_per_block, a.head_dim))
    throw std::invalid_argument("decode mass: head_dim " + std::to_string(a.head_dim) + ", tokens_per_block " +
                                std::to_string(a.tokens_per_block) + ": not a geometry the pass takes");
  if (!a.q || !a.keys || !a.block_table || !a.kv_lens || !a.layers)
    throw std::invalid_argument("decode mass: missing queries, keys, block table, lengths or layers");
  for (int64_t layer = 0; layer < a.num_layers; ++layer)
    if (a.layers[layer] < 0 || a.layers[layer] >= a.num_pool_layers)
      throw std::invalid_argument("decode mass: pool layer " + std::to_string(a.layers[layer]) + " outside [0, " +
                                  std::to_string(a.num_pool_layers) + ")");
  const int64_t longest = std::min(a.table_width * a.tokens_per_block, mass_width);
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t n = a.kv_lens[b];
    if (n < 1 || n > longest)
      throw std::invalid_argument("decode mass: row " + std::to_string(b) + ": kv_len " + std::to_string(n) +
                                  " outside [1, " + std::to_string(longest) + "]");
    for (int64_t i = 0; i < (n + a.tokens_per_block - 1) / a.tokens_per_block; ++i) {
      const int64_t block = a.block_table[b * a.table_width + i];
      if (block < 0 || block >= a.num_pool_blocks)  // a wrong id would read outside the pool
        throw std::invalid_argument("decode mass: row " + std::to_string(b) + ": block " + std::to_string(block) +
                                    " outside the pool's " + std::to_string(a.num_pool_blocks));
    }
  }
}

}  // namespace

bool decode_mass_bf16_applies(int64_t tokens_per_block, int64_t head_dim) {
  return head_dim > 0 && head_dim % 2 == 0 && tokens_per_block > 0 &&
         (tokens_per_block < 16 || tokens_per_block % 16 == 0);
}

int64_t decode_mass_workspace_bytes(int64_t max_kv_len, int64_t tokens_per_block, int64_t head_dim, int64_t batch,
                                    int64_t threads) {
  if (max_kv_len < 1 || tokens_per_block < 1 || head_dim < 1 || batch < 1 || threads < 1)
    throw std::invalid_argument("decode mass workspace: kv_len, tokens_per_block, head_dim, batch and threads must "
                                "be positive");
  return Layout(max_kv_len, tokens_per_block, head_dim).total(threads_used(threads, batch));
}

void decode_mass_bf16(const DecodeMassArgs& a, uint8_t* workspace, int64_t workspace_bytes, int64_t threads,
                      float* mass, int64_t mass_width) {
  check_args(a, mass_width);
  const int64_t longest = *std::max_element(a.kv_lens, a.kv_lens + a.batch);
  const int64_t needed = decode_mass_workspace_bytes(longest, a.tokens_per_block, a.head_dim, a.batch, threads);
  require_workspace("decode mass", workspace_bytes, needed);
  const char* kind = require_kind("decode mass", bf16_mass_kind(), "AMX-BF16 and AVX-512 BF16");
#if VTOKEN_AMX
  const Layout l(longest, a.tokens_per_block, a.head_dim);
  const int64_t n = threads_used(threads, a.batch);
  uint8_t* base = aligned_start(workspace);
  const bool amx = std::string(kind) == "amx";
  run_workers(n, [&](int64_t t) { worker(a, l, t, n, base + t * l.per_thread, amx, mass, mass_width); });
#else
  (void)workspace;
  (void)mass;
  (void)kind;
#endif
}

}  // namespace vtoken
