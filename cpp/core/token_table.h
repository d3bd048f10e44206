// SPDX-License-Identifier: Apache-2.0
// The token table and relocation planners in C++17: a mirror of the Python specification
// (trtllm_vtoken/core/token_table.py, core/sequence.py, core/table_queries.py and
// reclaim/planner.py). Same state, same results, same error messages; a hypothesis parity test
// drives both with the same operation sequences.
//
// One request, tokens_per_block B = 4, after a few evictions (L live, . dead, _ empty):
//
//     block_ids  = [7, 2, 9]
//     token_at   = [0 1 2 3 | 4 5 6 7 | 8 _ _ _]   position -> logical id (kNoToken if empty)
//     liveness     L L . L   . L L L   L          live[token_at[p]]
//     kv_len     = 9
//     slot_of[5] = 2 * B + 1                      logical id -> flat slot (block * B + offset)
//
// Not thread-safe: one table per engine, called from one thread at a time.
//
// Errors: every mutation validates all of its input first and throws, changing nothing:
// UnknownRequest (KeyError in Python) for an unknown request, std::invalid_argument (ValueError)
// for everything else. The batch calls apply requests in order: on an error, the requests before
// the failing one stay applied, exactly as a Python loop over the single calls would leave them.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <memory>
#include <vector>

#include "block_holders.h"
#include "chunked_array.h"
#include "flat_index.h"

namespace vtoken {

constexpr int32_t kNoSlot = -1;
constexpr int32_t kNoToken = -1;

struct UnknownRequest : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Sequence {
  std::vector<int64_t> block_ids;
  FlatIndex block_index;  // block id -> index in block_ids
  int64_t num_tokens = 0, kv_len = 0, num_live = 0, version = 0;
  ChunkedArray<int32_t> slot_of;        // [num_tokens]
  ChunkedArray<uint8_t> live;           // [num_tokens]
  ChunkedArray<int32_t> token_at;       // [len(block_ids) * tokens_per_block]
  std::vector<int32_t> live_per_block;  // [len(block_ids)]
  std::vector<int64_t> pending_dead;    // positions evicted since the last relocation

  bool live_at(int64_t pos) const {
    const int32_t t = token_at[pos];
    return t != kNoToken && live[t];
  }
};

// Plan of one request, as reclaim/plan.py's RelocationPlan.
struct Plan {
  int64_t req_id = 0;
  bool dense = true;
  int64_t version = 0;
  std::vector<int64_t> token_ids, src_slots, dst_slots, blocks_to_free;
  int64_t blocks_before = 0;
  int64_t new_kv_len = -1;  // dense: length after the moves; lazy: -1 (Python None)
};

class TokenTable {
 public:
  explicit TokenTable(int64_t tokens_per_block);
  TokenTable(const TokenTable&) = delete;  // owns its sequences; one table per engine
  TokenTable& operator=(const TokenTable&) = delete;

  int64_t tokens_per_block() const { return tpb_; }
  // Block ids lie in [0, max_block_id()): a slot, block * tokens_per_block + offset, is an int32.
  int64_t max_block_id() const { return (int64_t{1} << 31) / tpb_; }
  // Shared blocks (prefix caching): tokens in them can be neither evicted nor moved.
  void set_shared(int64_t block_id, bool shared);
  bool is_shared(int64_t block_id) const { return !shared_.empty() && shared_.count(block_id); }
  // Whether a request holds the block and it is not shared: no further request may take it.
  bool held_unshared(int64_t block_id) const { return holders_.contains(block_id) && !is_shared(block_id); }
  int64_t holders_of(int64_t block_id) const { return holders_.count(block_id); }

  // ---- requests and the contract (token_table.py) ----
  // Request ids lie in [0, 2**63): -2**63 marks the request index's empty entries.
  void add_request(int64_t req_id);
  std::vector<int64_t> remove_request(int64_t req_id);
  // Returns the first new logical id; the new ids are [first, first + total_len - old kv_len).
  int64_t sync_new_tokens(int64_t req_id, const std::vector<int64_t>& block_ids, int64_t total_len);
  // sync_new_tokens(req, current blocks + added, kv_len + num_new) without building the list.
  int64_t append_tokens(int64_t req_id, const int64_t* added, int64_t num_added, int64_t num_new);
  void evict_tokens(int64_t req_id, const std::vector<int64_t>& token_ids);
  void apply_moves(int64_t req_id, const std::vector<int64_t>& token_ids,
                   const std::vector<int64_t>& dst_slots);
  std::vector<int64_t> truncate(int64_t req_id, int64_t new_kv_len);
  void release_blocks(int64_t req_id, const std::vector<int64_t>& block_ids);

  // ---- queries (table_queries.py) ----
  const Sequence& seq(int64_t req_id) const;
  std::vector<int64_t> request_ids() const { return order_; }
  bool contains(int64_t req_id) const { return slot_of_request_.contains(req_id); }
  std::vector<int64_t> hole_positions(int64_t req_id);  // drops stale pending_dead hints
  double metadata_bytes_per_token() const;

  // ---- planning (reclaim/planner.py) ----
  std::optional<Plan> plan_dense(int64_t req_id);
  std::optional<Plan> plan_lazy(int64_t req_id);
  int64_t fragmentation(int64_t req_id) const;
  // Commits a plan whose copy has completed: version check (I4), apply_moves, then truncate
  // (dense) or release_blocks (lazy). Returns the blocks freed.
  std::vector<int64_t> commit(const Plan& plan);

  // The same, for the per-step hot path: plans are written into `out`, whose vectors are reused,
  // and the table's scratch buffers are reused, so a decode step allocates nothing.
  bool plan_dense_into(int64_t req_id, Plan& out);  // false: no plan (plan_dense's nullopt)
  bool plan_lazy_into(int64_t req_id, Plan& out);
  void commit_in_place(const Plan& plan);             // the freed blocks are plan.blocks_to_free
  // The single-hole shortcut (core/single_hole.py, fill_single_hole): dense plan + commit, done
  // straight on the arrays, for a request whose one hole is its one pending eviction. Appends the
  // released blocks to `released`, sets `num_moves` (0 or 1). Returns false, changing nothing,
  // in any other case, for plan_dense_into + commit_in_place to handle.
  bool fill_single_hole(int64_t req_id, int64_t& num_moves, std::vector<int64_t>& released);

 private:
  Sequence& mut(int64_t req_id);
  int64_t append(int64_t req_id, const int64_t* added, int64_t num_added, __int128 num_new);
  int64_t position_of_token(int64_t req_id, const Sequence& s, int64_t token_id) const;
  int64_t writable_position(int64_t req_id, const Sequence& s, int64_t slot) const;
  const std::vector<int64_t>& holes_into(int64_t req_id);  // hole_positions into holes_
  void fill_plan(const Sequence& s, int64_t req_id, bool dense, int64_t new_kv_len, Plan& out) const;
  void check_lazy_commit(const Plan& plan) const;  // planner.cpp
  [[noreturn]] static void fail_plan(int64_t req_id, const std::string& what);

  int64_t tpb_;
  // Scratch buffers reused across calls: no allocation per decode step.
  std::vector<int64_t> scratch_, holes_, src_pos_, dst_pos_, filled_;
  FlatIndex slot_of_request_;                   // request id -> index in seqs_
  std::vector<std::unique_ptr<Sequence>> seqs_;  // null where a removed request was
  std::vector<int64_t> free_seq_slots_;
  std::vector<int64_t> order_;  // insertion order, as a Python dict
  std::unordered_set<int64_t> shared_;
  BlockHolders holders_;  // block id -> requests holding it
};

// Python's repr of a list of ints, for error messages identical to the specification's.
std::string repr(const std::vector<int64_t>& values);

// A set of ids for membership tests, viewing a caller's array (which must outlive it). Decode-step
// sets hold one or two entries, where a linear scan beats hashing (and allocating); large sets hash.
class IdSet {
 public:
  IdSet(const int64_t* data, size_t size) : data_(data), size_(size) {
    if (size_ > kLinear) hashed_.insert(data_, data_ + size_);
  }
  explicit IdSet(const std::vector<int64_t>& values) : IdSet(values.data(), values.size()) {}
  bool count(int64_t id) const {
    if (size_ > kLinear) return hashed_.count(id) != 0;
    for (size_t i = 0; i < size_; ++i) {
      if (data_[i] == id) return true;
    }
    return false;
  }
  size_t distinct() const {
    if (size_ > kLinear) return hashed_.size();
    size_t n = 0;
    for (size_t i = 0; i < size_; ++i) {
      bool seen = false;
      for (size_t j = 0; j < i && !seen; ++j) seen = data_[j] == data_[i];
      n += !seen;
    }
    return n;
  }

 private:
  static constexpr size_t kLinear = 16;
  const int64_t* data_;
  size_t size_;
  std::unordered_set<int64_t> hashed_;
};

}  // namespace vtoken
