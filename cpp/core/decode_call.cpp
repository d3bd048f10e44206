// SPDX-License-Identifier: Apache-2.0
// A fused decode call's arguments checked (decode_call.h).
#include "decode_call.h"

#include <stdexcept>
#include <string>
#include <utility>

namespace vtoken::decode_args {

using slot_args::BatchRefused;
using slot_args::check_batch;
using slot_args::checked_registration;
using slot_args::listed_blocks;

namespace {

// The mass's rows in the decision (H2O's pass adds them to the statistic first), checked for what
// does not depend on the lengths: the statistic selector, one row per request, float32 or float64.
void bind_mass(vtoken::Decision& d, const Mass& mass, size_t batch) {
  if (d.selector != vtoken::Selector::kLowestStat || mass.shape(0) != batch) {
    throw std::invalid_argument("slots_decide_step: mass needs the statistic selector and one row per request");
  }
  d.mass_stride = static_cast<int64_t>(mass.shape(1));
  if (mass.dtype() == nb::dtype<float>()) {
    d.mass32 = static_cast<const float*>(mass.data());
  } else if (mass.dtype() == nb::dtype<double>()) {
    d.mass64 = static_cast<const double*>(mass.data());
  } else {
    throw std::invalid_argument("slots_decide_step: mass must be float32 or float64");
  }
}

// The first index of the batch whose row is longer than the mass is wide, -1 if none: the lengths
// after the new tokens where `num_new` is given (the call registers them), else as they are.
int64_t first_narrower_row(const vtoken::SlotArrays& a, const Ids& rows, const int64_t* num_new, const Mass& mass) {
  const int64_t width = static_cast<int64_t>(mass.shape(1));
  for (size_t i = 0; i < rows.shape(0); ++i) {
    if (a.kv_len[rows.data()[i]] + (num_new ? num_new[i] : 0) > width) return static_cast<int64_t>(i);
  }
  return -1;
}

// The victims the host decided (the kGiven selector), checked against the layout before anything
// changes: the host registered the batch (the call does not), each victim is (batch index,
// ascending; physical position below its row's length, holding a live token).
void bind_given(vtoken::Decision& d, const vtoken::SlotArrays& a, const Ids& rows, bool registers,
                const std::optional<Ids>& index, const std::optional<Ids>& positions) {
  if (!index || !positions || index->shape(0) != positions->shape(0) || registers) {
    throw std::invalid_argument("slots_decide_step: the given selector needs victim_index and victim_pos of one "
                                "length, and a batch registered before the call");
  }
  const int64_t batch = static_cast<int64_t>(rows.shape(0)), n = static_cast<int64_t>(index->shape(0));
  const int64_t *at = index->data(), *pos = positions->data(), tpb = a.tokens_per_block;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t i = at[k];
    if (i < 0 || i >= batch || (k && i < at[k - 1])) {
      throw std::invalid_argument("slots_decide_step: victim_index must ascend within the batch");
    }
    const int64_t row = rows.data()[i], p = pos[k];
    if (p < 0 || p >= a.kv_len[row] ||
        a.tokens[static_cast<int64_t>(a.block_table[row * a.block_stride + p / tpb]) * tpb + p % tpb] < 0) {
      throw std::invalid_argument("slots_decide_step: a victim's position holds no live token of its request");
    }
  }
  d.given_index = at, d.given_positions = pos, d.num_given = n;
}

}  // namespace

std::optional<DecodeCall> checked_call(BoundLayout& layout, vtoken::TokenTable& table, Ids req_ids, Ids rows,
                                       Ids num_new, NewBlocks added, int64_t selector, Rule rule,
                                       int64_t compaction, int64_t fragmentation_threshold, bool pressure,
                                       std::optional<Stat32> stat, std::optional<Mass> mass, bool skip_shared,
                                       int64_t threads, std::optional<Mask> may_plan, int64_t num_blocks,
                                       int64_t& columns_needed, std::optional<Ids> victim_index,
                                       std::optional<Ids> victim_pos) {
  vtoken::SlotArrays& a = layout.arrays();
  const size_t batch = rows.shape(0);
  const bool registers = num_blocks != 0;
  columns_needed = 0;
  if (registers) {  // the rows and sizes checked there too (BatchRefused)
    columns_needed = checked_registration(layout, req_ids, rows, added, num_new, num_blocks, table);
    if (columns_needed) return std::nullopt;
  } else {
    check_batch(rows, layout.rows(), batch, "rows");
    if (req_ids.shape(0) != batch || num_new.shape(0) != batch || added.offsets.size() != batch + 1) {
      throw std::invalid_argument("slots_decide_step: req_ids and num_new need one entry per row, offsets one more");
    }
  }
  vtoken::Decision d{static_cast<vtoken::Selector>(selector)};
  vtoken::BoundsRule& bounds = d.rule;
  std::tie(bounds.tokens, bounds.ratio, bounds.n_sink, bounds.recent_window, bounds.recent_ratio, bounds.unit) = rule;
  if (!vtoken::valid(bounds)) {
    throw std::invalid_argument("slots_decide_step: a bounds rule is (tokens >= 0 or -1, ratio in (0, 1], unit >= 1, "
                                "n_sink >= 0, recent_window >= 0, recent_ratio in [0, 1])");
  }
  if (selector < 0 || selector > 3 || compaction < 0 || compaction > 3) {
    throw std::invalid_argument("slots_decide_step: selector must be 0-3 and compaction 0-3 (dense, lazy, "
                                "dead-blocks, lazy-deferred)");
  }
  if (may_plan && (may_plan->shape(0) != batch || compaction != 3)) {
    throw std::invalid_argument("slots_decide_step: may_plan needs one entry per row and lazy-deferred");
  }
  if (threads < 1) throw std::invalid_argument("slots_decide_step: threads must be >= 1");
  d.skip_shared = skip_shared;
  d.threads = threads;
  if (d.selector == vtoken::Selector::kLowestStat) {
    if (!stat || stat->shape(0) != layout.slots()) {
      throw std::invalid_argument("slots_decide_step: the statistic selector needs one entry per slot");
    }
    d.stat = stat->data();
  }
  if (mass) {
    bind_mass(d, *mass, batch);
    const int64_t narrower = first_narrower_row(a, rows, registers ? num_new.data() : nullptr, *mass);
    if (narrower >= 0) {
      throw std::invalid_argument("slots_decide_step: the mass is narrower than request " +
                                  std::to_string(req_ids.data()[narrower]) + "'s length");
    }
  }
  if (d.selector == vtoken::Selector::kGiven) {
    bind_given(d, a, rows, registers, victim_index, victim_pos);
  } else if (victim_index || victim_pos) {
    throw std::invalid_argument("slots_decide_step: victims are given with the given selector (3) only");
  }
  return DecodeCall{nb::find(&layout), nb::find(&table), &layout, &a, &table, req_ids, rows, num_new,
                    std::move(added), stat, mass, may_plan, victim_index, victim_pos, d,
                    static_cast<vtoken::Compaction>(compaction), fragmentation_threshold, pressure, registers,
                    num_blocks};
}

DecodeCall bound_call(BoundLayout& layout, vtoken::TokenTable& table, Ids req_ids, Ids rows, Ids num_new,
                      int64_t selector, Rule rule, int64_t compaction, int64_t fragmentation_threshold,
                      std::optional<Stat32> stat, std::optional<Mass> mass, bool skip_shared, int64_t threads,
                      int64_t num_blocks) {
  NewBlocks none{std::vector<int64_t>(rows.shape(0) + 1, 0), {}};
  int64_t columns_needed = 0;  // (no registration checked here: never set)
  DecodeCall call = *checked_call(layout, table, req_ids, rows, num_new, std::move(none), selector, rule, compaction,
                                  fragmentation_threshold, false, stat, std::nullopt, skip_shared, threads,
                                  std::nullopt, 0, columns_needed);
  if (num_blocks < 0) throw std::invalid_argument("bound call: num_blocks must be >= 0");
  call.registers = num_blocks != 0;
  call.num_blocks = num_blocks;
  if (mass) {
    bind_mass(call.decision, *mass, rows.shape(0));
    call.mass = mass;
  }
  return call;
}

std::optional<DecodeCall> repeated_call(const DecodeCall& bound, nb::handle blocks, bool pressure,
                                        const std::optional<Mass>& mass, int64_t& columns_needed) {
  DecodeCall call = bound;
  if (mass) {
    if (!bound.mass || mass->dtype() != bound.mass->dtype()) {
      throw BatchRefused("slots: a new mass needs a bound call that reads one, of the same dtype");
    }
    bind_mass(call.decision, *mass, call.rows.shape(0));  // one row per request, else ValueError
    call.mass = mass;
  }
  call.added = listed_blocks(blocks);
  call.pressure = pressure;
  columns_needed = 0;
  if (call.registers) {
    columns_needed = checked_registration(*call.layout, call.req_ids, call.rows, call.added, call.num_new,
                                          call.num_blocks, *call.table);
    if (columns_needed) return std::nullopt;
  } else if (call.added.offsets.size() != call.rows.shape(0) + 1) {
    throw BatchRefused("slots: new blocks need one sequence per request");
  }
  if (call.mass) {
    const int64_t narrower = first_narrower_row(call.layout->arrays(), call.rows,
                                                call.registers ? call.num_new.data() : nullptr, *call.mass);
    if (narrower >= 0) {
      throw BatchRefused("slots: the mass is narrower than request " +
                         std::to_string(call.req_ids.data()[narrower]) + "'s length after its new tokens");
    }
  }
  return call;
}

}  // namespace vtoken::decode_args
