// SPDX-License-Identifier: Apache-2.0
// The layout argument the slot bindings take (slot_bindings.cpp, flight_bindings.cpp): the
// SlotMap's own numpy buffers (trtllm_vtoken/step/slots.py native_layout), bound once.
#pragma once

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include "slots.h"

namespace vtoken::slot_args {

namespace nb = nanobind;

using Ids = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Counters = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Tokens = nb::ndarray<int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using BlockTable = nb::ndarray<int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Stat = nb::ndarray<nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// The layout's arrays, checked against each other.
inline vtoken::SlotArrays layout_arrays(Tokens tokens, BlockTable block_table, int64_t tokens_per_block,
                                        Counters num_blocks_of, Counters kv_len, Counters num_tokens,
                                        Counters num_live, const std::vector<Stat>& stats) {
  const size_t rows = block_table.shape(0);
  for (const Counters* c : {&num_blocks_of, &kv_len, &num_tokens, &num_live}) {
    if (c->shape(0) != rows) throw std::invalid_argument("slots: every counter needs one entry per block-table row");
  }
  if (tokens_per_block <= 0 || tokens.shape(0) % tokens_per_block != 0) {
    throw std::invalid_argument("slots: tokens must hold whole blocks of tokens_per_block slots");
  }
  vtoken::SlotArrays a{tokens.data(), block_table.data(), static_cast<int64_t>(block_table.shape(1)), tokens_per_block,
                       static_cast<int32_t>(tokens.shape(0) / tokens_per_block - 1), num_blocks_of.data(), kv_len.data(),
                       num_tokens.data(), num_live.data(), {}};
  for (const Stat& s : stats) {
    if (s.shape(0) != tokens.shape(0)) throw std::invalid_argument("slots: a statistic needs one entry per slot");
    a.stats.push_back({static_cast<uint8_t*>(s.data()), static_cast<int64_t>(s.itemsize())});
  }
  return a;
}

// The SlotMap's buffers, bound once (SlotMap.native_layout) instead of converted on every call: a
// decode step makes two or three layout calls, and converting eight buffers each time was a fifth
// of a one-request step (60 us before, 48 after, warm; benchmarks/RESULTS.md). Holds a reference
// to each buffer (they live as long as the binding); the SlotMap binds again when it replaces one.
class BoundLayout {
 public:
  BoundLayout(Tokens tokens, BlockTable block_table, int64_t tokens_per_block, Counters num_blocks_of,
              Counters kv_len, Counters num_tokens, Counters num_live, std::vector<Stat> stats)
      : arrays_(layout_arrays(tokens, block_table, tokens_per_block, num_blocks_of, kv_len, num_tokens, num_live,
                              stats)),
        held_{tokens, block_table, num_blocks_of, kv_len, num_tokens, num_live},
        stats_(std::move(stats)) {}

  vtoken::SlotArrays& arrays() { return arrays_; }
  size_t rows() const { return std::get<1>(held_).shape(0); }   // block-table rows
  size_t slots() const { return std::get<0>(held_).shape(0); }  // slots of the pool and the scratch block

 private:
  vtoken::SlotArrays arrays_;
  std::tuple<Tokens, BlockTable, Counters, Counters, Counters, Counters> held_;  // keeps the buffers alive
  std::vector<Stat> stats_;
};

inline void check_batch(const Ids& rows, size_t rows_in_table, size_t batch, const char* what) {
  if (rows.shape(0) != batch) throw std::invalid_argument(std::string("slots: ") + what + " needs one entry per request");
  for (size_t i = 0; i < batch; ++i) {
    if (rows.data()[i] < 0 || static_cast<size_t>(rows.data()[i]) >= rows_in_table) {
      throw std::invalid_argument("slots: row " + std::to_string(rows.data()[i]) + " is outside the block table");
    }
  }
}

// A batch the registration's checks refused, before anything changed (Python: BatchRefused, a
// ValueError): a host tells it from a refusal by the token table halfway through a step.
struct BatchRefused : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A batch's new blocks in CSR form (request i: blocks[offsets[i]:offsets[i + 1]]), from what a host
// passes: CSR int64 arrays, or (offsets None) a sequence of per-request sequences of block ids,
// which the host's thread then hands over with no numpy call (step/io.py StepInput: on that thread
// each numpy call costs a multiple of its warm time, benchmarks/step/cold_host). BatchRefused
// for anything else or an id outside int64 (nothing changed).
struct NewBlocks {
  std::vector<int64_t> offsets, blocks;
};

inline NewBlocks csr_blocks(const Ids& offsets, const Ids& blocks) {
  return {{offsets.data(), offsets.data() + offsets.shape(0)}, {blocks.data(), blocks.data() + blocks.shape(0)}};
}

inline NewBlocks listed_blocks(nb::handle lists) {
  const auto refused = [] {
    PyErr_Clear();
    return BatchRefused("slots: new blocks must be one sequence of block ids per request");
  };
  PyObject* fast = PySequence_Fast(lists.ptr(), "");
  if (!fast) throw refused();
  NewBlocks out;
  const Py_ssize_t batch = PySequence_Fast_GET_SIZE(fast);
  out.offsets.reserve(batch + 1);
  out.offsets.push_back(0);
  for (Py_ssize_t i = 0; i < batch; ++i) {
    PyObject* listed = PySequence_Fast_GET_ITEM(fast, i);
    if (!PyList_Check(listed) && !PyTuple_Check(listed)) {
      Py_DECREF(fast);
      throw refused();
    }
    PyObject** ids = PySequence_Fast_ITEMS(listed);
    for (Py_ssize_t k = 0, n = PySequence_Fast_GET_SIZE(listed); k < n; ++k) {  // (a decode step: mostly none)
      const long long id = PyLong_AsLongLong(ids[k]);
      if (id == -1 && PyErr_Occurred()) {
        Py_DECREF(fast);
        throw refused();
      }
      out.blocks.push_back(id);
    }
    out.offsets.push_back(static_cast<int64_t>(out.blocks.size()));
  }
  Py_DECREF(fast);
  return out;
}

inline NewBlocks new_blocks_of(const std::optional<Ids>& offsets, nb::handle blocks) {
  if (!offsets) return listed_blocks(blocks);
  Ids csr;
  if (!nb::try_cast(blocks, csr)) throw BatchRefused("slots: CSR new blocks must be an int64 array");
  return csr_blocks(*offsets, csr);
}

// The registration's checks of a batch's new blocks and tokens (the sizes, then slots.h check_new,
// in its words; BatchRefused, nothing changed) and the block-table columns its rows need with
// their new blocks: 0 when they fit, else the columns the table must grow to first.
inline int64_t checked_registration(BoundLayout& layout, const Ids& req_ids, const Ids& rows, const NewBlocks& added,
                                    const Ids& num_new, int64_t num_blocks, const vtoken::TokenTable& table) {
  const std::vector<int64_t>& offsets = added.offsets;
  vtoken::SlotArrays& a = layout.arrays();
  const size_t batch = rows.shape(0);
  try {
    check_batch(rows, layout.rows(), batch, "rows");
  } catch (const std::invalid_argument& e) {
    throw BatchRefused(e.what());
  }
  if (req_ids.shape(0) != batch || offsets.size() != batch + 1 || num_new.shape(0) != batch) {
    throw BatchRefused("slots: req_ids and num_new need one entry per row, offsets one more");
  }
  if (num_blocks <= 0 || num_blocks > a.scratch) {
    throw BatchRefused("slots: num_blocks must lie in [1, the layout's blocks]");
  }
  const std::string wrong = vtoken::check_new(a, req_ids.data(), rows.data(), static_cast<int64_t>(batch),
                                              static_cast<int64_t>(layout.rows()), offsets.data(), added.blocks.data(),
                                              static_cast<int64_t>(added.blocks.size()), num_new.data(), num_blocks,
                                              table);
  if (!wrong.empty()) throw BatchRefused(wrong);
  int64_t needed = 0;
  for (size_t i = 0; i < batch; ++i) {
    needed = std::max(needed, a.num_blocks_of[rows.data()[i]] + offsets[i + 1] - offsets[i]);
  }
  return needed > a.block_stride ? needed : 0;
}

}  // namespace vtoken::slot_args
