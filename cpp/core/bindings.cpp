// SPDX-License-Identifier: Apache-2.0
// Python bindings of the C++ token table (trtllm_vtoken._native._core), used through
// trtllm_vtoken/core/native.py. Errors map as the specification raises them: an unknown request
// is a KeyError, bad input a ValueError.
//
// Arguments are converted as core/arguments.py converts them, through the same CPython calls
// (operator.index for each integer, iter for each list of ids), so a float, a string or an
// integer outside int64 is refused with the same exception and message as in Python, before the
// table is touched. The methods take Python objects for that reason; step_batch keeps a typed
// overload for contiguous int64 arrays (its hot path) ahead of the converting one.
#include <cstring>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "batch.h"
#include "owned_ids.h"
#include "token_table.h"

namespace nb = nanobind;
using namespace nb::literals;
using vtoken::Plan;
using vtoken::TokenTable;

using Ids = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using vtoken::OwnedIds;
using vtoken::to_numpy;

namespace {

// A Python, numpy or torch boolean: a mask's entry, never an id (arguments.is_bool).
bool is_bool(nb::handle value) {
  if (PyBool_Check(value.ptr())) return true;
  if (!PyObject_HasAttrString(value.ptr(), "dtype")) return false;
  nb::object dtype = nb::steal(PyObject_GetAttrString(value.ptr(), "dtype"));
  if (!dtype.is_valid()) throw nb::python_error();
  nb::object name = nb::steal(PyObject_Str(dtype.ptr()));
  if (!name.is_valid()) throw nb::python_error();
  const char* text = PyUnicode_AsUTF8(name.ptr());
  if (text == nullptr) throw nb::python_error();
  return std::strcmp(text, "bool") == 0 || std::strcmp(text, "torch.bool") == 0;
}

// operator.index(value), then the int64 range (arguments.as_int); a bool is refused first.
int64_t as_int(nb::handle value) {
  if (!PyLong_CheckExact(value.ptr()) && is_bool(value)) {
    throw nb::type_error("a bool is not a token id (a mask? pass np.flatnonzero(mask), the ids it keeps or drops)");
  }
  nb::object number = nb::steal(PyNumber_Index(value.ptr()));
  if (!number.is_valid()) throw nb::python_error();
  int overflow = 0;
  const long long result = PyLong_AsLongLongAndOverflow(number.ptr(), &overflow);
  if (overflow != 0) {
    throw std::invalid_argument("integer " + std::string(nb::str(number).c_str()) +
                                " is outside int64 [-9223372036854775808, 9223372036854775807]");
  }
  if (result == -1 && PyErr_Occurred()) throw nb::python_error();
  return result;
}

// Each item of an iterable through as_int, in order (arguments.as_ints).
std::vector<int64_t> as_ints(nb::handle values) {
  nb::object iterator = nb::steal(PyObject_GetIter(values.ptr()));
  if (!iterator.is_valid()) throw nb::python_error();
  std::vector<int64_t> out;
  while (PyObject* item = PyIter_Next(iterator.ptr())) {
    out.push_back(as_int(nb::steal(item)));
  }
  if (PyErr_Occurred()) throw nb::python_error();
  return out;
}

bool is_true(nb::handle value) {
  const int truth = PyObject_IsTrue(value.ptr());
  if (truth < 0) throw nb::python_error();
  return truth != 0;
}

// The step's checks and call, shared by the typed and the converting overloads.
nb::tuple step_batch_on(TokenTable& t, const int64_t* req_ids, size_t batch, const int64_t* num_new,
                        size_t num_new_size, const int64_t* block_offsets, size_t block_offsets_size,
                        const int64_t* blocks, size_t num_blocks, const int64_t* evict_offsets,
                        size_t evict_offsets_size, const int64_t* evicts, size_t num_evicts, int64_t compaction,
                        int64_t threshold, bool pressure, const uint8_t* may_plan, size_t may_plan_size) {
  if (num_new_size != batch || block_offsets_size != batch + 1 || evict_offsets_size != batch + 1) {
    throw std::invalid_argument("step_batch: num_new needs one entry per request and each offsets array one more");
  }
  if (compaction < 0 || compaction > 3) {
    throw std::invalid_argument(
        "step_batch: compaction must be 0 (dense), 1 (lazy), 2 (dead blocks) or 3 (lazy deferred)");
  }
  if (may_plan != nullptr && may_plan_size != batch) {
    throw std::invalid_argument("step_batch: may_plan needs one entry per request");
  }
  auto check_csr = [batch](const int64_t* o, size_t num_values, const char* name) {
    bool ok = o[0] == 0 && o[batch] <= static_cast<int64_t>(num_values);
    for (size_t i = 0; ok && i < batch; ++i) ok = o[i] <= o[i + 1];
    if (!ok) {
      throw std::invalid_argument(std::string("step_batch: ") + name +
                                  " must start at 0, never decrease and stay within its values");
    }
  };
  check_csr(block_offsets, num_blocks, "new_block_offsets");
  check_csr(evict_offsets, num_evicts, "evict_offsets");
  vtoken::StepResult r;
  {
    nb::gil_scoped_release release;
    r = vtoken::step_batch(t, req_ids, static_cast<int64_t>(batch), num_new, block_offsets, blocks, evict_offsets,
                           evicts, static_cast<vtoken::Compaction>(compaction), threshold, pressure, may_plan);
  }
  return nb::make_tuple(to_numpy(std::move(r.move_offsets)), to_numpy(std::move(r.move_tokens)),
                        to_numpy(std::move(r.move_src)), to_numpy(std::move(r.move_dst)),
                        to_numpy(std::move(r.freed_offsets)), to_numpy(std::move(r.freed)),
                        to_numpy(std::move(r.kv_lens)));
}

}  // namespace

void bind_slots(nb::module_& m);    // slot_bindings.cpp
void bind_flights(nb::module_& m);  // flight_bindings.cpp
void bind_decode(nb::module_& m);   // decode_bindings.cpp
void bind_mass_passes(nb::module_& m);  // mass_bindings.cpp
void bind_select(nb::module_& m);  // select_bindings.cpp

NB_MODULE(_core, m) {
  m.doc() = "C++ token table and relocation planners (mirror of the Python specification)";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const vtoken::UnknownRequest& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });

  bind_slots(m);
  bind_flights(m);
  bind_decode(m);
  bind_mass_passes(m);
  bind_select(m);
  m.def("set_compaction_timed", &vtoken::set_compaction_timed, "on"_a,
        "Process-wide: whether step_batch times each compaction's plan and commit (the decode call's "
        "(decide, plan, commit) seconds; cpp/core/batch.h). A diagnostic, off by default: its per-request marks "
        "cost the loop ~10-15% in the step alone.");
  m.def("compaction_is_timed", &vtoken::compaction_is_timed, "Whether set_compaction_timed(True) is in force.");
  nb::class_<Plan>(m, "Plan")
      .def_ro("req_id", &Plan::req_id)
      .def_ro("dense", &Plan::dense)
      .def_ro("version", &Plan::version)
      .def_ro("token_ids", &Plan::token_ids)
      .def_ro("src_slots", &Plan::src_slots)
      .def_ro("dst_slots", &Plan::dst_slots)
      .def_ro("blocks_to_free", &Plan::blocks_to_free)
      .def_ro("blocks_before", &Plan::blocks_before)
      .def_ro("new_kv_len", &Plan::new_kv_len);

  using H = nb::handle;
  auto A = [](const char* name) { return nb::arg(name).none(); };  // None reaches the conversion
  nb::class_<TokenTable>(m, "TokenTable")
      .def("__init__", [](TokenTable* t, H tpb) { new (t) TokenTable(as_int(tpb)); }, A("tokens_per_block"))
      .def_prop_ro("tokens_per_block", &TokenTable::tokens_per_block)
      .def("set_shared", [](TokenTable& t, H b, H shared) { t.set_shared(as_int(b), is_true(shared)); },
           A("block_id"), A("shared"))
      .def("holders_of", [](const TokenTable& t, H b) { return t.holders_of(as_int(b)); }, A("block_id"))
      .def("add_request", [](TokenTable& t, H r) { t.add_request(as_int(r)); }, A("req_id"))
      .def("remove_request", [](TokenTable& t, H r) { return t.remove_request(as_int(r)); }, A("req_id"))
      .def(
          "sync_new_tokens",
          [](TokenTable& t, H r, H blocks, H total) {
            const int64_t req_id = as_int(r);
            const std::vector<int64_t> block_ids = as_ints(blocks);
            return t.sync_new_tokens(req_id, block_ids, as_int(total));
          },
          A("req_id"), A("block_ids"), A("total_len"))
      .def(
          "append_tokens",
          [](TokenTable& t, H r, H blocks, H num_new) {
            const int64_t req_id = as_int(r);
            const std::vector<int64_t> added = as_ints(blocks);
            return t.append_tokens(req_id, added.data(), static_cast<int64_t>(added.size()), as_int(num_new));
          },
          A("req_id"), A("new_block_ids"), A("num_new"))
      .def(
          "evict_tokens",
          [](TokenTable& t, H r, H ids) {
            const int64_t req_id = as_int(r);
            t.evict_tokens(req_id, as_ints(ids));
          },
          A("req_id"), A("token_ids"))
      .def(
          "apply_moves",
          [](TokenTable& t, H r, H ids, H dsts) {
            const int64_t req_id = as_int(r);
            const std::vector<int64_t> token_ids = as_ints(ids);
            t.apply_moves(req_id, token_ids, as_ints(dsts));
          },
          A("req_id"), A("token_ids"), A("dst_slots"))
      .def(
          "truncate",
          [](TokenTable& t, H r, H len) {
            const int64_t req_id = as_int(r);
            return t.truncate(req_id, as_int(len));
          },
          A("req_id"), A("new_kv_len"))
      .def(
          "release_blocks",
          [](TokenTable& t, H r, H blocks) {
            const int64_t req_id = as_int(r);
            t.release_blocks(req_id, as_ints(blocks));
          },
          A("req_id"), A("block_ids"))
      .def("request_ids", &TokenTable::request_ids)
      .def("__contains__",
           [](const TokenTable& t, H r) {
             nb::object number = nb::steal(PyNumber_Index(r.ptr()));
             if (!number.is_valid()) throw nb::python_error();
             int overflow = 0;
             const long long req_id = PyLong_AsLongLongAndOverflow(number.ptr(), &overflow);
             return overflow == 0 && t.contains(req_id);  // an id outside int64 is never a request
           },
           A("req_id"))
      .def("hole_positions", [](TokenTable& t, H r) { return t.hole_positions(as_int(r)); }, A("req_id"))
      .def("metadata_bytes_per_token", &TokenTable::metadata_bytes_per_token)
      .def("plan_dense", [](TokenTable& t, H r) { return t.plan_dense(as_int(r)); }, A("req_id"))
      .def("plan_lazy", [](TokenTable& t, H r) { return t.plan_lazy(as_int(r)); }, A("req_id"))
      .def("fragmentation", [](const TokenTable& t, H r) { return t.fragmentation(as_int(r)); }, A("req_id"))
      .def("commit", &TokenTable::commit, "plan"_a)
      .def(
          "commit_lazy",
          [](TokenTable& t, H r, H ids, H srcs, H dsts, H frees) {
            const int64_t req_id = as_int(r);
            Plan plan;
            plan.token_ids = as_ints(ids);
            plan.src_slots = as_ints(srcs);
            plan.dst_slots = as_ints(dsts);
            plan.blocks_to_free = as_ints(frees);
            plan.req_id = req_id;
            plan.dense = false;
            plan.version = t.seq(req_id).version;
            plan.blocks_before = static_cast<int64_t>(t.seq(req_id).block_ids.size());
            return t.commit(plan);
          },
          A("req_id"), A("token_ids"), A("src_slots"), A("dst_slots"), A("blocks_to_free"),
          "Commits a lazy plan (a deferred step_batch's) once its background copy has finished.")
      .def("kv_len", [](const TokenTable& t, H r) { return t.seq(as_int(r)).kv_len; }, A("req_id"))
      .def("num_tokens", [](const TokenTable& t, H r) { return t.seq(as_int(r)).num_tokens; }, A("req_id"))
      .def("num_live", [](const TokenTable& t, H r) { return t.seq(as_int(r)).num_live; }, A("req_id"))
      .def("version", [](const TokenTable& t, H r) { return t.seq(as_int(r)).version; }, A("req_id"))
      .def("block_ids", [](const TokenTable& t, H r) { return t.seq(as_int(r)).block_ids; }, A("req_id"))
      .def("num_blocks", [](const TokenTable& t, H r) { return t.seq(as_int(r)).block_ids.size(); }, A("req_id"))
      .def("is_live",
           [](const TokenTable& t, H r, H token_id) {
             const int64_t req_id = as_int(r);
             const int64_t token = as_int(token_id);
             const auto& s = t.seq(req_id);
             return token >= 0 && token < s.num_tokens && s.live[token] != 0;
           },
           A("req_id"), A("token_id"))
      .def(
          "state",
          [](const TokenTable& t, H r) {
            const auto& s = t.seq(as_int(r));
            auto listed = [](const auto& values) {
              std::vector<int64_t> out(values.size());
              for (size_t i = 0; i < values.size(); ++i) out[i] = values[i];
              return out;
            };
            return nb::make_tuple(s.block_ids, s.kv_len, s.num_tokens, s.num_live, s.version, listed(s.slot_of),
                                  listed(s.live), listed(s.token_at), listed(s.live_per_block), s.pending_dead);
          },
          A("req_id"), "Everything observable about one request, for parity checks.")
      .def(
          "step_batch",
          [](TokenTable& t, Ids req_ids, Ids num_new, Ids new_block_offsets, Ids new_blocks, Ids evict_offsets,
             Ids evict_ids, int64_t compaction, int64_t threshold, bool pressure,
             std::optional<nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>> may_plan) {
            return step_batch_on(t, req_ids.data(), req_ids.shape(0), num_new.data(), num_new.shape(0),
                                 new_block_offsets.data(), new_block_offsets.shape(0), new_blocks.data(),
                                 new_blocks.shape(0), evict_offsets.data(), evict_offsets.shape(0),
                                 evict_ids.data(), evict_ids.shape(0), compaction, threshold, pressure,
                                 may_plan ? may_plan->data() : nullptr, may_plan ? may_plan->shape(0) : 0);
          },
          "req_ids"_a, "num_new"_a, "new_block_offsets"_a, "new_blocks"_a, "evict_offsets"_a,
          "evict_ids"_a, "compaction"_a, "fragmentation_threshold"_a = 1, "pressure"_a = false,
          "may_plan"_a = nb::none(),
          "One decode step of a batch (cpp/core/batch.h). Returns int64 arrays: (move_offsets, "
          "move_tokens, move_src, move_dst, freed_offsets, freed, kv_lens).")
      .def(
          "step_batch",
          [](TokenTable& t, H req_ids, H num_new, H new_block_offsets, H new_blocks, H evict_offsets, H evict_ids,
             H compaction, H threshold, H pressure, H may_plan) {
            // Lists, other dtypes: converted as the Python step_batch converts them.
            const std::vector<int64_t> r = as_ints(req_ids), n = as_ints(num_new), bo = as_ints(new_block_offsets),
                                       b = as_ints(new_blocks), eo = as_ints(evict_offsets), e = as_ints(evict_ids);
            const int64_t min_fragmentation = as_int(threshold);
            const bool under_pressure = is_true(pressure);
            std::vector<uint8_t> allowed;
            if (!may_plan.is_none()) {
              for (nb::handle item : may_plan) allowed.push_back(is_true(item) ? 1 : 0);
            }
            return step_batch_on(t, r.data(), r.size(), n.data(), n.size(), bo.data(), bo.size(), b.data(), b.size(),
                                 eo.data(), eo.size(), e.data(), e.size(), as_int(compaction), min_fragmentation,
                                 under_pressure, may_plan.is_none() ? nullptr : allowed.data(), allowed.size());
          },
          A("req_ids"), A("num_new"), A("new_block_offsets"), A("new_blocks"), A("evict_offsets"), A("evict_ids"),
          A("compaction"), A("fragmentation_threshold") = nb::int_(1), A("pressure") = nb::bool_(false),
          A("may_plan") = nb::none());
}
