// SPDX-License-Identifier: Apache-2.0
// Dense and lazy relocation planning and plan commit; mirrors reclaim/planner.py (the diagrams
// there) and ReclaimBackend._commit with validate_plan's O(1) checks.
#include <algorithm>
#include <unordered_set>

#include "token_table.h"

namespace vtoken {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

Plan TokenTable::make_plan(int64_t req_id, bool dense, const std::vector<int64_t>& src_pos,
                           const std::vector<int64_t>& dst_pos, std::vector<int64_t> blocks_to_free,
                           int64_t new_kv_len) const {
  const Sequence& s = seq(req_id);
  Plan plan;
  plan.req_id = req_id;
  plan.dense = dense;
  plan.version = s.version;
  for (int64_t p : src_pos) {
    plan.token_ids.push_back(s.token_at[p]);
    plan.src_slots.push_back(s.block_ids[p / tpb_] * tpb_ + p % tpb_);
  }
  for (int64_t p : dst_pos) plan.dst_slots.push_back(s.block_ids[p / tpb_] * tpb_ + p % tpb_);
  plan.blocks_to_free = std::move(blocks_to_free);
  plan.blocks_before = static_cast<int64_t>(s.block_ids.size());
  plan.new_kv_len = new_kv_len;
  return plan;
}

std::optional<Plan> TokenTable::plan_dense(int64_t req_id) {
  const std::vector<int64_t> holes = hole_positions(req_id);  // ascending
  if (holes.empty()) return std::nullopt;
  const Sequence& s = seq(req_id);
  const int64_t new_len = s.kv_len - static_cast<int64_t>(holes.size());
  const auto below = std::lower_bound(holes.begin(), holes.end(), new_len);
  const std::vector<int64_t> dst_pos(holes.begin(), below);
  const IdSet dead_tail(below, holes.end());
  std::vector<int64_t> src_pos;
  for (int64_t p = s.kv_len - 1; p >= new_len; --p) {
    if (!dead_tail.count(p)) src_pos.push_back(p);
  }
  if (src_pos.size() != dst_pos.size()) {
    throw std::logic_error("dense plan: live tokens above R must match holes below R");
  }
  std::vector<int64_t> blocks_to_free(s.block_ids.begin() + ceil_div(new_len, tpb_), s.block_ids.end());
  bool touches_shared = false;
  for (int64_t b : blocks_to_free) touches_shared = touches_shared || is_shared(b);
  for (int64_t p : src_pos) touches_shared = touches_shared || is_shared(s.block_ids[p / tpb_]);
  for (int64_t p : dst_pos) touches_shared = touches_shared || is_shared(s.block_ids[p / tpb_]);
  if (touches_shared) return std::nullopt;
  return make_plan(req_id, true, src_pos, dst_pos, std::move(blocks_to_free), new_len);
}

std::optional<Plan> TokenTable::plan_lazy(int64_t req_id) {
  const std::vector<int64_t> holes = hole_positions(req_id);
  if (static_cast<int64_t>(holes.size()) < tpb_) return std::nullopt;
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
  if (num_to_free == 0) return std::nullopt;
  const auto& live = s.live_per_block;
  // Fewest live tokens first; among equals the later block (see planner.py).
  std::stable_sort(candidates.begin(), candidates.end(), [&](int64_t a, int64_t b) {
    return live[a] != live[b] ? live[a] < live[b] : a > b;
  });
  std::vector<int64_t> sources(candidates.begin(), candidates.begin() + num_to_free);
  std::sort(sources.begin(), sources.end());
  const IdSet source_set(sources.begin(), sources.end());
  std::vector<int64_t> src_pos;
  for (int64_t i : sources) {
    for (int64_t p = i * tpb_; p < (i + 1) * tpb_; ++p) {
      if (s.live_at(p)) src_pos.push_back(p);
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
  if (targets.size() < src_pos.size()) {
    throw std::logic_error("lazy plan: not enough holes for the chosen sources");
  }
  const std::vector<int64_t> dst_pos(targets.begin(), targets.begin() + src_pos.size());
  std::vector<int64_t> blocks_to_free;
  for (int64_t i : sources) blocks_to_free.push_back(s.block_ids[i]);
  return make_plan(req_id, false, src_pos, dst_pos, std::move(blocks_to_free), -1);
}

int64_t TokenTable::fragmentation(int64_t req_id) const {
  const Sequence& s = seq(req_id);
  return static_cast<int64_t>(s.block_ids.size()) - ceil_div(s.num_live, tpb_);
}

std::vector<int64_t> TokenTable::commit(const Plan& plan) {
  const int64_t req_id = plan.req_id;
  const int64_t version = seq(req_id).version;
  if (plan.version != version) {
    throw std::invalid_argument("plan for request " + std::to_string(req_id) + " was taken from table version " +
                                std::to_string(plan.version) + ", table is at " + std::to_string(version));
  }
  const auto blocks_after = plan.blocks_before - static_cast<int64_t>(plan.blocks_to_free.size());
  if (!plan.dense && blocks_after >= plan.blocks_before) {
    throw std::invalid_argument("lazy plan for request " + std::to_string(req_id) + " does not reduce its " +
                                std::to_string(plan.blocks_before) + " blocks");
  }
  apply_moves(req_id, plan.token_ids, plan.dst_slots);
  if (plan.dense) {
    const std::vector<int64_t> released = truncate(req_id, plan.new_kv_len);
    if (released != plan.blocks_to_free) {
      throw std::logic_error("released " + repr(released) + ", planned " + repr(plan.blocks_to_free));
    }
  } else {
    release_blocks(req_id, plan.blocks_to_free);
  }
  return plan.blocks_to_free;
}

}  // namespace vtoken
