// SPDX-License-Identifier: Apache-2.0
// The decode step after its registration, in one call: the batch's decision, the token table's
// step and the batch layout's update (DecodeStep's call with the C++ core, trtllm_vtoken/step/fused.py).
// Mirrors trtllm_vtoken/step/spec.py decode_step, the Python core's call, step by step:
//
//     select_lowest / lowest_live_ids (select.h),   the victims, (batch row, position) pairs
//       or the victims the host decided (kGiven)
//     victims -> slots, logical ids, CSR offsets
//     step_batch (batch.h)                          append, evict, plan, commit
//     apply_step (slots.h)                          evictions, moves, released blocks, lengths
//
// plus what the step's output reports per request: the length lost, the logical length, and
// whether its layout changed. The step parity tests run both cores on the same batches.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "batch.h"
#include "budget.h"
#include "slots.h"

namespace vtoken {

enum class Selector : int64_t {
  kNone = 0,        // nothing over budget and nothing to learn: no victims
  kLowestIds = 1,   // the lowest live ids in [lo, hi) (StreamingLLM, sliding window)
  kLowestStat = 2,  // the lowest per-slot statistic in [lo, hi), after adding the mass (H2O)
  kGiven = 3,       // the victims the host decided (policies decided in Python, several policies)
};

struct Decision {
  Selector selector = Selector::kNone;
  // The policy's bounds rule (budget.h), applied here to the layout's counters after the
  // registration, the live tokens in shared blocks counted when skip_shared. Without mass (a
  // policy that learns nothing this step) a request is a candidate only over its budget,
  // num_live > target(num_tokens), as ScorePolicy.wants_to_evict filters it.
  BoundsRule rule;
  float* stat = nullptr;            // kLowestStat: the score per slot (float32)
  const float* mass32 = nullptr;    // optional, one of the two: [batch, mass_stride] added to stat first
  const double* mass64 = nullptr;
  int64_t mass_stride = 0;
  bool skip_shared = false;  // tokens in shared blocks are no candidates (select.h)
  int64_t threads = 1;       // kLowestStat: threads its pass may split the rows over (select.h)
  // kGiven: [num_given] batch indices, ascending, and each victim's physical position (live,
  // below the row's length; ids ascending per request), read from the layout as it is.
  const int64_t* given_index = nullptr;
  const int64_t* given_positions = nullptr;
  int64_t num_given = 0;
};

struct DecodeResult {
  std::vector<int64_t> victim_offsets;  // [batch + 1] CSR into victim_ids
  std::vector<int64_t> victim_ids;      // each request's ascending
  StepResult table;
  std::vector<int64_t> lost;        // [batch] physical length lost after the new tokens
  std::vector<int64_t> num_tokens;  // [batch] logical lengths
  int64_t num_changed = 0;          // requests that moved tokens, released blocks or got shorter
  std::vector<int64_t> changed;     // [batch] 1 where so
  double decide_seconds = 0.0;      // the decision's pass (select.h), the victims hook excluded
};

// Called with (victim_offsets, victim_ids) after the decision, before the table's step, when
// there are victims (DecodeStep.on_victims: prefix caching ends the chains there).
using VictimsHook = std::function<void(const std::vector<int64_t>&, const std::vector<int64_t>&)>;

// Request i is req_ids[i] at layout row rows[i], whose new blocks and tokens the registration
// call (register_new) wrote into the layout; the table has not seen them yet. Throws what the
// calls it makes throw (the hook's throw before the table changed); a throw from the table's step
// leaves the step half done (the caller then refuses further steps, as for the Python core).
// kLazyDeferred (background compaction): the table plans the requests may_plan allows (nullptr:
// all) and commits nothing; the layout takes the evictions and lengths only, and the result's
// moves and released blocks are the plans, which the caller copies and commits later
// (step/background.py); lost, changed and num_changed then describe the plans, not a commit.
DecodeResult decide_and_step(SlotArrays& a, TokenTable& table, const int64_t* req_ids, const int64_t* rows,
                             int64_t batch, const int64_t* num_new, const int64_t* new_block_offsets,
                             const int64_t* new_blocks, const Decision& decision, Compaction mode,
                             int64_t fragmentation_threshold, bool pressure, const uint8_t* may_plan = nullptr,
                             const VictimsHook& on_victims = {});

}  // namespace vtoken
