// SPDX-License-Identifier: Apache-2.0
// A fused decode call's result as Python takes it (decode_bindings.cpp): one int64 buffer per
// call, made a numpy array only when first read.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>

#include "decode_step.h"
#include "owned_ids.h"

namespace vtoken::packing {

namespace nb = nanobind;

// The call's result packed in one int64 buffer, for one numpy array Python takes views of
// (step/fused.py FusedOutput): one array made per call instead of one per part, each of which
// costs the host's thread a Python object's making. The worker packs it; the host only wraps it.
//
//     [3, B + 1]  victim_offsets, move_offsets, freed_offsets
//     [4, B]      kv_lens, lost, num_tokens, changed
//     [V]         victim_ids
//     [3, M]      move_tokens, move_src, move_dst
//     [F]         freed
struct PackedResult {
  std::vector<int64_t> flat;
  size_t batch = 0, victims = 0, moves = 0;
  int64_t num_changed = 0;
  double decide_seconds = 0.0, plan_seconds = 0.0, commit_seconds = 0.0;  // parts of the call's time
};

inline PackedResult packed(const vtoken::DecodeResult& r) {
  const vtoken::StepResult& t = r.table;
  const size_t batch = t.kv_lens.size();
  for (const std::vector<int64_t>* per_request : {&r.lost, &r.num_tokens, &r.changed}) {
    if (per_request->size() != batch) throw std::logic_error("decode result: a per-request part is not [batch]");
  }
  for (const std::vector<int64_t>* offsets : {&r.victim_offsets, &t.move_offsets, &t.freed_offsets}) {
    if (offsets->size() != batch + 1) throw std::logic_error("decode result: CSR offsets are not [batch + 1]");
  }
  if (t.move_tokens.size() != t.move_src.size() || t.move_dst.size() != t.move_src.size()) {
    throw std::logic_error("decode result: the moves' parts differ in length");
  }
  PackedResult p{{}, batch, r.victim_ids.size(), t.move_src.size(), r.num_changed, r.decide_seconds,
                 t.plan_seconds, t.commit_seconds};
  p.flat.reserve(3 * (batch + 1) + 4 * batch + p.victims + 3 * p.moves + t.freed.size());
  for (const std::vector<int64_t>* part : {&r.victim_offsets, &t.move_offsets, &t.freed_offsets, &t.kv_lens, &r.lost,
                                           &r.num_tokens, &r.changed, &r.victim_ids, &t.move_tokens, &t.move_src,
                                           &t.move_dst, &t.freed}) {
    p.flat.insert(p.flat.end(), part->begin(), part->end());
  }
  return p;
}

// The packed buffer as Python holds it: a numpy array only when first asked for (a part of the
// output read, step/fused.py FusedOutput). A decode step whose output nobody reads (nothing
// evicted, moved or freed) makes no numpy object on the host's thread, where making one costs
// several times its warm time (benchmarks/step/cold_host).
class PackedBuffer {
 public:
  explicit PackedBuffer(std::vector<int64_t>&& flat) : flat_(std::move(flat)), size_(flat_.size()) {}

  // The buffer, moved into an int64 numpy array; once (std::logic_error after).
  vtoken::OwnedIds array() {
    if (taken_) throw std::logic_error("PackedBuffer: the array was taken already");
    taken_ = true;
    return vtoken::to_numpy(std::move(flat_));
  }
  size_t size() const { return size_; }

 private:
  std::vector<int64_t> flat_;
  size_t size_;
  bool taken_ = false;
};

// (the buffer, batch, victims, moves, number changed, the buffer's length, (decide, plan, commit)
// seconds: where the call's time went, DecodeResult and StepResult say what each counts)
inline nb::tuple result_tuple(PackedResult&& p) {
  const size_t size = p.flat.size();
  return nb::make_tuple(nb::cast(PackedBuffer(std::move(p.flat))), p.batch, p.victims, p.moves, p.num_changed,
                        size, nb::make_tuple(p.decide_seconds, p.plan_seconds, p.commit_seconds));
}

}  // namespace vtoken::packing
