// SPDX-License-Identifier: Apache-2.0
// What the token table's source files (token_table.cpp, release.cpp, planner.cpp) share: its
// error form and two small helpers. Not part of the table's interface.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "token_table.h"

namespace vtoken::table_common {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A refused call on one request, in the specification's words: "request N: what".
[[noreturn]] inline void fail(int64_t req_id, const std::string& what) {
  throw std::invalid_argument("request " + std::to_string(req_id) + ": " + what);
}

inline bool has_repeats(const std::vector<int64_t>& values) { return IdSet(values).distinct() != values.size(); }

}  // namespace vtoken::table_common
