// SPDX-License-Identifier: Apache-2.0
#include "decode_step.h"

#include <chrono>

#include "select.h"

namespace vtoken {

namespace {

// Per request: the tokens to evict (<= 0: none) and the candidates' id range [lo, hi), from the
// rule (Decision::rule).
struct RowBounds {
  std::vector<int64_t> excess, lo, hi;
};

RowBounds rule_bounds(const SlotArrays& a, const TokenTable& table, const int64_t* rows, int64_t batch,
                      const Decision& d) {
  const std::vector<int64_t> kept = d.skip_shared ? protected_live(a, rows, batch, table) : std::vector<int64_t>();
  const bool learns = d.mass32 != nullptr || d.mass64 != nullptr;
  RowBounds out{std::vector<int64_t>(batch), std::vector<int64_t>(batch), std::vector<int64_t>(batch)};
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t num_tokens = a.num_tokens[rows[i]], num_live = a.num_live[rows[i]];
    const Bounds b = candidate_bounds(d.rule, num_tokens, num_live, kept.empty() ? 0 : kept[i]);
    const bool over = learns || num_live > budget_target(d.rule, num_tokens);
    out.excess[i] = over ? b.excess : 0, out.lo[i] = b.lo, out.hi[i] = b.hi;
  }
  return out;
}

Selection decide(const SlotArrays& a, const TokenTable& table, const int64_t* req_ids, const int64_t* rows,
                 int64_t batch, const Decision& d) {
  if (d.selector == Selector::kNone) return {};
  if (d.selector == Selector::kGiven) {
    return {std::vector<int64_t>(d.given_index, d.given_index + d.num_given),
            std::vector<int64_t>(d.given_positions, d.given_positions + d.num_given)};
  }
  const RowBounds bounds = rule_bounds(a, table, rows, batch, d);
  const int64_t *lo = bounds.lo.data(), *hi = bounds.hi.data(), *excess = bounds.excess.data();
  const SlotLayout layout{a.tokens, a.block_table, a.block_stride, a.tokens_per_block, a.scratch + 1};
  if (d.selector == Selector::kLowestIds) {
    const RowsOf shared_in{&layout, rows};
    return lowest_live_ids(table, req_ids, batch, lo, hi, excess, d.skip_shared ? &shared_in : nullptr);
  }
  const TokenTable* shared_of = d.skip_shared ? &table : nullptr;
  std::vector<int64_t> kv_len(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) kv_len[i] = a.kv_len[rows[i]];
  if (d.mass64 != nullptr) {
    return select_lowest(layout, rows, batch, kv_len.data(), lo, hi, excess, d.stat, d.mass64, d.mass_stride,
                         shared_of, d.threads);
  }
  return select_lowest(layout, rows, batch, kv_len.data(), lo, hi, excess, d.stat, d.mass32, d.mass_stride,
                       shared_of, d.threads);
}

}  // namespace

DecodeResult decide_and_step(SlotArrays& a, TokenTable& table, const int64_t* req_ids, const int64_t* rows,
                             int64_t batch, const int64_t* num_new, const int64_t* new_block_offsets,
                             const int64_t* new_blocks, const Decision& decision, Compaction mode,
                             int64_t fragmentation_threshold, bool pressure, const uint8_t* may_plan,
                             const VictimsHook& on_victims) {
  const auto began = std::chrono::steady_clock::now();
  const Selection picked = decide(a, table, req_ids, rows, batch, decision);
  DecodeResult out;
  out.decide_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  const int64_t tpb = a.tokens_per_block, num_victims = static_cast<int64_t>(picked.rows.size());
  // Victims as the table takes them (logical ids, CSR by request) and as the layout drops them
  // (row, slot), read from the layout before anything moves.
  std::vector<int64_t> victim_rows(num_victims), victim_slots(num_victims);
  out.victim_ids.resize(num_victims);
  out.victim_offsets.assign(batch + 1, 0);
  for (int64_t k = 0; k < num_victims; ++k) {
    const int64_t i = picked.rows[k], row = rows[i], position = picked.positions[k];
    const int64_t slot = static_cast<int64_t>(a.block_table[row * a.block_stride + position / tpb]) * tpb + position % tpb;
    victim_rows[k] = row;
    victim_slots[k] = slot;
    out.victim_ids[k] = a.tokens[slot];
    ++out.victim_offsets[i + 1];
  }
  for (int64_t i = 0; i < batch; ++i) out.victim_offsets[i + 1] += out.victim_offsets[i];
  if (num_victims && on_victims) on_victims(out.victim_offsets, out.victim_ids);
  std::vector<int64_t> length(batch);  // after the new tokens, before the step
  for (int64_t i = 0; i < batch; ++i) length[i] = a.kv_len[rows[i]];
  out.table = step_batch(table, req_ids, batch, num_new, new_block_offsets, new_blocks, out.victim_offsets.data(),
                         out.victim_ids.data(), mode, fragmentation_threshold, pressure, may_plan);
  const StepResult& r = out.table;
  if (mode == Compaction::kLazyDeferred) {
    // The plans commit later (the caller's background compaction): the layout loses the victims
    // and takes the lengths now, its moves and released blocks when a plan commits.
    const std::vector<int64_t> nothing_released(batch + 1, 0);
    apply_step(a, victim_rows.data(), victim_slots.data(), num_victims, nullptr, nullptr, 0, rows, req_ids, batch,
               r.kv_lens.data(), nothing_released.data(), false, table);
  } else {
    apply_step(a, victim_rows.data(), victim_slots.data(), num_victims, r.move_src.data(), r.move_dst.data(),
               static_cast<int64_t>(r.move_src.size()), rows, req_ids, batch, r.kv_lens.data(),
               r.freed_offsets.data(), mode == Compaction::kDense, table);
  }
  out.lost.resize(batch);
  out.num_tokens.resize(batch);
  out.changed.resize(batch);
  for (int64_t i = 0; i < batch; ++i) {
    out.lost[i] = length[i] - r.kv_lens[i];
    out.num_tokens[i] = a.num_tokens[rows[i]];
    const int64_t work = (r.move_offsets[i + 1] - r.move_offsets[i]) + (r.freed_offsets[i + 1] - r.freed_offsets[i]) +
                         out.lost[i];
    out.changed[i] = work > 0;
    out.num_changed += work > 0;
  }
  return out;
}

}  // namespace vtoken
