// SPDX-License-Identifier: Apache-2.0
// One fused decode call's arguments (decode_step.h), checked before anything runs: made at once,
// started on the step's worker, or bound once and repeated (decode_bindings.cpp binds all three).
// Errors: std::invalid_argument (ValueError) for a malformed call, BatchRefused (ValueError, in the
// Python step's words) for a batch the step refuses; either way nothing has changed.
#pragma once

#include <cstdint>
#include <optional>
#include <tuple>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "decode_step.h"
#include "slot_args.h"

namespace vtoken::decode_args {

namespace nb = nanobind;
using slot_args::BoundLayout;
using slot_args::Ids;
using slot_args::NewBlocks;

using Stat32 = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Mass = nb::ndarray<nb::ro, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Mask = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Rule = std::tuple<int64_t, double, int64_t, int64_t, double, int64_t>;

// One decode call's arguments, checked. It holds a reference to every buffer it reads or writes
// (the layout's through its BoundLayout), so they outlive a call on the worker thread; it is
// built and destroyed on the host's thread, with the GIL. `registers`: the call registers the
// batch's new blocks and tokens first (slots_register's work, checked when the call was built).
struct DecodeCall {
  nb::object layout_ref, table_ref;
  BoundLayout* layout = nullptr;
  vtoken::SlotArrays* arrays = nullptr;
  vtoken::TokenTable* table = nullptr;
  Ids req_ids, rows, num_new;
  NewBlocks added;  // the batch's new blocks, CSR
  std::optional<Stat32> stat;
  std::optional<Mass> mass;
  std::optional<Mask> may_plan;
  std::optional<Ids> victim_index, victim_pos;  // the kGiven selector's victims (the decision points into them)
  vtoken::Decision decision;
  vtoken::Compaction mode = vtoken::Compaction::kDense;
  int64_t fragmentation_threshold = 1;
  bool pressure = false;
  bool registers = false;
  int64_t num_blocks = 0;  // registers: the pool's blocks, for the registration's checks

  vtoken::DecodeResult run(const vtoken::VictimsHook& on_victims = {}) const {
    if (registers) {
      vtoken::register_new(*arrays, rows.data(), static_cast<int64_t>(rows.shape(0)), added.offsets.data(),
                           added.blocks.data(), num_new.data());
    }
    return vtoken::decide_and_step(*arrays, *table, req_ids.data(), rows.data(), static_cast<int64_t>(rows.shape(0)),
                                   num_new.data(), added.offsets.data(), added.blocks.data(), decision, mode,
                                   fragmentation_threshold, pressure, may_plan ? may_plan->data() : nullptr,
                                   on_victims);
  }
};

// The call's arguments checked, or (std::nullopt) the block-table columns it needs first in
// `columns_needed`: with num_blocks > 0 it registers the batch, checked here as slots_register
// checks it (num_blocks: the pool's blocks), and the rows' lists with their new blocks must fit.
std::optional<DecodeCall> checked_call(BoundLayout& layout, vtoken::TokenTable& table, Ids req_ids, Ids rows,
                                       Ids num_new, NewBlocks added, int64_t selector, Rule rule,
                                       int64_t compaction, int64_t fragmentation_threshold, bool pressure,
                                       std::optional<Stat32> stat, std::optional<Mass> mass, bool skip_shared,
                                       int64_t threads, std::optional<Mask> may_plan, int64_t num_blocks,
                                       int64_t& columns_needed, std::optional<Ids> victim_index = std::nullopt,
                                       std::optional<Ids> victim_pos = std::nullopt);

// A call's arguments bound once for a batch that repeats them (step/beside.py RepeatedCall): each
// repetition converts only its new blocks and pressure, where a call's own conversion of its
// other arguments (three arrays, the layout, the table, the rule) costs the host's thread more
// than the rest of the call's work there. The mass, where bound, is read when the call runs: the
// host's buffer rewritten in place (a CUDA-graph host's static output, staged to the host), or the
// array a repetition passes in its place (a forward's new output each step). The batch's
// registration, and the mass's width against the rows' lengths after their new tokens, are
// checked at each repetition (bind runs while the call it repeats is on the worker, so it reads
// no length).
DecodeCall bound_call(BoundLayout& layout, vtoken::TokenTable& table, Ids req_ids, Ids rows, Ids num_new,
                      int64_t selector, Rule rule, int64_t compaction, int64_t fragmentation_threshold,
                      std::optional<Stat32> stat, std::optional<Mass> mass, bool skip_shared, int64_t threads,
                      int64_t num_blocks);

// The bound call with this step's new blocks (one sequence per request) and pressure, checked as
// a call's own (BatchRefused, nothing changed); std::nullopt with the columns needed first.
// `mass`: this step's array in place of the bound one (a host whose forward hands over a new host
// array each step), one row per request, of the bound one's dtype; the call holds it until it ends.
std::optional<DecodeCall> repeated_call(const DecodeCall& bound, nb::handle blocks, bool pressure,
                                        const std::optional<Mass>& mass, int64_t& columns_needed);

}  // namespace vtoken::decode_args
