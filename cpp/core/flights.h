// SPDX-License-Identifier: Apache-2.0
// Lazy plans whose copies run in the background (trtllm_vtoken/step/background.py, the
// specification; the step's C++ core keeps them here so that a step records, commits and applies
// them in one call each instead of one Python record per plan):
//
//   step N     a lazy-deferred table step plans; record() keeps each planning request's plan,
//              tagged with the copy (submission) that carries all of them
//   step N+k   commit_ready(): for the batch's requests whose plan's copy has finished (its
//              submission is among `ready`), the plan commits in the table (TokenTable::commit
//              accepts a lazy plan whose tokens still sit at its sources), then the slot layout
//              takes every committed move and released block at once (apply_step)
//
// A request has one plan in flight at most (may_plan says who may plan).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "batch.h"
#include "slots.h"
#include "token_table.h"

namespace vtoken {

struct Flight {
  std::vector<int64_t> tokens, src, dst, blocks;  // the plan: moves (token, source, destination), blocks to release
  int64_t submission;
};

class LazyFlights {
 public:
  // [batch] 1 where req_ids[i] has no plan in flight.
  std::vector<uint8_t> may_plan(const int64_t* req_ids, int64_t batch) const;
  // Keeps the plan of every row of `plans` (request req_ids[i]) that moves tokens or releases
  // blocks, under `submission`; returns the batch indices recorded. invalid_argument, nothing
  // kept, if such a request has a plan in flight already.
  std::vector<int64_t> record(const int64_t* req_ids, int64_t batch, const StepResult& plans, int64_t submission);
  // Commits the plans of the batch's requests whose submission is in `ready` (batch order), in
  // the table, then in the layout: kv_len of every row set to its request's length, committed rows
  // rebuilt from the table's block lists. Returns what committed, row by row, with `committed`
  // (the batch indices). A plan that no longer applies: runtime_error naming the request (the
  // plans before it have committed in the table, the layout has not: the step is unusable).
  StepResult commit_ready(TokenTable& table, SlotArrays& a, const int64_t* req_ids, const int64_t* rows, int64_t batch,
                          const std::vector<int64_t>& ready, std::vector<int64_t>& committed);
  // Forgets the request's plan; returns its submission, -1 if it had none.
  int64_t drop(int64_t req_id);
  const Flight* find(int64_t req_id) const;
  std::vector<int64_t> requests() const;     // ascending
  std::vector<int64_t> submissions() const;  // those a plan in flight still belongs to, ascending
  size_t size() const { return flights_.size(); }

 private:
  std::unordered_map<int64_t, Flight> flights_;
};

}  // namespace vtoken
