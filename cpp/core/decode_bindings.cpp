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

#include "decode_call.h"
#include "packed_result.h"
#include "step_worker.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace vtoken::decode_args;
using vtoken::slot_args::new_blocks_of;
using vtoken::packing::PackedBuffer;
using vtoken::packing::PackedResult;
using vtoken::packing::packed;
using vtoken::packing::result_tuple;

namespace {

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
