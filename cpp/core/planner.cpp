// SPDX-License-Identifier: Apache-2.0
// Dense and lazy relocation planning and plan commit; mirrors reclaim/planner.py (the diagrams
// there) and ReclaimBackend._commit with validate_plan's O(1) checks.
#include <algorithm>

#include "table_common.h"
#include "token_table.h"

namespace vtoken {

using table_common::ceil_div;

// Turns out.src_slots / out.dst_slots, which hold positions on entry, into the plan's fields.
void TokenTable::fill_plan(const Sequence& s, int64_t req_id, bool dense, int64_t new_kv_len, Plan& out) const {
  out.req_id = req_id;
  out.dense = dense;
  out.version = s.version;
  out.token_ids.clear();
  for (int64_t& p : out.src_slots) {
    out.token_ids.push_back(s.token_at[p]);
    p = s.block_ids[p / tpb_] * tpb_ + p % tpb_;
  }
  for (int64_t& p : out.dst_slots) p = s.block_ids[p / tpb_] * tpb_ + p % tpb_;
  out.blocks_before = static_cast<int64_t>(s.block_ids.size());
  out.new_kv_len = new_kv_len;
}

bool TokenTable::plan_dense_into(int64_t req_id, Plan& out) {
  const std::vector<int64_t>& holes = holes_into(req_id);  // ascending
  if (holes.empty()) return false;
  const Sequence& s = seq(req_id);
  const int64_t new_len = s.kv_len - static_cast<int64_t>(holes.size());
  const auto below = std::lower_bound(holes.begin(), holes.end(), new_len);
  const IdSet dead_tail(holes.data() + (below - holes.begin()), static_cast<size_t>(holes.end() - below));
  out.dst_slots.assign(holes.begin(), below);  // positions until fill_plan
  out.src_slots.clear();
  for (int64_t p = s.kv_len - 1; p >= new_len; --p) {
    if (!dead_tail.count(p)) out.src_slots.push_back(p);
  }
  if (out.src_slots.size() != out.dst_slots.size()) {  // a broken table: the moves would overwrite live KV
    throw std::runtime_error("dense plan for request " + std::to_string(req_id) + ": " +
                             std::to_string(out.src_slots.size()) + " live tokens above the new length " +
                             std::to_string(new_len) + " but " + std::to_string(out.dst_slots.size()) +
                             " holes below it");
  }
  out.blocks_to_free.assign(s.block_ids.begin() + ceil_div(new_len, tpb_), s.block_ids.end());
  int64_t kept_len = new_len;
  if (!shared_.empty()) {
    bool touches_shared = false;
    for (int64_t b : out.blocks_to_free) touches_shared = touches_shared || is_shared(b);
    for (int64_t p : out.src_slots) touches_shared = touches_shared || is_shared(s.block_ids[p / tpb_]);
    for (int64_t p : out.dst_slots) touches_shared = touches_shared || is_shared(s.block_ids[p / tpb_]);
    if (touches_shared) return false;
    // The length never ends inside a shared block (planner.py): it stays at that block's end.
    if (new_len % tpb_ && is_shared(s.block_ids[new_len / tpb_])) {
      kept_len = std::min(s.kv_len, (new_len / tpb_ + 1) * tpb_);
      if (out.src_slots.empty() && out.blocks_to_free.empty() && kept_len == s.kv_len) return false;
    }
  }
  fill_plan(s, req_id, true, kept_len, out);
  return true;
}

bool TokenTable::plan_lazy_into(int64_t req_id, Plan& out) {
  // Holes are among the pending hints: too few to empty a block means no plan, no rescan.
  if (static_cast<int64_t>(seq(req_id).pending_dead.size()) < tpb_) return false;
  const std::vector<int64_t>& holes = holes_into(req_id);
  if (static_cast<int64_t>(holes.size()) < tpb_) return false;
  const Sequence& s = seq(req_id);
  std::vector<int64_t> usable;
  for (int64_t h : holes) {
    if (!is_shared(s.block_ids[h / tpb_])) usable.push_back(h);
  }
  const int64_t full_blocks = s.kv_len / tpb_;
  std::vector<int64_t> candidates;
  for (int64_t i = 0; i < full_blocks; ++i) {
    if (!is_shared(s.block_ids[i])) candidates.push_back(i);
  }
  const auto num_to_free = std::min<int64_t>(static_cast<int64_t>(usable.size()) / tpb_,
                                             static_cast<int64_t>(candidates.size()));
  if (num_to_free == 0) return false;
  const auto& live = s.live_per_block;
  // Fewest live tokens first; among equals the later block (see planner.py).
  std::sort(candidates.begin(), candidates.end(), [&](int64_t a, int64_t b) {
    return live[a] != live[b] ? live[a] < live[b] : a > b;
  });
  std::vector<int64_t> sources(candidates.begin(), candidates.begin() + num_to_free);
  std::sort(sources.begin(), sources.end());
  const IdSet source_set(sources);
  out.src_slots.clear();
  for (int64_t i : sources) {
    for (int64_t p = i * tpb_; p < (i + 1) * tpb_; ++p) {
      if (s.live_at(p)) out.src_slots.push_back(p);
    }
  }
  // Destinations: holes of the kept blocks, fullest block first.
  std::vector<int64_t> targets;
  for (int64_t h : usable) {
    if (!source_set.count(h / tpb_)) targets.push_back(h);
  }
  std::sort(targets.begin(), targets.end(), [&](int64_t a, int64_t b) {
    const int32_t la = live[a / tpb_], lb = live[b / tpb_];
    return la != lb ? la > lb : a < b;
  });
  if (targets.size() < out.src_slots.size()) {  // a broken table: the sources' live KV would be lost
    throw std::runtime_error("lazy plan for request " + std::to_string(req_id) + ": " +
                             std::to_string(targets.size()) + " holes for the " +
                             std::to_string(out.src_slots.size()) + " live tokens of the chosen sources");
  }
  out.dst_slots.assign(targets.begin(), targets.begin() + out.src_slots.size());
  out.blocks_to_free.clear();
  for (int64_t i : sources) out.blocks_to_free.push_back(s.block_ids[i]);
  fill_plan(s, req_id, false, -1, out);
  return true;
}

std::optional<Plan> TokenTable::plan_dense(int64_t req_id) {
  Plan plan;
  if (!plan_dense_into(req_id, plan)) return std::nullopt;
  return plan;
}

std::optional<Plan> TokenTable::plan_lazy(int64_t req_id) {
  Plan plan;
  if (!plan_lazy_into(req_id, plan)) return std::nullopt;
  return plan;
}

int64_t TokenTable::fragmentation(int64_t req_id) const {
  const Sequence& s = seq(req_id);
  return static_cast<int64_t>(s.block_ids.size()) - ceil_div(s.num_live, tpb_);
}

void TokenTable::commit_in_place(const Plan& plan) {
  const int64_t req_id = plan.req_id;
  const Sequence& s = seq(req_id);
  if (plan.dense && plan.version != s.version) {
    throw std::invalid_argument("plan for request " + std::to_string(req_id) + " was taken from table version " +
                                std::to_string(plan.version) + ", table is at " + std::to_string(s.version));
  }
  const auto blocks_after = plan.blocks_before - static_cast<int64_t>(plan.blocks_to_free.size());
  if (!plan.dense && blocks_after >= plan.blocks_before) {
    throw std::invalid_argument("lazy plan for request " + std::to_string(req_id) + " does not reduce its " +
                                std::to_string(plan.blocks_before) + " blocks");
  }
  if (!plan.dense) check_lazy_commit(plan);  // may commit after evictions and appends (background)
  apply_moves(req_id, plan.token_ids, plan.dst_slots);
  if (plan.dense) {
    const std::vector<int64_t> released = truncate(req_id, plan.new_kv_len);
    if (released != plan.blocks_to_free) {  // unreachable: the version check pins the snapshot
      throw std::runtime_error("released " + repr(released) + ", planned " + repr(plan.blocks_to_free));
    }
  } else {
    release_blocks(req_id, plan.blocks_to_free);
  }
}

// A lazy plan whose copy ran in the background commits if its copy is still what the table needs:
// every token still sits at its planned source (the KV copied is its KV) and, once the moves are
// applied, no released block holds a live token. Checked before anything changes, as
// reclaim/planner.py's check_commit; apply_moves then re-checks its own rules before changing.
void TokenTable::check_lazy_commit(const Plan& plan) const {
  const int64_t req_id = plan.req_id;
  const Sequence& s = seq(req_id);
  if (plan.src_slots.size() != plan.token_ids.size()) {
    fail_plan(req_id, "moves and sources differ in number");
  }
  std::vector<int64_t> leaving(plan.blocks_to_free.size(), 0);
  for (size_t i = 0; i < plan.token_ids.size(); ++i) {
    const int64_t t = plan.token_ids[i];
    if (t < 0 || t >= s.num_tokens || s.slot_of[t] != plan.src_slots[i]) {
      fail_plan(req_id, "token " + std::to_string(t) + " is no longer at its planned source " +
                            std::to_string(plan.src_slots[i]));
    }
    for (size_t k = 0; k < plan.blocks_to_free.size(); ++k) {
      if (plan.src_slots[i] / tpb_ == plan.blocks_to_free[k] && s.live[t]) ++leaving[k];
    }
  }
  // release_blocks' own refusals, in its words (core/table_checks.py check_release), as they would
  // stand once the moves are applied.
  auto refuse = [req_id](const std::string& what) {
    throw std::invalid_argument("request " + std::to_string(req_id) + ": " + what);
  };
  for (size_t k = 0; k < plan.blocks_to_free.size(); ++k) {
    const int64_t b = plan.blocks_to_free[k], index = s.block_index.find(b);
    if (index == FlatIndex::kAbsent) refuse("block " + std::to_string(b) + " is not one of its blocks");
    if (is_shared(b)) refuse("cannot release shared block " + std::to_string(b));
    if (s.live_per_block[index] != leaving[k]) refuse("block " + std::to_string(b) + " still holds live tokens");
  }
}

void TokenTable::fail_plan(int64_t req_id, const std::string& what) {
  throw std::invalid_argument("plan for request " + std::to_string(req_id) + ": " + what);
}

std::vector<int64_t> TokenTable::commit(const Plan& plan) {
  commit_in_place(plan);
  return plan.blocks_to_free;
}

bool TokenTable::fill_single_hole(int64_t req_id, int64_t& num_moves, std::vector<int64_t>& released) {
  Sequence& s = mut(req_id);
  if (s.pending_dead.size() != 1) return false;
  const int64_t hole = s.pending_dead[0];
  if (hole >= s.kv_len) return false;
  const int32_t evicted = s.token_at[hole];
  if (evicted == kNoToken || s.live[evicted]) return false;  // a stale hint or an empty hole
  const int64_t new_len = s.kv_len - 1;
  const int64_t keep_blocks = ceil_div(new_len, tpb_);
  const auto num_blocks = static_cast<int64_t>(s.block_ids.size());
  // The tail block shared: the length may not end inside it (plan_dense keeps it at its end).
  if (is_shared(s.block_ids[hole / tpb_]) || is_shared(s.block_ids[new_len / tpb_])) return false;
  for (int64_t i = keep_blocks; i < num_blocks; ++i) {
    if (is_shared(s.block_ids[i])) return false;
  }
  const int32_t moved = s.token_at[new_len];
  if (hole < new_len && (moved == kNoToken || !s.live[moved])) return false;
  num_moves = 0;
  if (hole < new_len) {  // the last token moves into the hole; the evicted token loses its slot
    s.slot_of[evicted] = kNoSlot;
    s.token_at[hole] = moved;
    s.slot_of[moved] = static_cast<int32_t>(s.block_ids[hole / tpb_] * tpb_ + hole % tpb_);
    s.live_per_block[new_len / tpb_] -= 1;
    s.live_per_block[hole / tpb_] += 1;
    num_moves = 1;
  } else {  // the evicted token was the last one
    s.slot_of[moved] = kNoSlot;
  }
  s.token_at[new_len] = kNoToken;
  for (int64_t i = keep_blocks; i < num_blocks; ++i) {
    released.push_back(s.block_ids[i]);
    s.block_index.erase(s.block_ids[i]);
  }
  holders_.let_go(s.block_ids.data() + keep_blocks, num_blocks - keep_blocks);
  s.block_ids.resize(keep_blocks);
  s.token_at.resize(keep_blocks * tpb_);
  s.live_per_block.resize(keep_blocks);
  s.kv_len = new_len;
  s.pending_dead.clear();
  s.version += 2;  // apply_moves, then truncate
  return true;
}

}  // namespace vtoken
