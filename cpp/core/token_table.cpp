// SPDX-License-Identifier: Apache-2.0
// The token table's mutations and queries; each mirrors the Python method of the same name in
// trtllm_vtoken/core/token_table.py (validation order and messages included). Its block release
// (truncate, release_blocks): release.cpp; its planners: planner.cpp.
#include "token_table.h"

#include <algorithm>

#include "table_common.h"

namespace vtoken {

using table_common::ceil_div;
using table_common::fail;
using table_common::has_repeats;

namespace {

std::string int128_to_string(__int128 value) {
  if (value >= INT64_MIN && value <= INT64_MAX) return std::to_string(static_cast<int64_t>(value));
  unsigned __int128 magnitude = value < 0 ? -static_cast<unsigned __int128>(value) : value;
  std::string digits;
  for (; magnitude; magnitude /= 10) digits.insert(digits.begin(), static_cast<char>('0' + magnitude % 10));
  return value < 0 ? "-" + digits : digits;
}

}  // namespace

// No iostreams in this library: a process that loaded another libstdc++ first (a framework's
// bundled one) can hand us locale facets of a different ABI, and formatting a number through them
// crashed on such a machine. std::to_string does not touch the locale.
std::string repr(const std::vector<int64_t>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(values[i]);
  }
  return out + "]";
}

TokenTable::TokenTable(int64_t tokens_per_block) : tpb_(tokens_per_block) {
  if (tokens_per_block <= 0) {
    throw std::invalid_argument("tokens_per_block must be positive, got " + std::to_string(tokens_per_block));
  }
}

void TokenTable::set_shared(int64_t block_id, bool shared) {
  if (shared) {
    shared_.insert(block_id);
  } else {
    shared_.erase(block_id);
  }
}

const Sequence& TokenTable::seq(int64_t req_id) const {
  const int64_t slot = slot_of_request_.find(req_id);
  if (slot == FlatIndex::kAbsent) throw UnknownRequest("unknown request " + std::to_string(req_id));
  return *seqs_[slot];
}

Sequence& TokenTable::mut(int64_t req_id) { return const_cast<Sequence&>(seq(req_id)); }

void TokenTable::add_request(int64_t req_id) {
  if (req_id < 0) {  // also keeps -2**63, the request index's empty-entry marker, out
    throw std::invalid_argument("request id " + std::to_string(req_id) +
                                " is negative: request ids lie in [0, 9223372036854775807]");
  }
  if (contains(req_id)) {
    throw std::invalid_argument("request " + std::to_string(req_id) + " is already in the token table");
  }
  int64_t slot = static_cast<int64_t>(seqs_.size());
  if (free_seq_slots_.empty()) {
    seqs_.emplace_back();
  } else {
    slot = free_seq_slots_.back();
    free_seq_slots_.pop_back();
  }
  seqs_[slot] = std::make_unique<Sequence>();
  slot_of_request_.insert(req_id, slot);
  order_.push_back(req_id);
}

std::vector<int64_t> TokenTable::remove_request(int64_t req_id) {
  std::vector<int64_t> blocks = seq(req_id).block_ids;
  holders_.let_go(blocks.data(), static_cast<int64_t>(blocks.size()));
  const int64_t slot = slot_of_request_.find(req_id);
  seqs_[slot].reset();
  free_seq_slots_.push_back(slot);
  slot_of_request_.erase(req_id);
  order_.erase(std::find(order_.begin(), order_.end(), req_id));
  return blocks;
}

int64_t TokenTable::sync_new_tokens(int64_t req_id, const std::vector<int64_t>& block_ids,
                                    int64_t total_len) {
  const Sequence& s = seq(req_id);
  const size_t known = s.block_ids.size();
  if (block_ids.size() < known || !std::equal(s.block_ids.begin(), s.block_ids.end(), block_ids.begin())) {
    fail(req_id, "block list must extend the current one " + repr(s.block_ids) + ", got " + repr(block_ids));
  }
  return append(req_id, block_ids.data() + known, static_cast<int64_t>(block_ids.size() - known),
                static_cast<__int128>(total_len) - s.kv_len);
}

int64_t TokenTable::append_tokens(int64_t req_id, const int64_t* added, int64_t num_added, int64_t num_new) {
  return append(req_id, added, num_added, num_new);
}

// num_new is 128-bit so that kv_len + num_new never overflows: the error names the length asked
// for, as Python's integers do.
int64_t TokenTable::append(int64_t req_id, const int64_t* added, int64_t num_added, __int128 num_new_wide) {
  Sequence& s = mut(req_id);
  if (num_added) {
    const std::vector<int64_t> fresh(added, added + num_added);
    bool bad = has_repeats(fresh);
    for (int64_t b : fresh) bad = bad || s.block_index.contains(b) || b < 0 || b >= max_block_id();
    if (bad) {
      fail(req_id, "new blocks " + repr(fresh) + " repeat a block or lie outside [0, " +
                       std::to_string(max_block_id()) + ") (slots are int32: block * " + std::to_string(tpb_) +
                       " + offset)");
    }
    std::vector<int64_t> held;
    for (int64_t b : fresh) {
      if (held_unshared(b)) held.push_back(b);
    }
    if (!held.empty()) {
      fail(req_id, "new blocks " + repr(held) + " are held by another request (only a shared block may join "
                       "several requests)");
    }
  }
  const int64_t known = static_cast<int64_t>(s.block_ids.size());
  const int64_t num_blocks = known + num_added;
  const int64_t capacity = num_blocks * tpb_;  // at most 2**31: block ids lie below max_block_id()
  const __int128 wide_total = s.kv_len + num_new_wide;
  if (num_new_wide < 0 || wide_total > capacity) {
    fail(req_id, "total_len " + int128_to_string(wide_total) + " must lie in [" + std::to_string(s.kv_len) +
                     ", " + std::to_string(capacity) + "] (current length, capacity of " +
                     std::to_string(num_blocks) + " blocks)");
  }
  const auto num_new = static_cast<int64_t>(num_new_wide);
  const int64_t total_len = s.kv_len + num_new;
  if (num_new > 0 && !shared_.empty()) {
    // Never write into a shared block; register one only whole (a shared prefix), so that no
    // request's length ends inside a shared block and its next token starts a fresh one.
    auto block_at = [&](int64_t pos) { return pos / tpb_ < known ? s.block_ids[pos / tpb_] : added[pos / tpb_ - known]; };
    if (s.kv_len % tpb_ && is_shared(block_at(s.kv_len))) {
      fail(req_id, "position " + std::to_string(s.kv_len) + " is in shared block " +
                       std::to_string(block_at(s.kv_len)) + ": a request never writes into a shared block");
    }
    if (total_len % tpb_ && is_shared(block_at(total_len))) {
      fail(req_id, "length " + std::to_string(total_len) + " would end inside shared block " +
                       std::to_string(block_at(total_len)) + ": a shared block is registered whole");
    }
  }
  for (int64_t i = 0; i < num_added; ++i) {
    s.block_index.insert(added[i], static_cast<int64_t>(s.block_ids.size()));
    s.block_ids.push_back(added[i]);
  }
  holders_.hold(added, num_added);
  s.token_at.resize(s.block_ids.size() * tpb_, kNoToken);
  s.live_per_block.resize(s.block_ids.size(), 0);
  const int64_t first_id = s.num_tokens;
  for (int64_t pos = s.kv_len; pos < total_len; ++pos) {
    const int64_t token = first_id + (pos - s.kv_len);
    s.slot_of.push_back(static_cast<int32_t>(s.block_ids[pos / tpb_] * tpb_ + pos % tpb_));
    s.live.push_back(1);
    s.token_at[pos] = static_cast<int32_t>(token);
    s.live_per_block[pos / tpb_] += 1;
  }
  s.num_tokens += num_new;
  s.num_live += num_new;
  s.kv_len = total_len;
  s.version += 1;
  return first_id;
}

void TokenTable::evict_tokens(int64_t req_id, const std::vector<int64_t>& token_ids) {
  Sequence& s = mut(req_id);
  if (has_repeats(token_ids)) fail(req_id, "token ids to evict repeat: " + repr(token_ids));
  std::vector<int64_t>& positions = scratch_;
  positions.clear();
  for (int64_t t : token_ids) {
    if (t < 0 || t >= s.num_tokens) {
      fail(req_id, "token id " + std::to_string(t) + " out of range [0, " + std::to_string(s.num_tokens) + ")");
    }
    if (!s.live[t]) fail(req_id, "token " + std::to_string(t) + " is already dead");
    const int64_t slot = s.slot_of[t];
    if (is_shared(slot / tpb_)) {
      fail(req_id, "token " + std::to_string(t) + " is protected: block " + std::to_string(slot / tpb_) + " is shared");
    }
    positions.push_back(s.block_index.find(slot / tpb_) * tpb_ + slot % tpb_);
  }
  for (size_t i = 0; i < token_ids.size(); ++i) {
    s.live[token_ids[i]] = 0;
    s.live_per_block[positions[i] / tpb_] -= 1;
  }
  s.pending_dead.insert(s.pending_dead.end(), positions.begin(), positions.end());
  s.num_live -= static_cast<int64_t>(token_ids.size());
  s.version += 1;
}

int64_t TokenTable::position_of_token(int64_t req_id, const Sequence& s, int64_t token_id) const {
  if (token_id < 0 || token_id >= s.num_tokens) {
    fail(req_id, "token id " + std::to_string(token_id) + " out of range [0, " + std::to_string(s.num_tokens) + ")");
  }
  const int64_t slot = s.slot_of[token_id];
  if (slot == kNoSlot) fail(req_id, "token " + std::to_string(token_id) + " holds no slot to move from");
  return s.block_index.find(slot / tpb_) * tpb_ + slot % tpb_;
}

int64_t TokenTable::writable_position(int64_t req_id, const Sequence& s, int64_t slot) const {
  // Python's divmod floors; only non-negative slots reach the lookup.
  const int64_t block_id = slot >= 0 ? slot / tpb_ : -1;
  if (slot < 0 || !s.block_index.contains(block_id)) {
    fail(req_id, "slot " + std::to_string(slot) + " is not in one of its blocks");
  }
  if (is_shared(block_id)) {
    fail(req_id, "slot " + std::to_string(slot) + " is in shared block " + std::to_string(block_id));
  }
  const int64_t pos = s.block_index.find(block_id) * tpb_ + slot % tpb_;
  if (pos >= s.kv_len) {
    fail(req_id, "slot " + std::to_string(slot) + " lies beyond kv_len " + std::to_string(s.kv_len));
  }
  return pos;
}

void TokenTable::apply_moves(int64_t req_id, const std::vector<int64_t>& token_ids,
                             const std::vector<int64_t>& dst_slots) {
  Sequence& s = mut(req_id);
  if (token_ids.size() != dst_slots.size()) {
    fail(req_id, std::to_string(token_ids.size()) + " tokens but " + std::to_string(dst_slots.size()) +
                     " destination slots");
  }
  if (has_repeats(token_ids) || has_repeats(dst_slots)) {
    fail(req_id, "a token or a destination slot repeats in the moves");
  }
  std::vector<int64_t>& src_pos = src_pos_;
  std::vector<int64_t>& dst_pos = dst_pos_;
  src_pos.clear();
  dst_pos.clear();
  for (int64_t t : token_ids) src_pos.push_back(position_of_token(req_id, s, t));
  for (int64_t d : dst_slots) dst_pos.push_back(writable_position(req_id, s, d));
  const IdSet moving_from(src_pos);
  for (size_t i = 0; i < token_ids.size(); ++i) {
    if (moving_from.count(dst_pos[i])) {
      fail(req_id, "slot " + std::to_string(dst_slots[i]) + " is the source of another move");
    }
    const int32_t occupant = s.token_at[dst_pos[i]];
    if (occupant != kNoToken && s.live[occupant]) {
      fail(req_id, "slot " + std::to_string(dst_slots[i]) + " is occupied by live token " + std::to_string(occupant));
    }
    if (is_shared(s.block_ids[src_pos[i] / tpb_])) {
      fail(req_id, "token " + std::to_string(token_ids[i]) + " sits in a shared block");
    }
  }
  std::vector<int64_t>& filled = filled_;
  filled.clear();
  for (size_t i = 0; i < token_ids.size(); ++i) {
    const int64_t t = token_ids[i], src = src_pos[i], pos = dst_pos[i];
    const int32_t occupant = s.token_at[pos];
    if (occupant != kNoToken) s.slot_of[occupant] = kNoSlot;
    s.token_at[src] = kNoToken;
    s.token_at[pos] = static_cast<int32_t>(t);
    s.slot_of[t] = static_cast<int32_t>(dst_slots[i]);
    if (s.live[t]) {
      s.live_per_block[src / tpb_] -= 1;
      s.live_per_block[pos / tpb_] += 1;
      filled.push_back(pos);
    }
  }
  const IdSet filled_set(filled);
  auto& pending = s.pending_dead;
  pending.erase(std::remove_if(pending.begin(), pending.end(), [&](int64_t p) { return filled_set.count(p); }),
                pending.end());
  pending.insert(pending.end(), src_pos.begin(), src_pos.end());
  s.version += 1;
}

std::vector<int64_t> TokenTable::hole_positions(int64_t req_id) { return holes_into(req_id); }

const std::vector<int64_t>& TokenTable::holes_into(int64_t req_id) {
  Sequence& s = mut(req_id);
  auto is_hole = [&](int64_t p) { return s.token_at[p] == kNoToken || !s.live[s.token_at[p]]; };
  std::vector<int64_t>& holes = holes_;
  holes.clear();
  if (s.pending_dead.size() == 1) {  // the decode step's single eviction
    const int64_t p = s.pending_dead[0];
    if (p < s.kv_len && is_hole(p)) {
      holes.push_back(p);
      return holes;
    }
  }
  for (int64_t p : s.pending_dead) {
    if (p < s.kv_len) holes.push_back(p);
  }
  std::sort(holes.begin(), holes.end());
  holes.erase(std::unique(holes.begin(), holes.end()), holes.end());
  holes.erase(std::remove_if(holes.begin(), holes.end(), [&](int64_t p) { return !is_hole(p); }), holes.end());
  s.pending_dead = holes;  // drop stale hints (filled or truncated positions)
  return holes;
}

double TokenTable::metadata_bytes_per_token() const {
  int64_t tokens = 0, bytes = 0;
  for (const auto& seq : seqs_) {
    if (!seq) continue;
    const Sequence& s = *seq;
    const auto blocks = static_cast<int64_t>(s.block_ids.size());
    tokens += s.num_tokens;
    bytes += s.num_tokens * (sizeof(int32_t) + sizeof(uint8_t)) + blocks * tpb_ * sizeof(int32_t) +
             blocks * sizeof(int32_t);
  }
  return static_cast<double>(bytes) / static_cast<double>(std::max<int64_t>(tokens, 1));
}

}  // namespace vtoken
