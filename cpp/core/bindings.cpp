// SPDX-License-Identifier: Apache-2.0
// Python bindings of the C++ token table (trtllm_vtoken._native._core), used through
// trtllm_vtoken/core/native.py. Errors map as the specification raises them: an unknown request
// is a KeyError, bad input a ValueError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "batch.h"
#include "select.h"
#include "token_table.h"

namespace nb = nanobind;
using namespace nb::literals;
using vtoken::Plan;
using vtoken::TokenTable;

using Ids = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using OwnedIds = nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>;

namespace {

// A numpy array that owns the vector's buffer (no copy).
OwnedIds to_numpy(std::vector<int64_t>&& values) {
  auto* owner = new std::vector<int64_t>(std::move(values));
  nb::capsule free_when_done(owner, [](void* p) noexcept { delete static_cast<std::vector<int64_t>*>(p); });
  return OwnedIds(owner->data(), {owner->size()}, free_when_done);
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "C++ token table and relocation planners (mirror of the Python specification)";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const vtoken::UnknownRequest& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });

  m.def(
      "select_lowest",
      [](nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> tokens,
         nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> block_table, int64_t tokens_per_block,
         Ids rows, Ids kv_len, Ids lo, Ids hi, Ids excess,
         std::optional<nb::ndarray<double, nb::ndim<1>, nb::c_contig, nb::device::cpu>> stat,
         std::optional<nb::ndarray<nb::ro, nb::ndim<2>, nb::c_contig, nb::device::cpu>> mass) {
        const auto batch = static_cast<int64_t>(rows.shape(0));
        for (const Ids* a : {&kv_len, &lo, &hi, &excess}) {
          if (a->shape(0) != static_cast<size_t>(batch)) {
            throw std::invalid_argument("select_lowest: rows, kv_len, lo, hi and excess need one entry per request");
          }
        }
        if (tokens_per_block <= 0 || tokens.shape(0) % tokens_per_block != 0) {
          throw std::invalid_argument("select_lowest: tokens must hold whole blocks of tokens_per_block slots");
        }
        if (stat && stat->shape(0) != tokens.shape(0)) {
          throw std::invalid_argument("select_lowest: stat needs one entry per slot");
        }
        if (mass && (!stat || mass->shape(0) != static_cast<size_t>(batch))) {
          throw std::invalid_argument("select_lowest: mass needs a statistic to add to and one row per request");
        }
        const bool single = mass && mass->dtype() == nb::dtype<float>();
        if (mass && !single && mass->dtype() != nb::dtype<double>()) {
          throw std::invalid_argument("select_lowest: mass must be float32 or float64");
        }
        const auto table_rows = static_cast<int64_t>(block_table.shape(0));
        const auto stride = static_cast<int64_t>(block_table.shape(1));
        for (int64_t i = 0; i < batch; ++i) {
          const int64_t length = kv_len.data()[i];
          if (rows.data()[i] < 0 || rows.data()[i] >= table_rows || length < 0 || length > stride * tokens_per_block ||
              (mass && length > static_cast<int64_t>(mass->shape(1)))) {
            throw std::invalid_argument("select_lowest: request " + std::to_string(i) +
                                        "'s row or length does not fit the block table / mass");
          }
        }
        const vtoken::SlotLayout layout{tokens.data(), block_table.data(), stride, tokens_per_block,
                                        static_cast<int64_t>(tokens.shape(0)) / tokens_per_block};
        vtoken::Selection r;
        {
          nb::gil_scoped_release release;
          const int64_t stride = mass ? static_cast<int64_t>(mass->shape(1)) : 0;
          double* accumulated = stat ? stat->data() : nullptr;
          if (single) {
            r = vtoken::select_lowest(layout, rows.data(), batch, kv_len.data(), lo.data(), hi.data(), excess.data(),
                                      accumulated, static_cast<const float*>(mass->data()), stride);
          } else {
            r = vtoken::select_lowest(layout, rows.data(), batch, kv_len.data(), lo.data(), hi.data(), excess.data(),
                                      accumulated, mass ? static_cast<const double*>(mass->data()) : nullptr, stride);
          }
        }
        return nb::make_tuple(to_numpy(std::move(r.rows)), to_numpy(std::move(r.positions)));
      },
      "tokens"_a, "block_table"_a, "tokens_per_block"_a, "rows"_a, "kv_len"_a, "lo"_a, "hi"_a, "excess"_a,
      "stat"_a = nb::none(), "mass"_a = nb::none(),
      "A score policy's decision for a batch over the step's slot layout (cpp/core/select.h): "
      "(batch rows, positions) of the victims.");

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

  nb::class_<TokenTable>(m, "TokenTable")
      .def(nb::init<int64_t>(), "tokens_per_block"_a)
      .def_prop_ro("tokens_per_block", &TokenTable::tokens_per_block)
      .def("set_shared", &TokenTable::set_shared, "block_id"_a, "shared"_a)
      .def("add_request", &TokenTable::add_request, "req_id"_a)
      .def("remove_request", &TokenTable::remove_request, "req_id"_a)
      .def("sync_new_tokens", &TokenTable::sync_new_tokens, "req_id"_a, "block_ids"_a, "total_len"_a)
      .def(
          "append_tokens",
          [](TokenTable& t, int64_t req_id, const std::vector<int64_t>& new_block_ids, int64_t num_new) {
            return t.append_tokens(req_id, new_block_ids.data(), static_cast<int64_t>(new_block_ids.size()),
                                   num_new);
          },
          "req_id"_a, "new_block_ids"_a, "num_new"_a)
      .def("evict_tokens", &TokenTable::evict_tokens, "req_id"_a, "token_ids"_a)
      .def("apply_moves", &TokenTable::apply_moves, "req_id"_a, "token_ids"_a, "dst_slots"_a)
      .def("truncate", &TokenTable::truncate, "req_id"_a, "new_kv_len"_a)
      .def("release_blocks", &TokenTable::release_blocks, "req_id"_a, "block_ids"_a)
      .def("request_ids", &TokenTable::request_ids)
      .def("__contains__", &TokenTable::contains)
      .def("hole_positions", &TokenTable::hole_positions, "req_id"_a)
      .def("metadata_bytes_per_token", &TokenTable::metadata_bytes_per_token)
      .def("plan_dense", &TokenTable::plan_dense, "req_id"_a)
      .def("plan_lazy", &TokenTable::plan_lazy, "req_id"_a)
      .def("fragmentation", &TokenTable::fragmentation, "req_id"_a)
      .def("commit", &TokenTable::commit, "plan"_a)
      .def(
          "commit_lazy",
          [](TokenTable& t, int64_t req_id, const std::vector<int64_t>& token_ids,
             const std::vector<int64_t>& src_slots, const std::vector<int64_t>& dst_slots,
             const std::vector<int64_t>& blocks_to_free) {
            Plan plan;
            plan.req_id = req_id;
            plan.dense = false;
            plan.version = t.seq(req_id).version;
            plan.token_ids = token_ids;
            plan.src_slots = src_slots;
            plan.dst_slots = dst_slots;
            plan.blocks_to_free = blocks_to_free;
            plan.blocks_before = static_cast<int64_t>(t.seq(req_id).block_ids.size());
            return t.commit(plan);
          },
          "req_id"_a, "token_ids"_a, "src_slots"_a, "dst_slots"_a, "blocks_to_free"_a,
          "Commits a lazy plan (a deferred step_batch's) once its background copy has finished.")
      .def("kv_len", [](const TokenTable& t, int64_t r) { return t.seq(r).kv_len; })
      .def("num_tokens", [](const TokenTable& t, int64_t r) { return t.seq(r).num_tokens; })
      .def("num_live", [](const TokenTable& t, int64_t r) { return t.seq(r).num_live; })
      .def("version", [](const TokenTable& t, int64_t r) { return t.seq(r).version; })
      .def("block_ids", [](const TokenTable& t, int64_t r) { return t.seq(r).block_ids; })
      .def("num_blocks", [](const TokenTable& t, int64_t r) { return t.seq(r).block_ids.size(); })
      .def("is_live", [](const TokenTable& t, int64_t r, int64_t token) {
        const auto& s = t.seq(r);
        return token >= 0 && token < s.num_tokens && s.live[token] != 0;
      })
      .def(
          "state",
          [](const TokenTable& t, int64_t r) {
            const auto& s = t.seq(r);
            auto listed = [](const auto& values) {
              std::vector<int64_t> out(values.size());
              for (size_t i = 0; i < values.size(); ++i) out[i] = values[i];
              return out;
            };
            return nb::make_tuple(s.block_ids, s.kv_len, s.num_tokens, s.num_live, s.version, listed(s.slot_of),
                                  listed(s.live), listed(s.token_at), listed(s.live_per_block), s.pending_dead);
          },
          "req_id"_a, "Everything observable about one request, for parity checks.")
      .def(
          "step_batch",
          [](TokenTable& t, Ids req_ids, Ids num_new, Ids new_block_offsets, Ids new_blocks,
             Ids evict_offsets, Ids evict_ids, int64_t compaction, int64_t threshold, bool pressure,
             std::optional<nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>> may_plan) {
            const auto batch = static_cast<int64_t>(req_ids.shape(0));
            if (num_new.shape(0) != static_cast<size_t>(batch) ||
                new_block_offsets.shape(0) != static_cast<size_t>(batch + 1) ||
                evict_offsets.shape(0) != static_cast<size_t>(batch + 1)) {
              throw std::invalid_argument("step_batch: num_new needs one entry per request and "
                                          "each offsets array one more");
            }
            if (compaction < 0 || compaction > 3) {
              throw std::invalid_argument(
                  "step_batch: compaction must be 0 (dense), 1 (lazy), 2 (dead blocks) or 3 (lazy deferred)");
            }
            if (may_plan && may_plan->shape(0) != static_cast<size_t>(batch)) {
              throw std::invalid_argument("step_batch: may_plan needs one entry per request");
            }
            auto check_csr = [batch](const Ids& offsets, const Ids& values, const char* name) {
              const int64_t* o = offsets.data();
              bool ok = o[0] == 0 && o[batch] <= static_cast<int64_t>(values.shape(0));
              for (int64_t i = 0; ok && i < batch; ++i) ok = o[i] <= o[i + 1];
              if (!ok) {
                throw std::invalid_argument(std::string("step_batch: ") + name +
                                            " must start at 0, never decrease and stay within its values");
              }
            };
            check_csr(new_block_offsets, new_blocks, "new_block_offsets");
            check_csr(evict_offsets, evict_ids, "evict_offsets");
            vtoken::StepResult r;
            {
              nb::gil_scoped_release release;
              r = vtoken::step_batch(t, req_ids.data(), batch, num_new.data(), new_block_offsets.data(),
                                     new_blocks.data(), evict_offsets.data(), evict_ids.data(),
                                     static_cast<vtoken::Compaction>(compaction), threshold, pressure,
                                     may_plan ? may_plan->data() : nullptr);
            }
            return nb::make_tuple(to_numpy(std::move(r.move_offsets)), to_numpy(std::move(r.move_tokens)),
                                  to_numpy(std::move(r.move_src)), to_numpy(std::move(r.move_dst)),
                                  to_numpy(std::move(r.freed_offsets)), to_numpy(std::move(r.freed)),
                                  to_numpy(std::move(r.kv_lens)));
          },
          "req_ids"_a, "num_new"_a, "new_block_offsets"_a, "new_blocks"_a, "evict_offsets"_a,
          "evict_ids"_a, "compaction"_a, "fragmentation_threshold"_a = 1, "pressure"_a = false,
          "may_plan"_a = nb::none(),
          "One decode step of a batch (cpp/core/batch.h). Returns int64 arrays: (move_offsets, "
          "move_tokens, move_src, move_dst, freed_offsets, freed, kv_lens).");
}
