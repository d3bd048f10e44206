// SPDX-License-Identifier: Apache-2.0
// The step's batch layout updates (trtllm_vtoken/step/slots.py, the specification), for the C++
// core's step: the new blocks and tokens of a batch before the decision, and the evictions, moves
// and released blocks after the table's step, each in one call over the layout's own arrays (numpy
// buffers the Python SlotMap owns; nothing is copied). Same effects as SlotMap.append_blocks +
// register and evict + move + set_rows; the step parity test compares both cores' layouts.
//
//     tokens       int32 [slots]            slot -> live logical id, -1 if none
//     stats        [slots] each             per-slot statistics (any element size), zeroed on write
//     block_table  int32 [rows, stride]     block ids row by row, padded with the scratch block
//     counters     int64 [rows] each        num_blocks_of, kv_len, num_tokens, num_live
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "token_table.h"

namespace vtoken {

struct SlotStat {
  uint8_t* data;
  int64_t item_size;  // bytes per slot
};

struct SlotArrays {
  int32_t* tokens;
  int32_t* block_table;
  int64_t block_stride;  // columns of the block table (the caller grows it before a call needs more)
  int64_t tokens_per_block;
  int32_t scratch;  // the padding block id
  int64_t *num_blocks_of, *kv_len, *num_tokens, *num_live;
  std::vector<SlotStat> stats;
};

// The step's checks of a batch's new blocks and tokens (InputChecks.check_new, step/iteration.py, the
// specification; same order, same words): "" when they fit, else what is wrong. Reads only.
// Request i is req_ids[i] at row rows[i]; offsets has one entry per request and one more (the
// caller checked the sizes); new block ids lie in [0, num_blocks); a block may be given twice only
// if the table holds it as shared.
std::string check_new(const SlotArrays& a, const int64_t* req_ids, const int64_t* rows, int64_t batch,
                      int64_t num_rows, const int64_t* offsets, const int64_t* blocks, int64_t num_given,
                      const int64_t* num_new, int64_t num_blocks, const TokenTable& table);

// SlotMap.append_blocks + SlotMap.register: row rows[i] takes blocks[offsets[i]:offsets[i + 1]]
// and then num_new[i] new tokens (the next logical ids) at positions [kv_len, kv_len + num_new).
// Returns the new tokens' slots, row by row. The caller has checked that they fit.
std::vector<int64_t> register_new(SlotArrays& a, const int64_t* rows, int64_t batch, const int64_t* offsets,
                                  const int64_t* blocks, const int64_t* num_new);

// SlotMap.evict + move + set_rows after the table's step: victims (victim_rows[k], its slot) die;
// moves carry ids and statistics from move_src to move_dst (disjoint sets); kv_len[rows[i]] =
// kv_lens[i]; a row that released blocks (freed_offsets) drops its tail (tail_only, dense mode) or
// is rebuilt from the table's block list of req_ids[i].
void apply_step(SlotArrays& a, const int64_t* victim_rows, const int64_t* victim_slots, int64_t num_victims,
                const int64_t* move_src, const int64_t* move_dst, int64_t num_moves, const int64_t* rows,
                const int64_t* req_ids, int64_t batch, const int64_t* kv_lens, const int64_t* freed_offsets,
                bool tail_only, const TokenTable& table);

// Per request i (row rows[i]): its live tokens in blocks the table holds as shared, read from the
// layout (this step's new tokens included): what a policy keeps on top of its budget
// (ScorePolicy.candidate_bounds' protected_live; the Python path's protected mask, counted).
std::vector<int64_t> protected_live(const SlotArrays& a, const int64_t* rows, int64_t batch, const TokenTable& table);

}  // namespace vtoken
