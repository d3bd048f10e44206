// SPDX-License-Identifier: Apache-2.0
#include "select.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace vtoken {

namespace {

struct Candidate {
  double key;
  int64_t id;
  int64_t position;
  bool operator<(const Candidate& o) const { return key != o.key ? key < o.key : id < o.id; }
};

}  // namespace

template <typename Mass>
Selection select_lowest(const SlotLayout& layout, const int64_t* rows, int64_t batch, const int64_t* kv_len,
                        const int64_t* lo, const int64_t* hi, const int64_t* excess, double* stat,
                        const Mass* mass, int64_t mass_stride) {
  Selection out;
  const int64_t tpb = layout.tokens_per_block;
  std::vector<Candidate> pool;
  for (int64_t i = 0; i < batch; ++i) {
    const int32_t* blocks = layout.block_table + rows[i] * layout.block_stride;
    const int64_t length = kv_len[i], want = excess[i], low = lo[i], high = hi[i];
    for (int64_t block = 0; block * tpb < length; ++block) {
      if (blocks[block] < 0 || blocks[block] >= layout.num_blocks) {
        throw std::invalid_argument("select_lowest: block " + std::to_string(blocks[block]) + " of row " +
                                    std::to_string(rows[i]) + " is outside the slot layout");
      }
    }
    const Mass* row_mass = mass != nullptr ? mass + i * mass_stride : nullptr;
    if (want <= 0) {  // nothing to evict: only the observation
      if (row_mass == nullptr) continue;
      for (int64_t p = 0; p < length; ++p) stat[blocks[p / tpb] * tpb + p % tpb] += row_mass[p];
      continue;
    }
    // One pass: accumulate, keep the best candidate (the common case: one victim), and count.
    Candidate best{std::numeric_limits<double>::infinity(), std::numeric_limits<int64_t>::max(), -1};
    int64_t count = 0;
    pool.clear();
    for (int64_t block = 0; block * tpb < length; ++block) {
      const int64_t base = static_cast<int64_t>(blocks[block]) * tpb;
      const int64_t end = std::min(tpb, length - block * tpb);
      for (int64_t o = 0; o < end; ++o) {
        const int64_t slot = base + o, p = block * tpb + o;
        double key = 0;
        if (stat != nullptr) {
          if (row_mass != nullptr) stat[slot] += row_mass[p];
          key = stat[slot];
        }
        const int64_t t = layout.tokens[slot];
        if (t < low || t >= high) continue;  // also -1: low >= 0
        if (stat == nullptr) key = static_cast<double>(t);
        const Candidate c{key, t, p};
        ++count;
        if (want == 1) {
          if (c < best) best = c;
        } else {
          pool.push_back(c);
        }
      }
    }
    if (count == 0) continue;
    if (want == 1) {
      out.rows.push_back(i);
      out.positions.push_back(best.position);
      continue;
    }
    if (count > want) {
      std::nth_element(pool.begin(), pool.begin() + want, pool.end());
      pool.resize(want);
    }
    std::sort(pool.begin(), pool.end(), [](const Candidate& a, const Candidate& b) { return a.id < b.id; });
    for (const Candidate& c : pool) {
      out.rows.push_back(i);
      out.positions.push_back(c.position);
    }
  }
  return out;
}

template Selection select_lowest<float>(const SlotLayout&, const int64_t*, int64_t, const int64_t*, const int64_t*,
                                        const int64_t*, const int64_t*, double*, const float*, int64_t);
template Selection select_lowest<double>(const SlotLayout&, const int64_t*, int64_t, const int64_t*, const int64_t*,
                                         const int64_t*, const int64_t*, double*, const double*, int64_t);

}  // namespace vtoken
