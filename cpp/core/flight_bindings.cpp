// SPDX-License-Identifier: Apache-2.0
// Python bindings of the background compaction's plans in flight (flights.h), for the C++ core's
// step (trtllm_vtoken/step/background.py NativeBackgroundCompaction).
#include <optional>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "flights.h"
#include "owned_ids.h"
#include "slot_args.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace vtoken::slot_args;

namespace {

std::vector<int64_t> copied(const Ids& values) { return {values.data(), values.data() + values.shape(0)}; }

nb::tuple as_step(vtoken::StepResult&& t) {
  using vtoken::to_numpy;
  return nb::make_tuple(to_numpy(std::move(t.move_offsets)), to_numpy(std::move(t.move_tokens)),
                        to_numpy(std::move(t.move_src)), to_numpy(std::move(t.move_dst)),
                        to_numpy(std::move(t.freed_offsets)), to_numpy(std::move(t.freed)),
                        to_numpy(std::move(t.kv_lens)));
}

}  // namespace

void bind_flights(nb::module_& m) {
  nb::class_<vtoken::LazyFlights>(m, "LazyFlights",
                                  "Lazy plans whose copies run in the background, one per request at most "
                                  "(cpp/core/flights.h).")
      .def(nb::init<>())
      .def(
          "may_plan",
          [](const vtoken::LazyFlights& f, Ids req_ids) {
            return vtoken::to_numpy(f.may_plan(req_ids.data(), static_cast<int64_t>(req_ids.shape(0))));
          },
          "req_ids"_a, "[B] uint8: 1 where the request has no plan in flight.")
      .def(
          "record",
          [](vtoken::LazyFlights& f, Ids req_ids, Ids move_offsets, Ids move_tokens, Ids move_src, Ids move_dst,
             Ids freed_offsets, Ids freed, int64_t submission) {
            const size_t batch = req_ids.shape(0);
            if (move_offsets.shape(0) != batch + 1 || freed_offsets.shape(0) != batch + 1 ||
                move_src.shape(0) != move_tokens.shape(0) || move_dst.shape(0) != move_tokens.shape(0)) {
              throw std::invalid_argument("LazyFlights.record: the plans must be a step's result for req_ids");
            }
            vtoken::StepResult plans;
            plans.move_offsets = copied(move_offsets);
            plans.move_tokens = copied(move_tokens);
            plans.move_src = copied(move_src);
            plans.move_dst = copied(move_dst);
            plans.freed_offsets = copied(freed_offsets);
            plans.freed = copied(freed);
            for (size_t i = 0; i < batch; ++i) {
              if (plans.move_offsets[i] > plans.move_offsets[i + 1] ||
                  plans.freed_offsets[i] > plans.freed_offsets[i + 1]) {
                throw std::invalid_argument("LazyFlights.record: offsets must not decrease");
              }
            }
            if (plans.move_offsets[batch] != static_cast<int64_t>(move_tokens.shape(0)) ||
                plans.freed_offsets[batch] != static_cast<int64_t>(freed.shape(0)) || plans.move_offsets[0] != 0 ||
                plans.freed_offsets[0] != 0) {
              throw std::invalid_argument("LazyFlights.record: offsets must span the moves and the freed blocks");
            }
            return vtoken::to_numpy(f.record(req_ids.data(), static_cast<int64_t>(batch), plans, submission));
          },
          "req_ids"_a, "move_offsets"_a, "move_tokens"_a, "move_src"_a, "move_dst"_a, "freed_offsets"_a, "freed"_a,
          "submission"_a,
          "Keeps the plans of a lazy-deferred step's rows that planned, under the copy `submission`; returns their "
          "batch indices.")
      .def(
          "commit_ready",
          [](vtoken::LazyFlights& f, vtoken::TokenTable& table, BoundLayout& layout, Ids req_ids, Ids rows,
             const std::vector<int64_t>& ready) {
            vtoken::SlotArrays& a = layout.arrays();
            const size_t batch = rows.shape(0);
            check_batch(rows, layout.rows(), batch, "rows");
            if (req_ids.shape(0) != batch) throw std::invalid_argument("LazyFlights.commit_ready: one row per request");
            std::vector<int64_t> committed;
            vtoken::StepResult r = f.commit_ready(table, a, req_ids.data(), rows.data(), static_cast<int64_t>(batch),
                                                  ready, committed);
            return nb::make_tuple(vtoken::to_numpy(std::move(committed)), as_step(std::move(r)));
          },
          "table"_a, "layout"_a, "req_ids"_a, "rows"_a, "ready"_a,
          "Commits the batch's plans of the ready submissions in the table, then in the layout at once; returns "
          "(the committed batch indices, what they did as step_batch returns a step). RuntimeError naming the "
          "request if a plan no longer applies.")
      .def("drop", &vtoken::LazyFlights::drop, "req_id"_a,
           "Forgets the request's plan; returns its submission, -1 if it had none.")
      .def(
          "flight",
          [](const vtoken::LazyFlights& f, int64_t req_id) -> std::optional<nb::tuple> {
            const vtoken::Flight* flight = f.find(req_id);
            if (flight == nullptr) return std::nullopt;
            using vtoken::to_numpy;
            return nb::make_tuple(to_numpy(std::vector<int64_t>(flight->tokens)),
                                  to_numpy(std::vector<int64_t>(flight->src)),
                                  to_numpy(std::vector<int64_t>(flight->dst)),
                                  to_numpy(std::vector<int64_t>(flight->blocks)), flight->submission);
          },
          "req_id"_a, "(tokens, src, dst, blocks, submission) of the request's plan in flight, or None.")
      .def("requests", &vtoken::LazyFlights::requests, "The requests with a plan in flight, ascending.")
      .def("submissions", &vtoken::LazyFlights::submissions, "The submissions a plan in flight belongs to.")
      .def("__len__", &vtoken::LazyFlights::size);
}
