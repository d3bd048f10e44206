// SPDX-License-Identifier: Apache-2.0
// How many requests of a token table hold each block (trtllm_vtoken/core/block_holders.py, the
// specification): a block in one request's list joins another only if it is shared (prefix
// caching); given unshared, both requests would write their KV into its slots. One FlatIndex
// update per block that joins or leaves a list.
#pragma once

#include <cstdint>
#include <stdexcept>

#include "flat_index.h"

namespace vtoken {

class BlockHolders {
 public:
  bool contains(int64_t block_id) const { return count_.contains(block_id); }
  int64_t count(int64_t block_id) const {
    const int64_t n = count_.find(block_id);
    return n == FlatIndex::kAbsent ? 0 : n;
  }
  // The blocks joined one request's list.
  void hold(const int64_t* block_ids, int64_t n) {
    for (int64_t k = 0; k < n; ++k) count_.insert(block_ids[k], count(block_ids[k]) + 1);
  }
  // The blocks left one request's list (each held before: the table's own bookkeeping).
  void let_go(const int64_t* block_ids, int64_t n) {
    for (int64_t k = 0; k < n; ++k) {
      const int64_t left = count(block_ids[k]) - 1;
      if (left < 0) throw std::logic_error("BlockHolders: a block left a list it was not in");
      if (left) {
        count_.insert(block_ids[k], left);
      } else {
        count_.erase(block_ids[k]);
      }
    }
  }

 private:
  FlatIndex count_;  // block id -> holders (absent: none)
};

}  // namespace vtoken
