// SPDX-License-Identifier: Apache-2.0
// ChunkedArray: a growable array stored in fixed chunks of 2^kShift elements. Appending never
// moves what is stored (a std::vector doubling a 4k-token request's arrays copies 16 KB and
// faults in fresh pages, all inside one decode step); indexing costs one more load, from a
// small pointer array that stays in cache. Shrinking keeps the chunks for later growth. Chunks
// come from the ChunkArena (huge-page slabs) and go back to it with the array.
#pragma once

#include <cstddef>
#include <vector>

#include "chunk_arena.h"

namespace vtoken {

template <typename T, int kShift = 10>
class ChunkedArray {
 public:
  ChunkedArray() = default;
  ChunkedArray(const ChunkedArray&) = delete;  // owns its chunks
  ChunkedArray& operator=(const ChunkedArray&) = delete;
  ~ChunkedArray() {
    for (T* chunk : chunks_) ChunkArena::instance().give_back(chunk, kBytes);
  }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  T& operator[](size_t i) { return chunks_[i >> kShift][i & kMask]; }
  const T& operator[](size_t i) const { return chunks_[i >> kShift][i & kMask]; }
  T& back() { return (*this)[size_ - 1]; }
  const T& back() const { return (*this)[size_ - 1]; }

  void push_back(T value) {
    if (size_ == capacity()) add_chunk();
    (*this)[size_++] = value;
  }

  // New entries (beyond the old size) are set to `fill`.
  void resize(size_t n, T fill = T{}) {
    while (capacity() < n) add_chunk();
    for (size_t i = size_; i < n; ++i) (*this)[i] = fill;
    size_ = n;
  }

 private:
  static constexpr size_t kChunk = size_t{1} << kShift;
  static constexpr size_t kMask = kChunk - 1;
  static constexpr size_t kBytes = kChunk * sizeof(T);
  size_t capacity() const { return chunks_.size() << kShift; }
  void add_chunk() { chunks_.push_back(static_cast<T*>(ChunkArena::instance().take(kBytes))); }

  std::vector<T*> chunks_;
  size_t size_ = 0;
};

}  // namespace vtoken
