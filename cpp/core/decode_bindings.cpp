// SPDX-License-Identifier: Apache-2.0
// Python bindings of the fused decode call (decode_step.h): made at once (slots_decide_step), or
// on the step's worker thread while the host goes on (DecodeWorker, step_worker.h). Both check
// their arguments alike, before anything runs, and return the same results.
#include <chrono>
#include <optional>
#include <string>
#include <tuple>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>

#include "decode_step.h"
#include "owned_ids.h"
#include "slot_args.h"
#include "step_worker.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace vtoken::slot_args;

namespace {

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

// The call's arguments checked, or (std::nullopt) the block-table columns it needs first in
// `columns_needed`: with num_blocks > 0 it registers the batch, checked here as slots_register
// checks it (num_blocks: the pool's blocks), and the rows' lists with their new blocks must fit.
std::optional<DecodeCall> checked_call(BoundLayout& layout, vtoken::TokenTable& table, Ids req_ids, Ids rows,
                                       Ids num_new, NewBlocks added, int64_t selector, Rule rule,
                                       int64_t compaction, int64_t fragmentation_threshold, bool pressure,
                                       std::optional<Stat32> stat, std::optional<Mass> mass, bool skip_shared,
                                       int64_t threads, std::optional<Mask> may_plan, int64_t num_blocks,
                                       int64_t& columns_needed, std::optional<Ids> victim_index = std::nullopt,
                                       std::optional<Ids> victim_pos = std::nullopt) {
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

// The call's result packed in one int64 buffer, for one numpy array Python takes views of
// (step/fused.py FusedOutput): one array made per call instead of one per part, each of which
// costs the host's thread a Python object's making. The worker packs it; the host only wraps it.
//
//     [3, B + 1]  victim_offsets, move_offsets, freed_offsets
//     [4, B]      kv_lens, lost, num_tokens, changed
//     [V]         victim_ids
//     [3, M]      move_tokens, move_src, move_dst
//     [F]         freed
struct PackedResult {
  std::vector<int64_t> flat;
  size_t batch = 0, victims = 0, moves = 0;
  int64_t num_changed = 0;
  double decide_seconds = 0.0, plan_seconds = 0.0, commit_seconds = 0.0;  // parts of the call's time
};

PackedResult packed(const vtoken::DecodeResult& r) {
  const vtoken::StepResult& t = r.table;
  const size_t batch = t.kv_lens.size();
  for (const std::vector<int64_t>* per_request : {&r.lost, &r.num_tokens, &r.changed}) {
    if (per_request->size() != batch) throw std::logic_error("decode result: a per-request part is not [batch]");
  }
  for (const std::vector<int64_t>* offsets : {&r.victim_offsets, &t.move_offsets, &t.freed_offsets}) {
    if (offsets->size() != batch + 1) throw std::logic_error("decode result: CSR offsets are not [batch + 1]");
  }
  if (t.move_tokens.size() != t.move_src.size() || t.move_dst.size() != t.move_src.size()) {
    throw std::logic_error("decode result: the moves' parts differ in length");
  }
  PackedResult p{{}, batch, r.victim_ids.size(), t.move_src.size(), r.num_changed, r.decide_seconds,
                 t.plan_seconds, t.commit_seconds};
  p.flat.reserve(3 * (batch + 1) + 4 * batch + p.victims + 3 * p.moves + t.freed.size());
  for (const std::vector<int64_t>* part : {&r.victim_offsets, &t.move_offsets, &t.freed_offsets, &t.kv_lens, &r.lost,
                                           &r.num_tokens, &r.changed, &r.victim_ids, &t.move_tokens, &t.move_src,
                                           &t.move_dst, &t.freed}) {
    p.flat.insert(p.flat.end(), part->begin(), part->end());
  }
  return p;
}

// The packed buffer as Python holds it: a numpy array only when first asked for (a part of the
// output read, step/fused.py FusedOutput). A decode step whose output nobody reads (nothing
// evicted, moved or freed) makes no numpy object on the host's thread, where making one costs
// several times its warm time (benchmarks/step/cold_host).
class PackedBuffer {
 public:
  explicit PackedBuffer(std::vector<int64_t>&& flat) : flat_(std::move(flat)), size_(flat_.size()) {}

  // The buffer, moved into an int64 numpy array; once (std::logic_error after).
  vtoken::OwnedIds array() {
    if (taken_) throw std::logic_error("PackedBuffer: the array was taken already");
    taken_ = true;
    return vtoken::to_numpy(std::move(flat_));
  }
  size_t size() const { return size_; }

 private:
  std::vector<int64_t> flat_;
  size_t size_;
  bool taken_ = false;
};

// (the buffer, batch, victims, moves, number changed, the buffer's length, (decide, plan, commit)
// seconds: where the call's time went, DecodeResult and StepResult say what each counts)
nb::tuple result_tuple(PackedResult&& p) {
  const size_t size = p.flat.size();
  return nb::make_tuple(nb::cast(PackedBuffer(std::move(p.flat))), p.batch, p.victims, p.moves, p.num_changed,
                        size, nb::make_tuple(p.decide_seconds, p.plan_seconds, p.commit_seconds));
}

// A call's arguments bound once for a batch that repeats them (step/beside.py RepeatedCall): each
// repetition converts only its new blocks and pressure, where a call's own conversion of its
// other arguments (three arrays, the layout, the table, the rule) costs the host's thread more
// than the rest of the call's work there. The mass, where bound, is read when the call runs: the
// host's buffer rewritten in place (a CUDA-graph host's static output, staged to the host), or the
// array a repetition passes in its place (a forward's new output each step). The batch's registration, and the mass's width against the rows' lengths after their
// new tokens, are checked at each repetition (bind runs while the call it repeats is on the worker,
// so it reads no length).
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

// The bound call with this step's new blocks (one sequence per request) and pressure, checked as
// a call's own (BatchRefused, nothing changed); std::nullopt with the columns needed first.
// `mass`: this step's array in place of the bound one (a host whose forward hands over a new host
// array each step), one row per request, of the bound one's dtype; the call holds it until it ends.
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

// The fused call on the step's worker thread: start() checks and submits, wait() joins and hands
// back what slots_decide_step returns, with the seconds the call ran on the worker.
class DecodeWorker {
 public:
  void start(DecodeCall call) {
    if (call_) throw std::logic_error("DecodeWorker: a step is in flight; wait() for it first");
    call_.emplace(std::move(call));
    worker_.submit([this] {
      const auto begin = std::chrono::steady_clock::now();
      result_ = packed(call_->run());
      seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    });
  }

  nb::tuple wait() {
    if (!call_) throw std::logic_error("DecodeWorker: no step in flight");
    std::exception_ptr error;
    {
      nb::gil_scoped_release release;  // the host's other threads run while it waits
      try {
        worker_.wait();
      } catch (...) {
        error = std::current_exception();
      }
    }
    call_.reset();  // the buffers' references, dropped with the GIL
    if (error) std::rethrow_exception(error);
    return nb::make_tuple(result_tuple(std::exchange(result_, {})), seconds_);
  }

  bool busy() const { return call_.has_value(); }

 private:
  std::optional<DecodeCall> call_;
  PackedResult result_;
  double seconds_ = 0.0;
  vtoken::StepWorker worker_;  // last: destroyed (its thread joined) before what its job uses
};

}  // namespace

void bind_decode(nb::module_& m) {
  m.def(
      "slots_decide_step",
      [](BoundLayout& layout, vtoken::TokenTable& table, Ids req_ids, Ids rows, Ids num_new,
         std::optional<Ids> offsets, nb::handle blocks, int64_t selector, Rule rule, int64_t compaction,
         int64_t fragmentation_threshold, bool pressure, std::optional<Stat32> stat, std::optional<Mass> mass,
         std::optional<nb::callable> on_victims, bool skip_shared, int64_t threads, std::optional<Mask> may_plan,
         int64_t num_blocks, std::optional<Ids> victim_index, std::optional<Ids> victim_pos) -> nb::object {
        int64_t columns_needed = 0;
        const std::optional<DecodeCall> call =
            checked_call(layout, table, req_ids, rows, num_new, new_blocks_of(offsets, blocks), selector, rule,
                         compaction, fragmentation_threshold, pressure, stat, mass, skip_shared, threads, may_plan,
                         num_blocks, columns_needed, victim_index, victim_pos);
        if (!call) return nb::int_(columns_needed);
        vtoken::VictimsHook hook;
        if (on_victims) {  // with numpy copies of the victims, as the Python core hands them over
          hook = [&](const std::vector<int64_t>& victim_offsets, const std::vector<int64_t>& victim_ids) {
            (*on_victims)(vtoken::to_numpy(std::vector<int64_t>(victim_offsets)),
                          vtoken::to_numpy(std::vector<int64_t>(victim_ids)));
          };
        }
        return result_tuple(packed(call->run(hook)));
      },
      "layout"_a, "table"_a, "req_ids"_a, "rows"_a, "num_new"_a, "offsets"_a, "blocks"_a, "selector"_a,
      "rule"_a, "compaction"_a, "fragmentation_threshold"_a, "pressure"_a,
      "stat"_a.noconvert() = nb::none(), "mass"_a = nb::none(), "on_victims"_a = nb::none(), "skip_shared"_a = false,
      "threads"_a = 1, "may_plan"_a = nb::none(), "num_blocks"_a = 0, "victim_index"_a = nb::none(),
      "victim_pos"_a = nb::none(),
      "The batch's registration (num_blocks > 0: the pool's blocks; 0: slots_register made it), decision, the "
      "token table's step and the layout's update in one call (cpp/core/decode_step.h). With num_blocks the "
      "batch is checked first as slots_register checks it (BatchRefused, nothing changed), and if the rows' "
      "lists outgrow the block table the call returns the columns needed (an int), nothing done. on_victims(victim_offsets, victim_ids) runs between the decision and the "
      "table's step when there are victims; rule: the policy's bounds, (tokens or -1, ratio, n_sink, "
      "recent_window, recent_ratio), applied to the layout's counters here (budget.h); skip_shared: the id "
      "selector passes over tokens in shared blocks; threads: the statistic's pass may split its rows over that "
      "many threads (select.h); lazy-deferred plans only the rows may_plan allows and commits nothing "
      "(decode_step.h); selector 3 takes the victims the host decided, (victim_index ascending, victim_pos) "
      "int64 arrays of (batch index, physical position), after the host registered the batch. Returns (one int64 buffer (a PackedBuffer), batch, victims, moves, number changed, the "
      "buffer's length, the seconds of (decide, plan, commit) inside the call): victim_offsets, "
      "victim_ids, the table's step as step_batch returns it, lost, num_tokens and changed, laid out as "
      "result_tuple says (step/fused.py FusedOutput takes it apart). The batch's new blocks: CSR (offsets, "
      "blocks int64 arrays) or, offsets None, blocks one sequence of block ids per request.");

  nb::class_<PackedBuffer>(m, "PackedBuffer",
                           "A decode call's packed result (result_tuple): its int64 buffer, made a numpy array "
                           "when first asked for.")
      .def("array", &PackedBuffer::array,
           "The buffer as an int64 numpy array; once (it moves into the array), RuntimeError after.")
      .def("__len__", &PackedBuffer::size);

  nb::class_<DecodeCall>(m, "BoundDecodeCall",
                         "A decode call's arguments bound once (DecodeWorker.bind), holding references to its "
                         "buffers, the layout and the table.");

  nb::class_<DecodeWorker>(m, "DecodeWorker",
                           "slots_decide_step on a worker thread of its own (cpp/core/step_worker.h): start() "
                           "checks the arguments (ValueError, nothing submitted) and returns at once; until wait() "
                           "the caller must not touch the layout, the table or the buffers it passed.")
      .def(nb::init<>())
      .def(
          "start",
          [](DecodeWorker& w, BoundLayout& layout, vtoken::TokenTable& table, Ids req_ids, Ids rows, Ids num_new,
             std::optional<Ids> offsets, nb::handle blocks, int64_t selector, Rule rule, int64_t compaction,
             int64_t fragmentation_threshold, bool pressure, std::optional<Stat32> stat, std::optional<Mass> mass,
             bool skip_shared, int64_t threads, std::optional<Mask> may_plan, int64_t num_blocks,
             std::optional<Ids> victim_index, std::optional<Ids> victim_pos) {
            int64_t columns_needed = 0;
            std::optional<DecodeCall> call =
                checked_call(layout, table, req_ids, rows, num_new, new_blocks_of(offsets, blocks), selector, rule,
                             compaction, fragmentation_threshold, pressure, stat, mass, skip_shared, threads, may_plan,
                             num_blocks, columns_needed, victim_index, victim_pos);
            if (call) w.start(std::move(*call));
            return columns_needed;
          },
          "layout"_a, "table"_a, "req_ids"_a, "rows"_a, "num_new"_a, "offsets"_a, "blocks"_a, "selector"_a,
          "rule"_a, "compaction"_a, "fragmentation_threshold"_a, "pressure"_a, "stat"_a.noconvert() = nb::none(),
          "mass"_a = nb::none(), "skip_shared"_a = false, "threads"_a = 1, "may_plan"_a = nb::none(),
          "num_blocks"_a = 0, "victim_index"_a = nb::none(), "victim_pos"_a = nb::none(),
          "slots_decide_step's arguments, less the victims hook (the worker runs no Python); num_blocks > 0: "
          "the call registers the batch first, checked here (BatchRefused, nothing started). Returns 0 "
          "(started), or the block-table columns the rows' lists need with their new blocks when the table "
          "must grow first (nothing started).")
      .def(
          "bind",
          [](DecodeWorker&, BoundLayout& layout, vtoken::TokenTable& table, Ids req_ids, Ids rows, Ids num_new,
             int64_t selector, Rule rule, int64_t compaction, int64_t fragmentation_threshold,
             std::optional<Stat32> stat, std::optional<Mass> mass, bool skip_shared, int64_t threads,
             int64_t num_blocks) {
            return bound_call(layout, table, req_ids, rows, num_new, selector, rule, compaction,
                              fragmentation_threshold, stat, mass, skip_shared, threads, num_blocks);
          },
          "layout"_a, "table"_a, "req_ids"_a, "rows"_a, "num_new"_a, "selector"_a, "rule"_a, "compaction"_a,
          "fragmentation_threshold"_a, "stat"_a.noconvert() = nb::none(), "mass"_a.noconvert() = nb::none(),
          "skip_shared"_a = false, "threads"_a = 1, "num_blocks"_a = 0,
          "start()'s arguments but the new blocks, the pressure and may_plan, checked and bound once (a "
          "BoundDecodeCall) for repeat(). The mass, if any, is read by each repeated call when it runs (or "
          "the array repeat() passes in its place); repeat() checks its width against the rows' lengths.")
      .def(
          "repeat",
          [](DecodeWorker& w, const DecodeCall& bound, nb::handle blocks, bool pressure, std::optional<Mass> mass) {
            int64_t columns_needed = 0;
            std::optional<DecodeCall> call = repeated_call(bound, blocks, pressure, mass, columns_needed);
            if (call) w.start(std::move(*call));
            return columns_needed;
          },
          "bound"_a, "blocks"_a, "pressure"_a, "mass"_a.noconvert() = nb::none(),
          "start() with a bound call's arguments and this step's new blocks (one sequence of block ids per "
          "request) and pressure; returns as start() does. mass: this step's array in place of the bound "
          "one (one row per request, the bound one's dtype; BatchRefused otherwise, nothing started), its "
          "width checked as the bound one's.")
      .def("wait", &DecodeWorker::wait,
           "Waits (the GIL released) for the call started last; returns (what slots_decide_step returns, the "
           "seconds it ran on the worker), or raises what it raised.")
      .def_prop_ro("busy", &DecodeWorker::busy, "A call started and not yet waited for.");
}
