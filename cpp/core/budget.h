// SPDX-License-Identifier: Apache-2.0
// A score policy's budget and candidate bounds, for the fused decode call (decode_step.h), which
// then decides from the layout's counters after the registration instead of taking bounds computed
// in numpy. Mirrors trtllm_vtoken/policies/budget.py (Budget.targets) and ScorePolicy.candidate_bounds
// (policies/base.py) with H2O's recent share (policies/h2o.py recent_tokens_batch): the same double
// arithmetic, so the same integers (tests/step/test_bounds_rule.py holds both to it).
//
//     room    = target(num_tokens - protected)            unprotected tokens kept (given up `unit` at a time)
//     n_sink  = min(rule.n_sink, room)
//     recent  = min(max(recent_window, int(room * recent_ratio)), room - n_sink)
//     excess  = num_live - protected - room               (<= 0: nothing to evict)
//     lo, hi  = n_sink, num_tokens - recent               candidates: live ids in [lo, hi)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace vtoken {

struct BoundsRule {
  int64_t tokens = -1;        // a count budget (>= 0), or -1: the budget is `ratio`
  double ratio = 1.0;         // the kept fraction of the length, in (0, 1], when tokens < 0
  int64_t n_sink = 0;         // the first ids, never candidates (shrunk to the room)
  int64_t recent_window = 0;  // the newest ids, never candidates (shrunk so the budget can be met)
  double recent_ratio = 0.0;  // H2O: the newest int(room * recent_ratio) ids at least (0: none)
  int64_t unit = 1;           // tokens are given up in multiples of this many (Budget.unit)
};

// The Python Budget and policy checks, in one: tokens >= 0 (or -1 and a ratio in (0, 1]), n_sink and
// recent_window >= 0, recent_ratio in [0, 1], unit >= 1.
inline bool valid(const BoundsRule& r) {
  return r.tokens >= -1 && (r.tokens >= 0 || (r.ratio > 0.0 && r.ratio <= 1.0)) && r.n_sink >= 0 &&
         r.recent_window >= 0 && r.recent_ratio >= 0.0 && r.recent_ratio <= 1.0 && r.unit >= 1;
}

// Budget.target: live tokens allowed for a request of num_tokens logical tokens. With unit u > 1
// the tokens lost are a multiple of u: n - u * min(ceil((n - plain) / u), n / u).
inline int64_t budget_target(const BoundsRule& rule, int64_t num_tokens) {
  int64_t plain = num_tokens;
  if (rule.tokens >= 0) {
    plain = std::min(rule.tokens, num_tokens);
  } else if (rule.ratio < 1.0) {
    plain = std::min(num_tokens, static_cast<int64_t>(std::ceil(rule.ratio * static_cast<double>(num_tokens))));
  }
  if (rule.unit == 1) return plain;
  const int64_t lost_units = std::min((num_tokens - plain + rule.unit - 1) / rule.unit, num_tokens / rule.unit);
  return num_tokens - rule.unit * lost_units;
}

struct Bounds {
  int64_t excess, lo, hi;
};

inline Bounds candidate_bounds(const BoundsRule& rule, int64_t num_tokens, int64_t num_live, int64_t protected_live) {
  const int64_t room = budget_target(rule, num_tokens - protected_live);
  const int64_t n_sink = std::min(rule.n_sink, room);
  const auto share = static_cast<int64_t>(static_cast<double>(room) * rule.recent_ratio);
  const int64_t recent = std::min(std::max(rule.recent_window, share), room - n_sink);
  return Bounds{num_live - protected_live - room, n_sink, num_tokens - recent};
}

}  // namespace vtoken
