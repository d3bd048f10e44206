// SPDX-License-Identifier: Apache-2.0
// Python bindings of the step's batch-layout updates (slots.h): the arrays are the SlotMap's own
// numpy buffers, written in place.
#include <algorithm>
#include <tuple>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "decode_step.h"
#include "owned_ids.h"
#include "slot_args.h"
#include "slots.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace vtoken::slot_args;


void bind_slots(nb::module_& m) {
  nb::class_<BoundLayout>(m, "BoundLayout",
                          "A SlotMap's buffers bound once for the slot calls (slot_args.h); bound again when "
                          "one is replaced.")
      .def(nb::init<Tokens, BlockTable, int64_t, Counters, Counters, Counters, Counters, std::vector<Stat>>(),
           // Written in place: a buffer of another dtype is refused, never converted into a copy.
           "tokens"_a.noconvert(), "block_table"_a.noconvert(), "tokens_per_block"_a, "num_blocks_of"_a.noconvert(),
           "kv_len"_a.noconvert(), "num_tokens"_a.noconvert(), "num_live"_a.noconvert(), "stats"_a);
  m.def(
      "slots_register",
      [](BoundLayout& layout, Ids req_ids, Ids rows, Ids offsets, Ids blocks, Ids num_new, int64_t num_blocks,
         const vtoken::TokenTable& table) {
        vtoken::SlotArrays& a = layout.arrays();
        const size_t batch = rows.shape(0);
        check_batch(rows, layout.rows(), batch, "rows");
        if (req_ids.shape(0) != batch || offsets.shape(0) != batch + 1 || num_new.shape(0) != batch) {
          throw std::invalid_argument("slots_register: req_ids and num_new need one entry per row, offsets one more");
        }
        if (num_blocks <= 0 || num_blocks > a.scratch) {
          throw std::invalid_argument("slots_register: num_blocks must lie in [1, the layout's blocks]");
        }
        const std::string wrong = vtoken::check_new(a, req_ids.data(), rows.data(), static_cast<int64_t>(batch),
                                                    static_cast<int64_t>(layout.rows()), offsets.data(),
                                                    blocks.data(), static_cast<int64_t>(blocks.shape(0)),
                                                    num_new.data(), num_blocks, table);
        if (!wrong.empty()) throw std::invalid_argument(wrong);
        int64_t needed = 0;  // block-table columns the rows need with their new blocks
        for (size_t i = 0; i < batch; ++i) {
          needed = std::max(needed, a.num_blocks_of[rows.data()[i]] + offsets.data()[i + 1] - offsets.data()[i]);
        }
        if (needed > a.block_stride) return nb::make_tuple(needed, nb::none());  // nothing written
        return nb::make_tuple(0, vtoken::to_numpy(vtoken::register_new(a, rows.data(), static_cast<int64_t>(batch),
                                                                       offsets.data(), blocks.data(), num_new.data())));
      },
      "layout"_a, "req_ids"_a, "rows"_a, "offsets"_a, "blocks"_a, "num_new"_a, "num_blocks"_a, "table"_a,
      "The step's checks of the new blocks and tokens (ValueError, nothing changed), then SlotMap.append_blocks + "
      "register in one call (cpp/core/slots.h). Returns (0, the new tokens' slots), or (the block-table columns "
      "needed, None) with nothing written when the table must grow first.");
  m.def(
      "slots_apply_step",
      [](BoundLayout& layout, Ids victim_rows, Ids victim_slots, Ids move_src, Ids move_dst, Ids rows, Ids req_ids,
         Ids kv_lens, Ids freed_offsets, bool tail_only, const vtoken::TokenTable& table) {
        vtoken::SlotArrays& a = layout.arrays();
        const size_t batch = rows.shape(0), slots = layout.slots();
        check_batch(rows, layout.rows(), batch, "rows");
        check_batch(victim_rows, layout.rows(), victim_slots.shape(0), "victim_rows");
        if (req_ids.shape(0) != batch || kv_lens.shape(0) != batch || freed_offsets.shape(0) != batch + 1 ||
            move_src.shape(0) != move_dst.shape(0)) {
          throw std::invalid_argument("slots_apply_step: req_ids and kv_lens need one entry per row, freed_offsets "
                                      "one more, moves a destination per source");
        }
        for (const Ids* s : {&victim_slots, &move_src, &move_dst}) {
          for (size_t k = 0; k < s->shape(0); ++k) {
            if (s->data()[k] < 0 || static_cast<size_t>(s->data()[k]) >= slots) {
              throw std::invalid_argument("slots_apply_step: slot " + std::to_string(s->data()[k]) + " is outside the layout");
            }
          }
        }
        vtoken::apply_step(a, victim_rows.data(), victim_slots.data(), static_cast<int64_t>(victim_slots.shape(0)),
                           move_src.data(), move_dst.data(), static_cast<int64_t>(move_src.shape(0)), rows.data(),
                           req_ids.data(), static_cast<int64_t>(batch), kv_lens.data(), freed_offsets.data(), tail_only,
                           table);
      },
      "layout"_a, "victim_rows"_a, "victim_slots"_a, "move_src"_a, "move_dst"_a, "rows"_a, "req_ids"_a,
      "kv_lens"_a, "freed_offsets"_a, "tail_only"_a, "table"_a,
      "SlotMap.evict + move + set_rows after the table's step, in one call (cpp/core/slots.h).");

  m.def(
      "slots_protected_live",
      [](BoundLayout& layout, Ids rows, const vtoken::TokenTable& table) {
        const vtoken::SlotArrays& a = layout.arrays();
        check_batch(rows, layout.rows(), rows.shape(0), "rows");
        return vtoken::to_numpy(vtoken::protected_live(a, rows.data(), static_cast<int64_t>(rows.shape(0)), table));
      },
      "layout"_a, "rows"_a, "table"_a,
      "Per row, its live tokens in blocks the table holds as shared, read from the layout (cpp/core/slots.h).");
  m.def(
      "slots_decide_step",
      [](BoundLayout& layout, vtoken::TokenTable& table, Ids req_ids, Ids rows, Ids num_new, Ids offsets, Ids blocks,
         int64_t selector, std::tuple<int64_t, double, int64_t, int64_t, double> rule, int64_t compaction,
         int64_t fragmentation_threshold, bool pressure,
         std::optional<nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>> stat,
         std::optional<nb::ndarray<nb::ro, nb::ndim<2>, nb::c_contig, nb::device::cpu>> mass,
         std::optional<nb::callable> on_victims, bool skip_shared, int64_t threads,
         std::optional<nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>> may_plan) {
        vtoken::SlotArrays& a = layout.arrays();
        const size_t batch = rows.shape(0);
        check_batch(rows, layout.rows(), batch, "rows");
        if (req_ids.shape(0) != batch || num_new.shape(0) != batch || offsets.shape(0) != batch + 1) {
          throw std::invalid_argument("slots_decide_step: req_ids and num_new need one entry per row, offsets one more");
        }
        vtoken::Decision d{static_cast<vtoken::Selector>(selector)};
        vtoken::BoundsRule& bounds = d.rule;
        std::tie(bounds.tokens, bounds.ratio, bounds.n_sink, bounds.recent_window, bounds.recent_ratio) = rule;
        if (!vtoken::valid(bounds)) {
          throw std::invalid_argument("slots_decide_step: a bounds rule is (tokens >= 0 or -1, ratio in (0, 1], "
                                      "n_sink >= 0, recent_window >= 0, recent_ratio in [0, 1])");
        }
        if (selector < 0 || selector > 2 || compaction < 0 || compaction > 3) {
          throw std::invalid_argument("slots_decide_step: selector must be 0-2 and compaction 0-3 (dense, lazy, "
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
          if (d.selector != vtoken::Selector::kLowestStat || mass->shape(0) != batch) {
            throw std::invalid_argument("slots_decide_step: mass needs the statistic selector and one row per request");
          }
          for (size_t i = 0; i < batch; ++i) {
            if (a.kv_len[rows.data()[i]] > static_cast<int64_t>(mass->shape(1))) {
              throw std::invalid_argument("slots_decide_step: the mass is narrower than request " +
                                          std::to_string(req_ids.data()[i]) + "'s length");
            }
          }
          d.mass_stride = static_cast<int64_t>(mass->shape(1));
          if (mass->dtype() == nb::dtype<float>()) {
            d.mass32 = static_cast<const float*>(mass->data());
          } else if (mass->dtype() == nb::dtype<double>()) {
            d.mass64 = static_cast<const double*>(mass->data());
          } else {
            throw std::invalid_argument("slots_decide_step: mass must be float32 or float64");
          }
        }
        vtoken::VictimsHook hook;
        if (on_victims) {  // with numpy copies of the victims, as the general path hands them over
          hook = [&](const std::vector<int64_t>& victim_offsets, const std::vector<int64_t>& victim_ids) {
            (*on_victims)(vtoken::to_numpy(std::vector<int64_t>(victim_offsets)),
                          vtoken::to_numpy(std::vector<int64_t>(victim_ids)));
          };
        }
        vtoken::DecodeResult r = vtoken::decide_and_step(
            a, table, req_ids.data(), rows.data(), static_cast<int64_t>(batch), num_new.data(), offsets.data(),
            blocks.data(), d, static_cast<vtoken::Compaction>(compaction), fragmentation_threshold, pressure,
            may_plan ? may_plan->data() : nullptr, hook);
        using vtoken::to_numpy;
        vtoken::StepResult& t = r.table;
        return nb::make_tuple(
            to_numpy(std::move(r.victim_offsets)), to_numpy(std::move(r.victim_ids)),
            nb::make_tuple(to_numpy(std::move(t.move_offsets)), to_numpy(std::move(t.move_tokens)),
                           to_numpy(std::move(t.move_src)), to_numpy(std::move(t.move_dst)),
                           to_numpy(std::move(t.freed_offsets)), to_numpy(std::move(t.freed)),
                           to_numpy(std::move(t.kv_lens))),
            to_numpy(std::move(r.lost)), to_numpy(std::move(r.num_tokens)), to_numpy(std::move(r.changed)),
            r.num_changed);
      },
      "layout"_a, "table"_a, "req_ids"_a, "rows"_a, "num_new"_a, "offsets"_a, "blocks"_a, "selector"_a,
      "rule"_a, "compaction"_a, "fragmentation_threshold"_a, "pressure"_a,
      "stat"_a.noconvert() = nb::none(), "mass"_a = nb::none(), "on_victims"_a = nb::none(), "skip_shared"_a = false,
      "threads"_a = 1, "may_plan"_a = nb::none(),
      "After slots_register: the batch's decision, the token table's step and the layout's update in one call "
      "(cpp/core/decode_step.h); on_victims(victim_offsets, victim_ids) runs between the decision and the "
      "table's step when there are victims; rule: the policy's bounds, (tokens or -1, ratio, n_sink, "
      "recent_window, recent_ratio), applied to the layout's counters here (budget.h); skip_shared: the id "
      "selector passes over tokens in shared blocks; threads: the statistic's pass may split its rows over that "
      "many threads (select.h); lazy-deferred plans only the rows may_plan allows and commits nothing "
      "(decode_step.h). Returns (victim_offsets, victim_ids, the table's step as step_batch returns it, lost, "
      "num_tokens, changed, number changed).");
}
