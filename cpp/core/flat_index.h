// SPDX-License-Identifier: Apache-2.0
// FlatIndex: an int64 -> int64 map with open addressing (linear probing, power-of-two capacity,
// backward-shift deletion). A lookup reads one or two adjacent cache lines, where a node-based
// std::unordered_map chases a bucket and a node: on the decode path (block id -> index in the
// request's list, request id -> sequence) that is the difference between one cache miss and two.
#pragma once

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

namespace vtoken {

class FlatIndex {
 public:
  static constexpr int64_t kAbsent = -1;
  static constexpr int64_t kEmpty = std::numeric_limits<int64_t>::min();

  int64_t find(int64_t key) const {
    if (entries_.empty() || key == kEmpty) return kAbsent;
    for (size_t i = ideal(key);; i = (i + 1) & mask_) {
      const Entry& e = entries_[i];
      if (e.key == key) return e.value;
      if (e.key == kEmpty) return kAbsent;
    }
  }
  bool contains(int64_t key) const { return find(key) != kAbsent; }
  // Starts loading the cache line where a lookup of `key` begins.
  void prefetch(int64_t key) const {
    if (!entries_.empty()) __builtin_prefetch(&entries_[ideal(key)]);
  }
  size_t size() const { return size_; }

  // Inserts or overwrites; values must not be kAbsent.
  void insert(int64_t key, int64_t value) {
    if (key == kEmpty) throw std::invalid_argument("FlatIndex: the key -2**63 marks empty entries");
    if (2 * (size_ + 1) > entries_.size()) grow();
    for (size_t i = ideal(key);; i = (i + 1) & mask_) {
      Entry& e = entries_[i];
      if (e.key == key) {
        e.value = value;
        return;
      }
      if (e.key == kEmpty) {
        e = {key, value};
        ++size_;
        return;
      }
    }
  }

  void erase(int64_t key) {
    if (entries_.empty() || key == kEmpty) return;
    size_t i = ideal(key);
    while (entries_[i].key != key) {
      if (entries_[i].key == kEmpty) return;
      i = (i + 1) & mask_;
    }
    // Backward shift: pull later entries of the probe run into the hole so lookups never stop early.
    for (size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      if (entries_[j].key == kEmpty) break;
      const size_t k = ideal(entries_[j].key);
      const bool between = i <= j ? (i < k && k <= j) : (i < k || k <= j);
      if (!between) {
        entries_[i] = entries_[j];
        i = j;
      }
    }
    entries_[i].key = kEmpty;
    --size_;
  }

  void clear() {
    for (Entry& e : entries_) e.key = kEmpty;
    size_ = 0;
  }

 private:
  struct Entry {
    int64_t key;
    int64_t value;
  };
  size_t ideal(int64_t key) const {
    return static_cast<size_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> 32) & mask_;
  }

  void grow() {
    std::vector<Entry> old = std::move(entries_);
    entries_.assign(old.empty() ? 16 : 2 * old.size(), Entry{kEmpty, 0});
    mask_ = entries_.size() - 1;
    size_ = 0;
    for (const Entry& e : old) {
      if (e.key != kEmpty) insert(e.key, e.value);
    }
  }

  std::vector<Entry> entries_;
  size_t size_ = 0;
  size_t mask_ = 0;
};

}  // namespace vtoken
