// SPDX-License-Identifier: Apache-2.0
// The token table's block release, truncate and release_blocks: mirrors of
// trtllm_vtoken/core/block_release.py (validation order and messages included).
#include <algorithm>

#include "table_common.h"
#include "token_table.h"

namespace vtoken {

using table_common::ceil_div;
using table_common::fail;
using table_common::has_repeats;

std::vector<int64_t> TokenTable::truncate(int64_t req_id, int64_t new_kv_len) {
  Sequence& s = mut(req_id);
  if (new_kv_len < 0 || new_kv_len > s.kv_len) {
    fail(req_id, "new length " + std::to_string(new_kv_len) + " not in [0, " + std::to_string(s.kv_len) + "]");
  }
  for (int64_t p = new_kv_len; p < s.kv_len; ++p) {
    if (s.live_at(p)) fail(req_id, "live tokens beyond new length " + std::to_string(new_kv_len));
  }
  if (new_kv_len % tpb_ && is_shared(s.block_ids[new_kv_len / tpb_])) {  // its next token would go there
    fail(req_id, "new length " + std::to_string(new_kv_len) + " would end inside shared block " +
                     std::to_string(s.block_ids[new_kv_len / tpb_]));
  }
  const int64_t keep_blocks = ceil_div(new_kv_len, tpb_);
  std::vector<int64_t> released(s.block_ids.begin() + keep_blocks, s.block_ids.end());
  std::vector<int64_t> shared;
  for (int64_t b : released) {
    if (is_shared(b)) shared.push_back(b);
  }
  if (!shared.empty()) fail(req_id, "cannot release shared blocks " + repr(shared));
  for (int64_t p = new_kv_len; p < s.kv_len; ++p) {
    if (s.token_at[p] != kNoToken) s.slot_of[s.token_at[p]] = kNoSlot;
    s.token_at[p] = kNoToken;
  }
  for (int64_t b : released) s.block_index.erase(b);
  holders_.let_go(released.data(), static_cast<int64_t>(released.size()));
  s.block_ids.resize(keep_blocks);
  s.token_at.resize(keep_blocks * tpb_);
  s.live_per_block.resize(keep_blocks);
  s.kv_len = new_kv_len;
  auto& pending = s.pending_dead;
  pending.erase(std::remove_if(pending.begin(), pending.end(), [&](int64_t p) { return p >= new_kv_len; }),
                pending.end());
  s.version += 1;
  return released;
}

void TokenTable::release_blocks(int64_t req_id, const std::vector<int64_t>& block_ids) {
  Sequence& s = mut(req_id);
  if (has_repeats(block_ids)) fail(req_id, "blocks to release repeat: " + repr(block_ids));
  for (int64_t b : block_ids) {
    const int64_t index = s.block_index.find(b);
    if (index == FlatIndex::kAbsent) fail(req_id, "block " + std::to_string(b) + " is not one of its blocks");
    if (is_shared(b)) fail(req_id, "cannot release shared block " + std::to_string(b));
    if (s.live_per_block[index]) fail(req_id, "block " + std::to_string(b) + " still holds live tokens");
  }
  if (block_ids.empty()) return;
  const int64_t num_blocks = static_cast<int64_t>(s.block_ids.size());
  std::vector<int64_t> drop;
  for (int64_t b : block_ids) drop.push_back(s.block_index.find(b));
  std::sort(drop.begin(), drop.end());
  std::vector<bool> keep(num_blocks, true);
  for (int64_t i : drop) keep[i] = false;
  // Blocks before the first released one keep their place; the kept ones after it shift down in
  // place (a row only ever moves to a lower index), their positions with them.
  int64_t covered = 0;
  int64_t write = drop.front();
  for (int64_t i = drop.front(); i < num_blocks; ++i) {
    if (keep[i]) {
      if (write != i) {
        for (int64_t k = 0; k < tpb_; ++k) s.token_at[write * tpb_ + k] = s.token_at[i * tpb_ + k];
        s.live_per_block[write] = s.live_per_block[i];
        s.block_ids[write] = s.block_ids[i];
      }
      ++write;
      continue;
    }
    for (int64_t p = i * tpb_; p < (i + 1) * tpb_; ++p) {
      if (s.token_at[p] != kNoToken) s.slot_of[s.token_at[p]] = kNoSlot;
    }
    covered += std::clamp<int64_t>(s.kv_len - i * tpb_, 0, tpb_);
  }
  s.token_at.resize(write * tpb_);
  s.live_per_block.resize(write);
  for (int64_t b : block_ids) s.block_index.erase(b);
  holders_.let_go(block_ids.data(), static_cast<int64_t>(block_ids.size()));
  s.block_ids.resize(write);
  for (int64_t i = drop.front(); i < write; ++i) s.block_index.insert(s.block_ids[i], i);
  s.kv_len -= covered;
  std::vector<int64_t> pending;
  for (int64_t p : s.pending_dead) {
    const int64_t block = p / tpb_;
    if (!keep[block]) continue;
    const int64_t shift = std::upper_bound(drop.begin(), drop.end(), block) - drop.begin();
    pending.push_back(p - shift * tpb_);
  }
  s.pending_dead = std::move(pending);
  s.version += 1;
}

}  // namespace vtoken
