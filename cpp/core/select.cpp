// SPDX-License-Identifier: Apache-2.0
#include "select.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>

#include "spans.h"

namespace vtoken {

namespace {

using namespace spans;

// A span whose candidates' minimum key reached the row's running minimum (kSingle's exact scan).
struct Span {
  double minimum;
  int64_t base;   // its first slot
  int64_t start;  // its first position in the row
  int64_t n;      // slots
};

// Keys order as numpy sorts them (the Python specification's lexsort): -inf, the numbers, +inf,
// then NaN (a mass a model's overflow made NaN keeps its token longest); equal keys, or two NaN,
// by the lower id. A strict weak order even with NaN, as std::nth_element requires.
struct Candidate {
  double key;
  int64_t id;
  int64_t position;
  bool operator<(const Candidate& o) const {
    const bool nan = std::isnan(key), other_nan = std::isnan(o.key);
    if (nan || other_nan) return nan == other_nan ? id < o.id : other_nan;
    return key != o.key ? key < o.key : id < o.id;
  }
};

// One row: accumulate the mass (kMass), then find the victims among [low, high). kStat: the key is
// the statistic, else the id. kSingle: one victim (the decode step); else every candidate is
// collected for an exact partial sort. Specialised so the loops carry no branch on what is constant
// for the row.
//
// A row's positions lie block by block anywhere in the pool, tokens_per_block contiguous slots
// each; blocks whose ids follow one another form a span of contiguous slots (a fresh pool hands a
// request its blocks in order), up to kSpanBlocks blocks, a shared block a span alone (its
// protection is its own; spans.h span_end):
//
//   span   [ stat += mass, and the minimum key of its candidates  (one vectorised loop) ]
//          -> kept if that minimum reaches the row's running minimum
//   row    the exact scan of the kept spans whose minimum is the row's: the lowest id of that key
//
// The exact scan is what decides; the span minima only skip spans that cannot hold the victim, so
// ties (equal keys, lowest id first) resolve exactly as in the one-pass form. kSingle only; else
// every candidate joins `pool`.
template <bool kStat, bool kMass, bool kSingle, typename Mass>
int64_t scan_row(const SlotLayout& layout, const int32_t* blocks, int64_t length, int64_t low, int64_t high,
                 float* stat, const Mass* row_mass, const TokenTable* shared_of, Candidate& best,
                 std::vector<Candidate>& pool, std::vector<Span>& spans) {
  const int64_t tpb = layout.tokens_per_block;
  const int64_t num_blocks = (length + tpb - 1) / tpb;
  spans.clear();
  const auto width = static_cast<uint32_t>(high - low);
  const auto low32 = static_cast<int32_t>(low);
  int64_t count = 0, prefetched = 0;
  for (int64_t block = 0, next; block < num_blocks; block = next) {
    next = span_end(blocks, block, num_blocks, kSpanBlocks, shared_of);
    prefetched = prefetch_jumps(layout, blocks, std::max(prefetched, block + kAhead),
                                std::min(next + kAhead, num_blocks), kStat ? stat : nullptr);
    const int64_t base = static_cast<int64_t>(blocks[block]) * tpb;
    const int64_t start = block * tpb, n = std::min(next * tpb, length) - start;
    const int32_t* tokens = layout.tokens + base;
    float* values = kStat ? stat + base : nullptr;
    const Mass* m = kMass ? row_mass + start : nullptr;
    if (shared_of != nullptr && shared_of->is_shared(blocks[block])) {  // protected: observed only
      if (kMass) add_mass(values, m, n);
      continue;
    }
    if (kSingle) {
      int64_t candidates = 0;
      const double minimum = span_minimum<kStat, kMass, Mass>(values, m, tokens, low32, width, n, &candidates);
      count += candidates;
      if (candidates == 0 || minimum > best.key) continue;
      best.key = minimum;
      spans.push_back(Span{minimum, base, start, n});
    } else {
      if (kMass) add_mass(values, m, n);
      for (int64_t o = 0; o < n; ++o) {
        const int64_t t = tokens[o];
        if (static_cast<uint32_t>(tokens[o] - low32) >= width) continue;
        ++count;
        pool.push_back(Candidate{kStat ? values[o] : static_cast<double>(t), t, start + o});
      }
    }
  }
  // kSingle: the victim is the candidate of the lowest id among those whose key is the row's
  // minimum (best.key); only spans that reached it (once or more, as the running minimum fell)
  // hold one. Where none does, every candidate's key is NaN (span_minimum leaves NaN out, so the
  // minimum stayed +inf and every span holding a candidate was kept): the lowest id among them.
  const double minimum = best.key;
  best.id = std::numeric_limits<int64_t>::max();
  auto lowest_id_where = [&](auto matches) {
    for (const Span& span : spans) {
      if (span.minimum != minimum) continue;
      const int32_t* tokens = layout.tokens + span.base;
      for (int64_t o = 0; o < span.n; ++o) {
        const int64_t t = tokens[o];
        if (static_cast<uint32_t>(tokens[o] - low32) >= width || t >= best.id) continue;
        const double key = kStat ? stat[span.base + o] : static_cast<double>(t);
        if (matches(key)) best = Candidate{key, t, span.start + o};
      }
    }
  };
  lowest_id_where([minimum](double key) { return key == minimum; });
  if (kSingle && kStat && count > 0 && best.id == std::numeric_limits<int64_t>::max()) {
    lowest_id_where([](double key) { return std::isnan(key); });
  }
  return count;
}

template <bool kStat, bool kMass, typename Mass>
int64_t scan(bool single, const SlotLayout& layout, const int32_t* blocks, int64_t length, int64_t low,
             int64_t high, float* stat, const Mass* row_mass, const TokenTable* shared_of, Candidate& best,
             std::vector<Candidate>& pool, std::vector<Span>& spans) {
  auto row = single ? scan_row<kStat, kMass, true, Mass> : scan_row<kStat, kMass, false, Mass>;
  return row(layout, blocks, length, low, high, stat, row_mass, shared_of, best, pool, spans);
}

// Batch rows [begin, end) of select_lowest, their blocks checked already.
template <typename Mass>
Selection select_rows(const SlotLayout& layout, const int64_t* rows, int64_t begin, int64_t end,
                      const int64_t* kv_len, const int64_t* lo, const int64_t* hi, const int64_t* excess,
                      float* stat, const Mass* mass, int64_t mass_stride, const TokenTable* shared_of) {
  Selection out;
  const int64_t tpb = layout.tokens_per_block;
  std::vector<Candidate> pool;
  std::vector<Span> spans;
  for (int64_t i = begin; i < end; ++i) {
    const int32_t* blocks = layout.block_table + rows[i] * layout.block_stride;
    const int64_t length = kv_len[i], want = excess[i];
    const Mass* row_mass = mass != nullptr ? mass + i * mass_stride : nullptr;
    if (want <= 0) {  // nothing to evict: only the observation
      if (row_mass == nullptr) continue;
      const int64_t num_blocks = (length + tpb - 1) / tpb;
      for (int64_t block = 0, next; block < num_blocks; block = next) {
        next = span_end(blocks, block, num_blocks, num_blocks, nullptr);
        const int64_t start = block * tpb;
        add_mass(stat + static_cast<int64_t>(blocks[block]) * tpb, row_mass + start,
                 std::min(next * tpb, length) - start);
      }
      continue;
    }
    // Candidates: live ids in [low, high); an empty range (low >= high) has none.
    const int64_t low = lo[i], high = std::max(lo[i], hi[i]);
    Candidate best{std::numeric_limits<double>::infinity(), std::numeric_limits<int64_t>::max(), -1};
    pool.clear();
    const bool single = want == 1;
    int64_t count;
    if (stat == nullptr) {
      count = scan<false, false, Mass>(single, layout, blocks, length, low, high, stat, row_mass, shared_of, best,
                                       pool, spans);
    } else if (row_mass == nullptr) {
      count = scan<true, false, Mass>(single, layout, blocks, length, low, high, stat, row_mass, shared_of, best,
                                      pool, spans);
    } else {
      count = scan<true, true, Mass>(single, layout, blocks, length, low, high, stat, row_mass, shared_of, best,
                                     pool, spans);
    }
    if (count == 0) continue;
    if (single) {
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

// Fewer slots than this per thread: one thread (starting one costs tens of microseconds).
constexpr int64_t kSlotsPerThread = int64_t{1} << 16;

}  // namespace

template <typename Mass>
Selection select_lowest(const SlotLayout& layout, const int64_t* rows, int64_t batch, const int64_t* kv_len,
                        const int64_t* lo, const int64_t* hi, const int64_t* excess, float* stat,
                        const Mass* mass, int64_t mass_stride, const TokenTable* shared_of, int64_t threads) {
  const int64_t tpb = layout.tokens_per_block;
  int64_t total = 0;
  for (int64_t i = 0; i < batch; ++i) {
    const int32_t* blocks = layout.block_table + rows[i] * layout.block_stride;
    for (int64_t block = 0; block * tpb < kv_len[i]; ++block) {
      if (blocks[block] < 0 || blocks[block] >= layout.num_blocks) {
        throw std::invalid_argument("select_lowest: block " + std::to_string(blocks[block]) + " of row " +
                                    std::to_string(rows[i]) + " is outside the slot layout");
      }
    }
    total += kv_len[i];
  }
  // Rows in `parts` contiguous ranges of about equal slots, one thread each (the last on this one);
  // rows share no slot without shared blocks, so no two threads write one statistic, and the
  // ranges' victims concatenate in row order: the same result as one pass.
  const int64_t parts = shared_of != nullptr ? 1 : std::max<int64_t>(1, std::min(threads, total / kSlotsPerThread));
  if (parts == 1) {
    return select_rows(layout, rows, 0, batch, kv_len, lo, hi, excess, stat, mass, mass_stride, shared_of);
  }
  std::vector<int64_t> bounds{0};
  for (int64_t i = 0, seen = 0; i < batch && static_cast<int64_t>(bounds.size()) < parts; ++i) {
    seen += kv_len[i];
    if (seen * parts >= total * static_cast<int64_t>(bounds.size())) bounds.push_back(i + 1);
  }
  bounds.push_back(batch);
  const auto n = static_cast<int64_t>(bounds.size()) - 1;
  std::vector<Selection> picked(n);
  std::vector<std::exception_ptr> failed(n);
  auto run = [&](int64_t part) {
    try {
      picked[part] = select_rows(layout, rows, bounds[part], bounds[part + 1], kv_len, lo, hi, excess, stat, mass,
                                 mass_stride, shared_of);
    } catch (...) {
      failed[part] = std::current_exception();
    }
  };
  std::vector<std::thread> workers;
  for (int64_t part = 0; part + 1 < n; ++part) workers.emplace_back(run, part);
  run(n - 1);
  for (std::thread& w : workers) w.join();
  Selection out;
  for (int64_t part = 0; part < n; ++part) {
    if (failed[part]) std::rethrow_exception(failed[part]);
    out.rows.insert(out.rows.end(), picked[part].rows.begin(), picked[part].rows.end());
    out.positions.insert(out.positions.end(), picked[part].positions.begin(), picked[part].positions.end());
  }
  return out;
}

Selection lowest_live_ids(const TokenTable& table, const int64_t* req_ids, int64_t batch, const int64_t* lo,
                          const int64_t* hi, const int64_t* excess, const RowsOf* shared_in) {
  Selection out;
  const int64_t tpb = table.tokens_per_block();
  for (int64_t i = 0; i < batch; ++i) {
    int64_t want = excess[i];
    if (want <= 0) continue;  // within its budget: its table entry is not even looked at
    const Sequence& s = table.seq(req_ids[i]);
    const int64_t low = std::max<int64_t>(lo[i], 0), high = hi[i];
    for (int64_t id = low; id < std::min(high, s.num_tokens) && want > 0; ++id) {
      if (!s.live[id]) continue;
      const int64_t slot = s.slot_of[id];
      if (shared_in != nullptr && table.is_shared(slot / tpb)) continue;
      out.rows.push_back(i);
      out.positions.push_back(s.block_index.find(slot / tpb) * tpb + slot % tpb);
      --want;
    }
    // Ids from num_tokens on are this step's new tokens: in the step's layout already, not yet in
    // the table, live, at the positions right after its kv_len.
    const int32_t* blocks = shared_in == nullptr ? nullptr
                                                 : shared_in->layout->block_table +
                                                       shared_in->rows[i] * shared_in->layout->block_stride;
    for (int64_t id = std::max(low, s.num_tokens); id < high && want > 0; ++id) {
      const int64_t position = s.kv_len + (id - s.num_tokens);
      if (blocks != nullptr && table.is_shared(blocks[position / tpb])) continue;
      out.rows.push_back(i);
      out.positions.push_back(position);
      --want;
    }
  }
  return out;
}

template Selection select_lowest<float>(const SlotLayout&, const int64_t*, int64_t, const int64_t*, const int64_t*,
                                        const int64_t*, const int64_t*, float*, const float*, int64_t,
                                        const TokenTable*, int64_t);
template Selection select_lowest<double>(const SlotLayout&, const int64_t*, int64_t, const int64_t*, const int64_t*,
                                         const int64_t*, const int64_t*, float*, const double*, int64_t,
                                         const TokenTable*, int64_t);

}  // namespace vtoken
