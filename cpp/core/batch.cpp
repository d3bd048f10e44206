// SPDX-License-Identifier: Apache-2.0
#include "batch.h"

#include <atomic>
#include <chrono>
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

namespace vtoken {

namespace {

// A cycle count for the compaction's per-request marks, not ordered against the loads around it:
// an ordered clock (steady_clock's vDSO read waits for every earlier instruction) stalls the
// loop's overlapping cache misses at each mark (dense StreamingLLM's step alone took ~1.4x at
// batch 256, caches flushed). Converted to seconds against steady_clock over the whole call.
inline uint64_t ticks() {
#if defined(__x86_64__) || defined(__i386__)
  return __rdtsc();
#else
  return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
#endif
}

// The blocks naive-evict frees: unshared, holding positions below kv_len, no live token (as
// reclaim/dead_blocks.py's fully_dead_blocks), in list order.
void fully_dead_blocks(const TokenTable& table, const Sequence& s, std::vector<int64_t>& out) {
  out.clear();
  const int64_t tpb = table.tokens_per_block();
  for (size_t i = 0; i < s.block_ids.size(); ++i) {
    if (s.live_per_block[i] == 0 && static_cast<int64_t>(i) * tpb < s.kv_len && !table.is_shared(s.block_ids[i])) {
      out.push_back(s.block_ids[i]);
    }
  }
}

std::atomic<bool> compaction_timed{false};

// The loop, with the compaction's per-request marks (kTimed) or without them: the untimed loop
// carries no timing code at all.
template <bool kTimed>
StepResult step_batch_loop(TokenTable& table, const int64_t* req_ids, int64_t batch, const int64_t* num_new,
                           const int64_t* new_block_offsets, const int64_t* new_blocks,
                           const int64_t* evict_offsets, const int64_t* evict_ids, Compaction mode,
                           int64_t fragmentation_threshold, bool pressure, const uint8_t* may_plan) {
  const auto call_began = kTimed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  const uint64_t call_began_ticks = kTimed ? ticks() : 0;
  uint64_t plan_ticks = 0, commit_ticks = 0;
  StepResult out;
  out.move_offsets.reserve(batch + 1);
  out.move_offsets.push_back(0);
  out.freed_offsets.reserve(batch + 1);
  out.freed_offsets.push_back(0);
  out.kv_lens.reserve(batch);
  std::vector<int64_t> dead;
  std::vector<int64_t> victims;
  Plan plan;  // reused: its vectors keep their capacity from request to request
  // A large batch's state exceeds the caches, and evictions hit random tokens. Each request's
  // cache lines are requested in stages a few requests ahead, each stage reading only lines an
  // earlier stage loaded, so the misses of several requests overlap instead of queueing (a C++-only
  // driver: ~5% off the dense step, ~10% off the lazy one, on the 2-core VM):
  //   12 ahead  the Sequence object
  //    8 ahead  the victims' slot_of / live entries and the tails that append and plan touch
  //    4 ahead  the block-index line of each victim's block
  //    2 ahead  the victim's token_at entry and its block's live count
  const int64_t tpb = table.tokens_per_block();
  auto seq_at = [&](int64_t i) -> const Sequence* {
    return i < batch && table.contains(req_ids[i]) ? &table.seq(req_ids[i]) : nullptr;
  };
  auto for_victims = [&](int64_t i, const Sequence& s, auto&& visit) {
    for (int64_t k = evict_offsets[i]; k < evict_offsets[i + 1] && k < evict_offsets[i] + 4; ++k) {
      const int64_t t = evict_ids[k];
      if (t >= 0 && t < static_cast<int64_t>(s.slot_of.size())) visit(t);
    }
  };
  auto stage = [&](int64_t i, int which) {
    const Sequence* s = seq_at(i);
    if (s == nullptr) return;
    if (which == 0) {
      __builtin_prefetch(s);
      __builtin_prefetch(reinterpret_cast<const char*>(s) + 64);
      __builtin_prefetch(reinterpret_cast<const char*>(s) + 128);
    } else if (which == 1) {
      for_victims(i, *s, [&](int64_t t) {
        __builtin_prefetch(&s->slot_of[t]);
        __builtin_prefetch(&s->live[t]);
      });
      if (!s->slot_of.empty()) __builtin_prefetch(&s->slot_of.back());
      if (!s->live.empty()) __builtin_prefetch(&s->live.back());
      if (s->kv_len > 0) __builtin_prefetch(&s->token_at[s->kv_len - 1]);
      if (!s->block_ids.empty()) __builtin_prefetch(&s->block_ids.back());
      if (!s->live_per_block.empty()) __builtin_prefetch(&s->live_per_block.back());
      if (!s->pending_dead.empty()) __builtin_prefetch(s->pending_dead.data());
    } else if (which == 2) {
      for_victims(i, *s, [&](int64_t t) {
        if (s->slot_of[t] >= 0) s->block_index.prefetch(s->slot_of[t] / tpb);
      });
    } else {
      for_victims(i, *s, [&](int64_t t) {
        const int64_t slot = s->slot_of[t];
        const int64_t index = slot >= 0 ? s->block_index.find(slot / tpb) : FlatIndex::kAbsent;
        if (index == FlatIndex::kAbsent) return;
        __builtin_prefetch(&s->token_at[index * tpb + slot % tpb]);
        __builtin_prefetch(&s->live_per_block[index]);
      });
    }
  };
  constexpr int64_t kAhead[4] = {12, 8, 4, 2};
  for (int which = 0; which < 4; ++which) {
    for (int64_t i = 0; i < kAhead[which]; ++i) stage(i, which);
  }
  for (int64_t i = 0; i < batch; ++i) {
    for (int which = 0; which < 4; ++which) stage(i + kAhead[which], which);
    const int64_t req = req_ids[i];
    table.append_tokens(req, new_blocks + new_block_offsets[i], new_block_offsets[i + 1] - new_block_offsets[i],
                        num_new[i]);
    victims.assign(evict_ids + evict_offsets[i], evict_ids + evict_offsets[i + 1]);
    table.evict_tokens(req, victims);
    // The compaction, timed where the request has holes (StepResult's plan / commit seconds).
    const Sequence& s = table.seq(req);
    const bool timed = kTimed && !s.pending_dead.empty();
    const uint64_t began = timed ? ticks() : 0;
    uint64_t planned_at = began;
    bool planned = false;
    if (mode == Compaction::kDense) {
      // The single-hole shortcut commits on its own; its one possible move is the last token
      // into the hole, read before it runs. Otherwise plan, then commit below.
      int64_t token = -1, src = -1, dst = -1;
      if (s.pending_dead.size() == 1 && s.kv_len > 0) {
        const int64_t last = s.kv_len - 1, hole = s.pending_dead[0];
        if (hole < last) {
          token = s.token_at[last];
          src = s.block_ids[last / tpb] * tpb + last % tpb;
          dst = s.block_ids[hole / tpb] * tpb + hole % tpb;
        }
      }
      int64_t moved = 0;
      if (timed) planned_at = ticks();
      if (table.fill_single_hole(req, moved, out.freed)) {
        if (moved) {
          out.move_tokens.push_back(token);
          out.move_src.push_back(src);
          out.move_dst.push_back(dst);
        }
      } else {
        planned = table.plan_dense_into(req, plan);
        if (timed) planned_at = ticks();
      }
    } else if (mode == Compaction::kLazy || mode == Compaction::kLazyDeferred) {
      if ((may_plan == nullptr || may_plan[i]) && (pressure || table.fragmentation(req) >= fragmentation_threshold)) {
        planned = table.plan_lazy_into(req, plan);
      }
      if (timed) planned_at = ticks();
    } else {
      fully_dead_blocks(table, s, dead);
      if (timed) planned_at = ticks();
      if (!dead.empty()) {
        table.release_blocks(req, dead);
        out.freed.insert(out.freed.end(), dead.begin(), dead.end());
      }
    }
    if (planned) {
      if (mode != Compaction::kLazyDeferred) table.commit_in_place(plan);
      out.move_tokens.insert(out.move_tokens.end(), plan.token_ids.begin(), plan.token_ids.end());
      out.move_src.insert(out.move_src.end(), plan.src_slots.begin(), plan.src_slots.end());
      out.move_dst.insert(out.move_dst.end(), plan.dst_slots.begin(), plan.dst_slots.end());
      out.freed.insert(out.freed.end(), plan.blocks_to_free.begin(), plan.blocks_to_free.end());
    }
    if (timed) {
      const uint64_t ended = ticks();
      plan_ticks += planned_at - began;
      commit_ticks += ended - planned_at;
    }
    out.move_offsets.push_back(static_cast<int64_t>(out.move_tokens.size()));
    out.freed_offsets.push_back(static_cast<int64_t>(out.freed.size()));
    out.kv_lens.push_back(table.seq(req).kv_len);
  }
  if constexpr (kTimed) {
    const uint64_t call_ticks = ticks() - call_began_ticks;
    if (call_ticks > 0 && plan_ticks + commit_ticks > 0) {
      const double per_tick =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - call_began).count() / call_ticks;
      out.plan_seconds = plan_ticks * per_tick;
      out.commit_seconds = commit_ticks * per_tick;
    }
  }
  return out;
}

}  // namespace

void set_compaction_timed(bool on) { compaction_timed.store(on, std::memory_order_relaxed); }

bool compaction_is_timed() { return compaction_timed.load(std::memory_order_relaxed); }

StepResult step_batch(TokenTable& table, const int64_t* req_ids, int64_t batch, const int64_t* num_new,
                      const int64_t* new_block_offsets, const int64_t* new_blocks,
                      const int64_t* evict_offsets, const int64_t* evict_ids, Compaction mode,
                      int64_t fragmentation_threshold, bool pressure, const uint8_t* may_plan) {
  auto loop = compaction_is_timed() ? step_batch_loop<true> : step_batch_loop<false>;
  return loop(table, req_ids, batch, num_new, new_block_offsets, new_blocks, evict_offsets, evict_ids, mode,
              fragmentation_threshold, pressure, may_plan);
}

}  // namespace vtoken
