// SPDX-License-Identifier: Apache-2.0
// A score policy's batched decision over the step's slot layout (trtllm_vtoken/step/slots.py),
// in one pass per request: no batch-layout copies. Mirrors ScorePolicy.select_batch
// (trtllm_vtoken/policies/base.py) for the scores that live in the layout itself: the token's
// logical id (StreamingLLM, sliding window) or a per-slot statistic, optionally accumulating this
// step's attention mass into it first (H2O's observe).
#pragma once

#include <cstdint>
#include <vector>

#include "token_table.h"

namespace vtoken {

struct SlotLayout {
  const int32_t* tokens;       // [slots] live logical id at each slot, -1 where none
  const int32_t* block_table;  // [rows, block_stride] block ids, row by row
  int64_t block_stride;
  int64_t tokens_per_block;
  int64_t num_blocks;  // blocks the layout covers: tokens holds num_blocks * tokens_per_block slots
};

struct Selection {
  std::vector<int64_t> rows;       // index into the batch, ascending
  std::vector<int64_t> positions;  // physical position of each victim; ids ascending per row
};

// For batch row i (layout row rows[i], positions [0, kv_len[i])):
//   mass != null:  stat[slot] += mass[i * mass_stride + p] at every position (all rows)
//   excess[i] > 0: candidates are live ids in [lo[i], hi[i]); victims: the excess[i] candidates
//                  with the lowest (key, id), key = the id (stat == null) or stat[slot]; all of
//                  them when there are no more than excess[i]
// Mass is float (what attention kernels return) or double; stat is float32, each addition rounded
// once to float (spans.h accumulate), row after row (a slot several rows hold, in a shared block,
// gets each one's mass in batch order).
// shared_of (optional): tokens in blocks that table holds as shared are observed but no
// candidates (prefix caching protects them; the caller's bounds keep them on top of the budget).
// threads > 1: the rows split into up to that many ranges of about equal slots (at least 64Ki
// each), each scanned on its own thread; the same result as one thread (rows hold disjoint slots
// without shared blocks; with shared_of, one thread, so a shared slot sums in row order).
template <typename Mass>
Selection select_lowest(const SlotLayout& layout, const int64_t* rows, int64_t batch, const int64_t* kv_len,
                        const int64_t* lo, const int64_t* hi, const int64_t* excess, float* stat,
                        const Mass* mass, int64_t mass_stride, const TokenTable* shared_of = nullptr,
                        int64_t threads = 1);

// The id-scored decision (StreamingLLM, sliding window: the key is the logical id) from the token
// table's own liveness instead of the slot layout: for request req_ids[i], the excess[i] lowest
// live ids in [lo[i], hi[i]) (all of them when there are fewer), ascending, as (batch index,
// physical position) pairs. The same victims as select_lowest with no statistic, in time
// proportional to the ids walked past (the dead ones below the victims), not to the row's length.
// Called between the step's registration of its new tokens and the table's step: ids from the
// table's num_tokens up to hi are those new tokens, live, right after the table's kv_len (hosts
// share whole blocks only). shared_in (optional): the step's layout and request i's row rows[i];
// tokens in blocks the table holds as shared are then no candidates (prefix caching protects
// them, the caller's bounds keep them on top of the budget: slots.h protected_live), the new
// tokens' blocks read from the layout (a cached prefix joins as new tokens in shared blocks).
// Throws UnknownRequest for an unknown request with tokens to evict (excess > 0; a request within
// its budget is passed over without a look at its table entry).
struct RowsOf {
  const SlotLayout* layout;
  const int64_t* rows;
};
Selection lowest_live_ids(const TokenTable& table, const int64_t* req_ids, int64_t batch, const int64_t* lo,
                          const int64_t* hi, const int64_t* excess, const RowsOf* shared_in = nullptr);

}  // namespace vtoken
