// SPDX-License-Identifier: Apache-2.0
// Python bindings of the decisions the C++ core makes over the step's layout (select.h, budget.h):
// a score policy's lowest statistics (H2O), the bounds rule, and an id-scored policy's lowest live
// ids (StreamingLLM, sliding window). Used by trtllm_vtoken/step/decide.py.
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>

#include "budget.h"
#include "owned_ids.h"
#include "select.h"
#include "token_table.h"

namespace nb = nanobind;
using namespace nb::literals;
using vtoken::TokenTable;
using vtoken::to_numpy;

using Ids = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

void bind_select(nb::module_& m) {
  m.def(
      "select_lowest",
      [](nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> tokens,
         nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> block_table, int64_t tokens_per_block,
         Ids rows, Ids kv_len, Ids lo, Ids hi, Ids excess,
         std::optional<nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>> stat,
         std::optional<nb::ndarray<nb::ro, nb::ndim<2>, nb::c_contig, nb::device::cpu>> mass,
         const TokenTable* shared_of, int64_t threads) {
        const auto batch = static_cast<int64_t>(rows.shape(0));
        if (threads < 1) throw std::invalid_argument("select_lowest: threads must be >= 1");
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
          float* accumulated = stat ? stat->data() : nullptr;
          if (single) {
            r = vtoken::select_lowest(layout, rows.data(), batch, kv_len.data(), lo.data(), hi.data(), excess.data(),
                                      accumulated, static_cast<const float*>(mass->data()), stride, shared_of,
                                      threads);
          } else {
            r = vtoken::select_lowest(layout, rows.data(), batch, kv_len.data(), lo.data(), hi.data(), excess.data(),
                                      accumulated, mass ? static_cast<const double*>(mass->data()) : nullptr, stride,
                                      shared_of, threads);
          }
        }
        return nb::make_tuple(to_numpy(std::move(r.rows)), to_numpy(std::move(r.positions)));
      },
      "tokens"_a, "block_table"_a, "tokens_per_block"_a, "rows"_a, "kv_len"_a, "lo"_a, "hi"_a, "excess"_a,
      "stat"_a.noconvert() = nb::none(), "mass"_a = nb::none(), "shared_of"_a = nb::none(), "threads"_a = 1,
      "A score policy's decision for a batch over the step's slot layout (cpp/core/select.h): "
      "(batch rows, positions) of the victims; stat: float32, one per slot, accumulated in place (never "
      "converted); shared_of: the table whose shared blocks' tokens are no "
      "candidates; threads: the pass may split the rows over that many threads (the same victims).");

  m.def(
      "candidate_bounds",
      [](std::tuple<int64_t, double, int64_t, int64_t, double, int64_t> rule, Ids num_tokens, Ids num_live, Ids protected_live) {
        vtoken::BoundsRule r;
        std::tie(r.tokens, r.ratio, r.n_sink, r.recent_window, r.recent_ratio, r.unit) = rule;
        if (!vtoken::valid(r)) throw std::invalid_argument("candidate_bounds: the rule is out of range (budget.h)");
        const size_t n = num_tokens.shape(0);
        if (num_live.shape(0) != n || protected_live.shape(0) != n) {
          throw std::invalid_argument("candidate_bounds: one num_live and protected_live per num_tokens");
        }
        std::vector<int64_t> excess(n), lo(n), hi(n), target(n);
        for (size_t i = 0; i < n; ++i) {
          const vtoken::Bounds b =
              vtoken::candidate_bounds(r, num_tokens.data()[i], num_live.data()[i], protected_live.data()[i]);
          excess[i] = b.excess, lo[i] = b.lo, hi[i] = b.hi;
          target[i] = vtoken::budget_target(r, num_tokens.data()[i]);
        }
        return nb::make_tuple(to_numpy(std::move(excess)), to_numpy(std::move(lo)), to_numpy(std::move(hi)),
                              to_numpy(std::move(target)));
      },
      "rule"_a, "num_tokens"_a, "num_live"_a, "protected_live"_a,
      "The fused decode call's bounds rule (budget.h) per request: (excess, lo, hi) as "
      "ScorePolicy.candidate_bounds gives them, and the budget's target of num_tokens (Budget.targets).");
  m.def(
      "lowest_live_ids",
      [](const TokenTable& table, Ids req_ids, Ids lo, Ids hi, Ids excess,
         std::optional<nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>> block_table,
         std::optional<Ids> rows) {
        const auto batch = static_cast<int64_t>(req_ids.shape(0));
        for (const Ids* a : {&lo, &hi, &excess}) {
          if (a->shape(0) != static_cast<size_t>(batch)) {
            throw std::invalid_argument("lowest_live_ids: req_ids, lo, hi and excess need one entry per request");
          }
        }
        if (block_table.has_value() != rows.has_value() || (rows && rows->shape(0) != static_cast<size_t>(batch))) {
          throw std::invalid_argument("lowest_live_ids: block_table and rows come together, one row per request");
        }
        vtoken::SlotLayout layout{nullptr, nullptr, 0, table.tokens_per_block(), 0};
        vtoken::RowsOf shared_in{&layout, nullptr};
        if (rows) {
          for (int64_t i = 0; i < batch; ++i) {
            if (rows->data()[i] < 0 || rows->data()[i] >= static_cast<int64_t>(block_table->shape(0))) {
              throw std::invalid_argument("lowest_live_ids: a row is outside the block table");
            }
          }
          layout.block_table = block_table->data();
          layout.block_stride = static_cast<int64_t>(block_table->shape(1));
          shared_in.rows = rows->data();
        }
        vtoken::Selection r;
        {
          nb::gil_scoped_release release;
          r = vtoken::lowest_live_ids(table, req_ids.data(), batch, lo.data(), hi.data(), excess.data(),
                                      rows ? &shared_in : nullptr);
        }
        return nb::make_tuple(to_numpy(std::move(r.rows)), to_numpy(std::move(r.positions)));
      },
      "table"_a, "req_ids"_a, "lo"_a, "hi"_a, "excess"_a, "block_table"_a = nb::none(), "rows"_a = nb::none(),
      "An id-scored policy's decision from the table's liveness (cpp/core/select.h): (batch rows, "
      "positions) of the victims; with the step's block table and the requests' rows, tokens in shared "
      "blocks are no candidates.");
}
