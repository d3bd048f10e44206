// SPDX-License-Identifier: Apache-2.0
#include "flights.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <unordered_set>

namespace vtoken {

std::vector<uint8_t> LazyFlights::may_plan(const int64_t* req_ids, int64_t batch) const {
  std::vector<uint8_t> out(static_cast<size_t>(batch), 1);
  if (flights_.empty()) return out;
  for (int64_t i = 0; i < batch; ++i) out[i] = flights_.count(req_ids[i]) ? 0 : 1;
  return out;
}

std::vector<int64_t> LazyFlights::record(const int64_t* req_ids, int64_t batch, const StepResult& plans,
                                         int64_t submission) {
  std::vector<int64_t> planned;
  for (int64_t i = 0; i < batch; ++i) {
    const bool moves = plans.move_offsets[i + 1] > plans.move_offsets[i];
    const bool frees = plans.freed_offsets[i + 1] > plans.freed_offsets[i];
    if (!moves && !frees) continue;
    if (flights_.count(req_ids[i])) {
      throw std::invalid_argument("request " + std::to_string(req_ids[i]) + " has a plan in flight already");
    }
    planned.push_back(i);
  }
  for (int64_t i : planned) {
    auto slice = [](const std::vector<int64_t>& v, int64_t lo, int64_t hi) {
      return std::vector<int64_t>(v.begin() + lo, v.begin() + hi);
    };
    const int64_t lo = plans.move_offsets[i], hi = plans.move_offsets[i + 1];
    flights_[req_ids[i]] = Flight{slice(plans.move_tokens, lo, hi), slice(plans.move_src, lo, hi),
                                  slice(plans.move_dst, lo, hi),
                                  slice(plans.freed, plans.freed_offsets[i], plans.freed_offsets[i + 1]), submission};
  }
  return planned;
}

StepResult LazyFlights::commit_ready(TokenTable& table, SlotArrays& a, const int64_t* req_ids, const int64_t* rows,
                                     int64_t batch, const std::vector<int64_t>& ready,
                                     std::vector<int64_t>& committed) {
  StepResult out;
  out.move_offsets.assign(1, 0);
  out.freed_offsets.assign(1, 0);
  committed.clear();
  const std::unordered_set<int64_t> done(ready.begin(), ready.end());
  for (int64_t i = 0; i < batch; ++i) {
    auto it = flights_.empty() ? flights_.end() : flights_.find(req_ids[i]);
    if (it != flights_.end() && done.count(it->second.submission)) {
      Flight flight = std::move(it->second);
      flights_.erase(it);
      const Sequence& s = table.seq(req_ids[i]);
      Plan plan;
      plan.req_id = req_ids[i];
      plan.dense = false;
      plan.version = s.version;
      plan.blocks_before = static_cast<int64_t>(s.block_ids.size());
      plan.token_ids = std::move(flight.tokens);
      plan.src_slots = std::move(flight.src);
      plan.dst_slots = std::move(flight.dst);
      plan.blocks_to_free = std::move(flight.blocks);
      try {  // its copy moved KV the table no longer expects there
        table.commit_in_place(plan);
      } catch (const std::invalid_argument& e) {
        throw std::runtime_error("request " + std::to_string(req_ids[i]) +
                                 ": a background compaction could not commit: " + e.what());
      }
      committed.push_back(i);
      out.move_tokens.insert(out.move_tokens.end(), plan.token_ids.begin(), plan.token_ids.end());
      out.move_src.insert(out.move_src.end(), plan.src_slots.begin(), plan.src_slots.end());
      out.move_dst.insert(out.move_dst.end(), plan.dst_slots.begin(), plan.dst_slots.end());
      out.freed.insert(out.freed.end(), plan.blocks_to_free.begin(), plan.blocks_to_free.end());
      out.kv_lens.push_back(table.seq(req_ids[i]).kv_len);
    } else {
      out.kv_lens.push_back(a.kv_len[rows[i]]);
    }
    out.move_offsets.push_back(static_cast<int64_t>(out.move_tokens.size()));
    out.freed_offsets.push_back(static_cast<int64_t>(out.freed.size()));
  }
  if (!committed.empty()) {
    apply_step(a, nullptr, nullptr, 0, out.move_src.data(), out.move_dst.data(),
               static_cast<int64_t>(out.move_src.size()), rows, req_ids, batch, out.kv_lens.data(),
               out.freed_offsets.data(), false, table);
  }
  return out;
}

int64_t LazyFlights::drop(int64_t req_id) {
  auto it = flights_.find(req_id);
  if (it == flights_.end()) return -1;
  const int64_t submission = it->second.submission;
  flights_.erase(it);
  return submission;
}

const Flight* LazyFlights::find(int64_t req_id) const {
  auto it = flights_.find(req_id);
  return it == flights_.end() ? nullptr : &it->second;
}

std::vector<int64_t> LazyFlights::requests() const {
  std::vector<int64_t> out;
  for (const auto& [req_id, flight] : flights_) out.push_back(req_id);
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int64_t> LazyFlights::submissions() const {
  std::vector<int64_t> out;
  for (const auto& [req_id, flight] : flights_) out.push_back(flight.submission);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace vtoken
