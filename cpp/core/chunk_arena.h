// SPDX-License-Identifier: Apache-2.0
// ChunkArena: the fixed-size chunks of every ChunkedArray, carved from 2 MiB slabs that ask the
// kernel for transparent huge pages.
//
// Why: a decode step reads a few random entries of each request's arrays (the evicted token's
// slot and liveness, the hole's token). At batch 256 x 4k tokens those arrays span ~10 MB, so
// with 4 KiB pages most such loads miss the TLB as well as the cache, and under a hypervisor the
// page walk costs more than the miss. A 2 MiB page covers 512 small ones: `vtoken bench core`
// drops ~20% (dense) and ~25% (lazy) on the 2-core KVM VM.
//
// Chunks are recycled through per-size free lists; slabs are kept for the life of the process
// (they hold at most the tables' peak size) and the arena itself is never destroyed, so tables
// freed late in interpreter shutdown still find it. Thread-safe: one mutex, taken once per
// chunk (every 1024 tokens of a request), never per token.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace vtoken {

class ChunkArena {
 public:
  static ChunkArena& instance() {
    static ChunkArena* arena = new ChunkArena;  // never destroyed (see above)
    return *arena;
  }

  // A chunk of `bytes` (a power of two, at most one slab), aligned to a cache line (or to its size
  // if smaller).
  void* take(size_t bytes) {
    if (bytes == 0 || (bytes & (bytes - 1)) != 0 || bytes > kSlab) throw std::bad_alloc();
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<void*>& spare = free_[bytes];
    if (!spare.empty()) {
      void* chunk = spare.back();
      spare.pop_back();
      return chunk;
    }
    // Cache-line alignment, not alignment to the size: chunks carved at staggered page offsets
    // keep the arrays' hot tails (every request near the same length) out of the same cache sets.
    const size_t align = bytes < kLine ? bytes : kLine;
    size_t pad = (0 - reinterpret_cast<uintptr_t>(cursor_)) & (align - 1);
    if (left_ < pad + bytes) {
      new_slab();
      pad = 0;
    }
    cursor_ += pad;
    left_ -= pad;
    void* chunk = cursor_;
    cursor_ += bytes;
    left_ -= bytes;
    return chunk;
  }

  void give_back(void* chunk, size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    free_[bytes].push_back(chunk);
  }

 private:
  static constexpr size_t kSlab = size_t{2} << 20;
  static constexpr size_t kLine = 64;

  void new_slab() {
    char* slab = nullptr;
#if defined(__linux__)
    // Over-map by one slab, keep the aligned middle: huge pages need 2 MiB alignment.
    void* raw = mmap(nullptr, 2 * kSlab, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (start + kSlab - 1) & ~(kSlab - 1);
    if (aligned > start) munmap(raw, aligned - start);
    if (aligned + kSlab < start + 2 * kSlab) {
      munmap(reinterpret_cast<void*>(aligned + kSlab), start + 2 * kSlab - (aligned + kSlab));
    }
    slab = reinterpret_cast<char*>(aligned);
    madvise(slab, kSlab, MADV_HUGEPAGE);  // a hint: without THP the slab still works, on small pages
#else
    slab = static_cast<char*>(std::aligned_alloc(kSlab, kSlab));
    if (slab == nullptr) throw std::bad_alloc();
#endif
    cursor_ = slab;
    left_ = kSlab;  // the previous slab's remainder (too small for the chunk asked) is abandoned
  }

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  char* cursor_ = nullptr;
  size_t left_ = 0;
};

}  // namespace vtoken
