// SPDX-License-Identifier: Apache-2.0
// The per-step hot path for a whole batch in one call (what a decode step pays on the host).
#pragma once

#include <cstdint>
#include <vector>

#include "token_table.h"

namespace vtoken {

// Per request i of the batch, in order, exactly as this Python loop (the specification):
//
//     table.sync_new_tokens(req, table.block_ids(req) + new_blocks[i], table.kv_len(req) + num_new[i])
//     table.evict_tokens(req, evict_ids[i])
//     plan = plan_dense(req)                                          # dense
//     plan = plan_lazy(req) if pressure or fragmentation(req) >= threshold else None   # lazy
//     if plan: commit it (apply_moves, then truncate / release_blocks)
//
// Dense requests whose one hole is their one eviction (most of a decode step) take
// TokenTable::fill_single_hole, which leaves the table exactly as plan_dense + commit would.
// new_blocks and evict_ids come as CSR arrays: request i's entries are
// values[offsets[i]:offsets[i + 1]]. Metadata only: the caller copies KV for plans it needs
// copied (use the single calls for that) and frees `freed` in its block pool.
struct StepResult {
  std::vector<int64_t> moves;          // [batch] tokens relocated per request
  std::vector<int64_t> freed_offsets;  // [batch + 1] CSR into freed
  std::vector<int64_t> freed;          // block ids released, request by request
};

StepResult step_batch(TokenTable& table, const int64_t* req_ids, int64_t batch, const int64_t* num_new,
                      const int64_t* new_block_offsets, const int64_t* new_blocks,
                      const int64_t* evict_offsets, const int64_t* evict_ids, bool dense,
                      int64_t fragmentation_threshold, bool pressure);

}  // namespace vtoken
