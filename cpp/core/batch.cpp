// SPDX-License-Identifier: Apache-2.0
#include "batch.h"

namespace vtoken {

StepResult step_batch(TokenTable& table, const int64_t* req_ids, int64_t batch, const int64_t* num_new,
                      const int64_t* new_block_offsets, const int64_t* new_blocks,
                      const int64_t* evict_offsets, const int64_t* evict_ids, bool dense,
                      int64_t fragmentation_threshold, bool pressure) {
  StepResult out;
  out.moves.reserve(batch);
  out.freed_offsets.reserve(batch + 1);
  out.freed_offsets.push_back(0);
  std::vector<int64_t> victims;
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t req = req_ids[i];
    table.append_tokens(req, new_blocks + new_block_offsets[i], new_block_offsets[i + 1] - new_block_offsets[i],
                        num_new[i]);
    victims.assign(evict_ids + evict_offsets[i], evict_ids + evict_offsets[i + 1]);
    table.evict_tokens(req, victims);
    std::optional<Plan> plan;
    if (dense) {
      plan = table.plan_dense(req);
    } else if (pressure || table.fragmentation(req) >= fragmentation_threshold) {
      plan = table.plan_lazy(req);
    }
    int64_t moves = 0;
    if (plan) {
      moves = static_cast<int64_t>(plan->token_ids.size());
      const std::vector<int64_t> freed = table.commit(*plan);
      out.freed.insert(out.freed.end(), freed.begin(), freed.end());
    }
    out.moves.push_back(moves);
    out.freed_offsets.push_back(static_cast<int64_t>(out.freed.size()));
  }
  return out;
}

}  // namespace vtoken
