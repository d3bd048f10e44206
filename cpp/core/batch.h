// SPDX-License-Identifier: Apache-2.0
// The per-step hot path for a whole batch in one call (what a decode step pays on the host).
#pragma once

#include <cstdint>
#include <vector>

#include "token_table.h"

namespace vtoken {

// What a step does after the evictions (reclaim/step_batch.py, COMPACTIONS).
enum class Compaction : int64_t {
  kDense = 0,       // fill every hole below the new length, release the tail (plan_dense)
  kLazy = 1,        // past the fragmentation threshold or under pressure: empty blocks (plan_lazy)
  kDeadBlocks = 2,  // no relocation: release blocks in which every token is dead (naive-evict)
  kLazyDeferred = 3,  // plan as kLazy, commit nothing: the caller copies in the background and
                      // commits each plan later (TokenTable::commit, which accepts a lazy plan
                      // whose sources still hold its tokens)
};

// Per request i of the batch, in order, exactly as this Python loop (the specification,
// reclaim/step_batch.py):
//
//     table.append_tokens(req, new_blocks[i], num_new[i])
//     table.evict_tokens(req, evict_ids[i])
//     dense:        plan = plan_dense(req)
//     lazy:         plan = plan_lazy(req) if pressure or fragmentation(req) >= threshold else None
//     if plan: commit it (apply_moves, then truncate / release_blocks)
//     dead blocks:  table.release_blocks(req, fully_dead_blocks(req))
//     lazy deferred: as lazy, but the plan is returned, not committed (its moves and blocks_to_free
//                   in the result; kv_lens unchanged); requests with may_plan[i] == 0 are not planned
//
// Dense requests whose one hole is their one eviction (most of a decode step) take
// TokenTable::fill_single_hole, which leaves the table exactly as plan_dense + commit would.
// new_blocks and evict_ids come as CSR arrays: request i's entries are
// values[offsets[i]:offsets[i + 1]]. Metadata only: every relocation is committed in the table
// at once and returned, so that the caller copies the KV of all of them in one copy (before the
// next attention reads it, I3) and frees `freed` in its block pool.
struct StepResult {
  std::vector<int64_t> move_offsets;  // [batch + 1] CSR into move_tokens / move_src / move_dst
  std::vector<int64_t> move_tokens;   // logical id of each moved token
  std::vector<int64_t> move_src;      // its flat slot before the move (block * tpb + offset)
  std::vector<int64_t> move_dst;      // its flat slot after
  std::vector<int64_t> freed_offsets;  // [batch + 1] CSR into freed
  std::vector<int64_t> freed;          // block ids released, request by request
  std::vector<int64_t> kv_lens;        // [batch] physical length after the step
  // Where the compaction's time went, summed over the requests that had holes to compact, while
  // set_compaction_timed(true) (else 0: the marks cost the loop ~10-15% in the step alone, and
  // hole-free requests are never timed):
  //   plan    plan_dense / plan_lazy (and the single-hole check), naive-evict's dead-block search
  //   commit  what follows the plan: commit_in_place, fill_single_hole (it plans and commits one
  //           hole in one operation), naive-evict's block release, the plan's moves appended to
  //           the result (all that lazy-deferred does after planning)
  double plan_seconds = 0.0, commit_seconds = 0.0;
};

// Process-wide: whether step_batch times its compaction (StepResult's plan / commit seconds), a
// diagnostic for benchmarks (off by default; a loop without the marks runs otherwise).
void set_compaction_timed(bool on);
bool compaction_is_timed();

StepResult step_batch(TokenTable& table, const int64_t* req_ids, int64_t batch, const int64_t* num_new,
                      const int64_t* new_block_offsets, const int64_t* new_blocks,
                      const int64_t* evict_offsets, const int64_t* evict_ids, Compaction mode,
                      int64_t fragmentation_threshold, bool pressure, const uint8_t* may_plan = nullptr);

}  // namespace vtoken
