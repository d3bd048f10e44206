// SPDX-License-Identifier: Apache-2.0
#include "slots.h"

#include <algorithm>
#include <cstring>

namespace vtoken {

std::string check_new(const SlotArrays& a, const int64_t* req_ids, const int64_t* rows, int64_t batch,
                      int64_t num_rows, const int64_t* offsets, const int64_t* blocks, int64_t num_given,
                      const int64_t* num_new, int64_t num_blocks, const TokenTable& table) {
  std::vector<char> seen(static_cast<size_t>(num_rows), 0);  // a request is one row: a row twice is a request twice
  for (int64_t i = 0; i < batch; ++i) {
    if (seen[rows[i]]++) return "step: a request appears twice in the batch";
  }
  bool monotone = offsets[0] == 0 && offsets[batch] == num_given;
  for (int64_t i = 0; i < batch && monotone; ++i) monotone = offsets[i + 1] >= offsets[i];
  if (!monotone) return "step: new_block_offsets must start at 0, never decrease and end at len(new_blocks)";
  std::string negative;  // as Python prints a list: the first four
  for (int64_t i = 0, listed = 0; i < batch && listed < 4; ++i) {
    if (num_new[i] >= 0) continue;
    negative += (listed++ ? ", " : "") + std::to_string(num_new[i]);
  }
  if (!negative.empty()) return "step: num_new must be >= 0, got [" + negative + "]";
  if (num_given > 0) {
    const auto [low, high] = std::minmax_element(blocks, blocks + num_given);
    if (*low < 0 || *high >= num_blocks) return "step: new block ids must lie in [0, " + std::to_string(num_blocks) + ")";
    std::vector<int64_t> sorted(blocks, blocks + num_given);
    std::sort(sorted.begin(), sorted.end());
    for (int64_t k = 1; k < num_given; ++k) {
      if (sorted[k] == sorted[k - 1] && !table.is_shared(sorted[k])) {
        return "step: a new block is given twice (only a shared block may join several requests)";
      }
    }
    for (int64_t k = 0; k < num_given; ++k) {
      if (table.held_unshared(blocks[k])) {
        return "step: new block " + std::to_string(blocks[k]) +
               " is held by a request already (only a shared block may join several requests)";
      }
    }
  }
  const int64_t tpb = a.tokens_per_block;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t row = rows[i], held = a.num_blocks_of[row] + offsets[i + 1] - offsets[i];
    if (a.kv_len[row] + num_new[i] > held * tpb) {
      return "step: request " + std::to_string(req_ids[i]) + "'s " + std::to_string(num_new[i]) +
             " new tokens do not fit its blocks";
    }
  }
  return "";
}

std::vector<int64_t> register_new(SlotArrays& a, const int64_t* rows, int64_t batch, const int64_t* offsets,
                                  const int64_t* blocks, const int64_t* num_new) {
  const int64_t tpb = a.tokens_per_block;
  std::vector<int64_t> slots;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t row = rows[i];
    int32_t* table = a.block_table + row * a.block_stride;
    for (int64_t k = offsets[i]; k < offsets[i + 1]; ++k) table[a.num_blocks_of[row]++] = static_cast<int32_t>(blocks[k]);
    const int64_t start = a.kv_len[row], first_id = a.num_tokens[row];
    for (int64_t k = 0; k < num_new[i]; ++k) {
      const int64_t position = start + k;
      const int64_t slot = static_cast<int64_t>(table[position / tpb]) * tpb + position % tpb;
      a.tokens[slot] = static_cast<int32_t>(first_id + k);
      for (const SlotStat& stat : a.stats) std::memset(stat.data + slot * stat.item_size, 0, stat.item_size);
      slots.push_back(slot);
    }
    a.kv_len[row] += num_new[i];
    a.num_tokens[row] += num_new[i];
    a.num_live[row] += num_new[i];
  }
  return slots;
}

void apply_step(SlotArrays& a, const int64_t* victim_rows, const int64_t* victim_slots, int64_t num_victims,
                const int64_t* move_src, const int64_t* move_dst, int64_t num_moves, const int64_t* rows,
                const int64_t* req_ids, int64_t batch, const int64_t* kv_lens, const int64_t* freed_offsets,
                bool tail_only, const TokenTable& table) {
  for (int64_t k = 0; k < num_victims; ++k) {
    a.tokens[victim_slots[k]] = kNoToken;
    --a.num_live[victim_rows[k]];
  }
  // Sources and destinations are disjoint: moving one by one reads what a gather would.
  for (int64_t k = 0; k < num_moves; ++k) {
    a.tokens[move_dst[k]] = a.tokens[move_src[k]];
    for (const SlotStat& stat : a.stats) {
      std::memcpy(stat.data + move_dst[k] * stat.item_size, stat.data + move_src[k] * stat.item_size, stat.item_size);
    }
  }
  for (int64_t k = 0; k < num_moves; ++k) a.tokens[move_src[k]] = kNoToken;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t row = rows[i], released = freed_offsets[i + 1] - freed_offsets[i];
    a.kv_len[row] = kv_lens[i];
    if (released == 0) continue;
    int32_t* columns = a.block_table + row * a.block_stride;
    if (tail_only) {
      const int64_t kept = a.num_blocks_of[row] - released;
      for (int64_t c = kept; c < a.num_blocks_of[row]; ++c) columns[c] = a.scratch;
      a.num_blocks_of[row] = kept;
      continue;
    }
    const std::vector<int64_t>& listed = table.seq(req_ids[i]).block_ids;
    for (int64_t c = 0; c < a.block_stride; ++c) {
      columns[c] = c < static_cast<int64_t>(listed.size()) ? static_cast<int32_t>(listed[c]) : a.scratch;
    }
    a.num_blocks_of[row] = static_cast<int64_t>(listed.size());
  }
}

std::vector<int64_t> protected_live(const SlotArrays& a, const int64_t* rows, int64_t batch, const TokenTable& table) {
  std::vector<int64_t> out(static_cast<size_t>(batch), 0);
  const int64_t tpb = a.tokens_per_block;
  for (int64_t i = 0; i < batch; ++i) {
    const int32_t* blocks = a.block_table + rows[i] * a.block_stride;
    for (int64_t c = 0; c < a.num_blocks_of[rows[i]]; ++c) {
      if (!table.is_shared(blocks[c])) continue;
      const int32_t* tokens = a.tokens + static_cast<int64_t>(blocks[c]) * tpb;
      for (int64_t o = 0; o < tpb; ++o) out[i] += tokens[o] != kNoToken;
    }
  }
  return out;
}

}  // namespace vtoken
