// SPDX-License-Identifier: Apache-2.0
// Python bindings of the step's batch-layout updates (slots.h): the arrays are the SlotMap's own
// numpy buffers, written in place.
#include <tuple>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "owned_ids.h"
#include "slot_args.h"
#include "slots.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace vtoken::slot_args;


void bind_slots(nb::module_& m) {
  nb::exception<BatchRefused>(m, "BatchRefused", PyExc_ValueError);
  nb::class_<BoundLayout>(m, "BoundLayout",
                          "A SlotMap's buffers bound once for the slot calls (slot_args.h); bound again when "
                          "one is replaced.")
      .def(nb::init<Tokens, BlockTable, int64_t, Counters, Counters, Counters, Counters, std::vector<Stat>>(),
           // Written in place: a buffer of another dtype is refused, never converted into a copy.
           "tokens"_a.noconvert(), "block_table"_a.noconvert(), "tokens_per_block"_a, "num_blocks_of"_a.noconvert(),
           "kv_len"_a.noconvert(), "num_tokens"_a.noconvert(), "num_live"_a.noconvert(), "stats"_a);
  m.def(
      "slots_register",
      [](BoundLayout& layout, Ids req_ids, Ids rows, std::optional<Ids> offsets, nb::handle blocks, Ids num_new,
         int64_t num_blocks, const vtoken::TokenTable& table, bool want_slots) {
        const NewBlocks added = new_blocks_of(offsets, blocks);
        const int64_t needed = checked_registration(layout, req_ids, rows, added, num_new, num_blocks, table);
        if (needed) return nb::make_tuple(needed, nb::none());  // nothing written
        vtoken::SlotArrays& a = layout.arrays();
        const size_t batch = rows.shape(0);
        std::vector<int64_t> slots = vtoken::register_new(a, rows.data(), static_cast<int64_t>(batch),
                                                          added.offsets.data(), added.blocks.data(), num_new.data());
        if (!want_slots) return nb::make_tuple(0, nb::none());
        return nb::make_tuple(0, vtoken::to_numpy(std::move(slots)));
      },
      "layout"_a, "req_ids"_a, "rows"_a, "offsets"_a, "blocks"_a, "num_new"_a, "num_blocks"_a, "table"_a,
      "want_slots"_a = true,
      "The step's checks of the new blocks and tokens (ValueError, nothing changed), then SlotMap.append_blocks + "
      "register in one call (cpp/core/slots.h). The new blocks: CSR (offsets, blocks int64 arrays) or, offsets "
      "None, blocks one sequence of block ids per request. Returns (0, the new tokens' slots, or None unless "
      "want_slots), or (the block-table columns needed, None) with nothing written when the table must grow "
      "first.");
  m.def(
      "slots_protected_live",
      [](BoundLayout& layout, Ids rows, const vtoken::TokenTable& table) {
        const vtoken::SlotArrays& a = layout.arrays();
        check_batch(rows, layout.rows(), rows.shape(0), "rows");
        return vtoken::to_numpy(vtoken::protected_live(a, rows.data(), static_cast<int64_t>(rows.shape(0)), table));
      },
      "layout"_a, "rows"_a, "table"_a,
      "Per row, its live tokens in blocks the table holds as shared, read from the layout (cpp/core/slots.h).");
}
