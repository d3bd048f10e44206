// SPDX-License-Identifier: Apache-2.0
// The common decode step after its registration call, in one call: the batch's decision, the
// token table's step and the batch layout's update (DecodeStep.run's steps 2 and 3 for a batch one
// natively decided policy serves; trtllm_vtoken/step/fused.py says when). The same effects, in the
// same order, as the four calls the general path makes:
//
//     select_lowest / lowest_live_ids (select.h)   the victims, (batch row, position) pairs
//     victims -> slots, logical ids, CSR offsets    what DecodeStep.run computes in numpy
//     step_batch (batch.h)                          append, evict, plan, commit
//     apply_step (slots.h)                          evictions, moves, released blocks, lengths
//
// plus what the step's output reports per request: the length lost, the logical length, and
// whether its layout changed. The step parity test runs both paths on the same batches.
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
// leaves the step half done (the caller then refuses further steps, as for the general path).
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
