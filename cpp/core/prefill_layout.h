// SPDX-License-Identifier: Apache-2.0
// What the prefill mass pass's parts share (prefill_mass.cpp: the scores, softmax and sums;
// prefill_pack.cpp: the keys and queries laid out for them): the kind of scores, the workspace's
// regions and the packing. Internal to the pass; prefill_mass.h is its interface.
#pragma once

#include <cstdint>
#include <string>

#include "amx.h"
#include "prefill_mass.h"

namespace vtoken::prefill {

constexpr int64_t kTileRows = 16;   // queries per tile (an AMX tile's rows)
constexpr int64_t kChunk = 32;      // bf16 dims per tile row (64 bytes)
constexpr int64_t kSuperBlock = 64; // keys scored at once (four C tiles, or 4 x 16 lanes)

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// How the scores are computed (prefill_mass_kind): AMX tiles and AVX-512 BF16 dot products read
// bf16 pairs, FMAs float32.
enum class Scorer { kAmx, kDotBf16, kFma };

inline Scorer scorer_of(const char* kind) {
  const std::string name = kind == nullptr ? "avx512" : kind;
  return name == "amx" ? Scorer::kAmx : name == "avx512-bf16" ? Scorer::kDotBf16 : Scorer::kFma;
}

// The workspace's regions (prefill_mass.cpp draws them), in bytes, and the padded key counts.
struct Layout {
  int64_t keys64, keys16, chunks;
  int64_t packed_bytes, scores_bytes, queries_bytes, per_thread, partials_bytes;

  Layout(int64_t num_keys, int64_t num_kv_heads, int64_t head_dim, Scorer scorer)
      : keys64(round_up(num_keys, kSuperBlock)), keys16(round_up(num_keys, 16)),
        chunks(round_up(head_dim, kChunk) / kChunk) {
    const bool pairs = scorer != Scorer::kFma;
    packed_bytes = round_up(pairs ? keys64 * chunks * kChunk * 2 : keys64 * head_dim * 4, kWorkspaceAlign);
    scores_bytes = round_up(kTileRows * keys64 * 4, kWorkspaceAlign);
    queries_bytes = round_up(pairs ? kTileRows * chunks * kChunk * 2 : kTileRows * head_dim * 4, kWorkspaceAlign);
    per_thread = packed_bytes + scores_bytes + queries_bytes;
    partials_bytes = round_up(num_kv_heads * keys16 * 4, kWorkspaceAlign);
  }
  int64_t total(int64_t threads) const { return kWorkspaceAlign + threads * per_thread + partials_bytes; }
};

// KV head `kv_head`'s keys (past, then the row's own) into `packed` (l.packed_bytes, zero-padded):
// bf16 pairs [keys/16][chunks][16 pairs][16 keys][2] for the pair scorers, float32
// [keys/16][head_dim][16 keys] for FMAs.
void pack_keys(const PrefillMassArgs& a, const Layout& l, Scorer scorer, int64_t kv_head, uint8_t* packed);

// The tile's `rows` queries of head `head` from query `first` on into `queries` (l.queries_bytes,
// zero-padded): bf16 rows as they are [16][chunks * 32], or as float32 [16][head_dim] for FMAs.
void pack_queries(const PrefillMassArgs& a, const Layout& l, Scorer scorer, int64_t head, int64_t first,
                  int64_t rows, uint8_t* queries);

}  // namespace vtoken::prefill
