// SPDX-License-Identifier: Apache-2.0
// FlatIndex and ChunkedArray against the standard containers, over random operations with many
// colliding keys (long probe runs exercise backward-shift deletion), and the ChunkArena's
// alignment, distinctness and recycling. Exit code 0: all agree.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "../core/chunked_array.h"
#include "../core/flat_index.h"

int main() {
  constexpr int64_t kMarker = std::numeric_limits<int64_t>::min();  // FlatIndex's empty-entry key
  std::mt19937_64 rng(7);
  for (int round = 0; round < 200; ++round) {
    vtoken::FlatIndex index;
    std::unordered_map<int64_t, int64_t> reference;
    const int64_t key_range = 1 + rng() % 300;
    for (int op = 0; op < 2000; ++op) {
      const int64_t key = static_cast<int64_t>(rng() % key_range) * 1024 - 5000;  // clustered keys
      switch (rng() % 3) {
        case 0: {
          const int64_t value = static_cast<int64_t>(rng() % 1000);
          index.insert(key, value);
          reference[key] = value;
          break;
        }
        case 1:
          index.erase(key);
          reference.erase(key);
          break;
        default:
          break;
      }
      if (index.size() != reference.size()) {
        std::printf("FAIL: size %zu != %zu\n", index.size(), reference.size());
        return 1;
      }
      for (int64_t k = 0; k < key_range; ++k) {
        const int64_t probe = k * 1024 - 5000;
        const auto it = reference.find(probe);
        const int64_t want = it == reference.end() ? vtoken::FlatIndex::kAbsent : it->second;
        if (index.find(probe) != want) {
          std::printf("FAIL: key %lld -> %lld, want %lld\n", (long long)probe, (long long)index.find(probe),
                      (long long)want);
          return 1;
        }
      }
      // The empty-entry marker is never a key: a lookup of it must not land on an empty entry.
      if (index.find(kMarker) != vtoken::FlatIndex::kAbsent) {
        return std::printf("FAIL: the empty marker found a value\n"), 1;
      }
    }
  }
  {
    vtoken::FlatIndex index;
    index.insert(3, 0);
    bool refused = false;
    try {
      index.insert(kMarker, 1);
    } catch (const std::invalid_argument&) {
      refused = true;
    }
    index.erase(kMarker);
    if (!refused || index.size() != 1 || index.find(3) != 0) return std::printf("FAIL: the marker as a key\n"), 1;
  }
  vtoken::ChunkedArray<int32_t, 3> chunked;  // 8-element chunks: many chunk boundaries
  std::vector<int32_t> plain;
  for (int op = 0; op < 20000; ++op) {
    const auto r = rng() % 10;
    if (r < 6) {
      const auto v = static_cast<int32_t>(rng());
      chunked.push_back(v);
      plain.push_back(v);
    } else if (r < 8) {
      const size_t n = rng() % (plain.size() + 20);
      const auto fill = static_cast<int32_t>(rng());
      chunked.resize(n, fill);
      plain.resize(n, fill);
    } else if (!plain.empty()) {
      const size_t i = rng() % plain.size();
      chunked[i] = plain[i] = static_cast<int32_t>(rng());
    }
    if (chunked.size() != plain.size()) return std::printf("FAIL: chunked size\n"), 1;
    for (size_t i = 0; i < plain.size(); i += 1 + plain.size() / 64) {
      if (chunked[i] != plain[i]) return std::printf("FAIL: chunked[%zu]\n", i), 1;
    }
  }
  // ChunkArena: chunks are cache-line aligned, distinct while held, recycled once given back.
  auto& arena = vtoken::ChunkArena::instance();
  std::vector<void*> held;
  for (int i = 0; i < 3000; ++i) {  // 3000 x 4 KiB: crosses several 2 MiB slabs
    void* chunk = arena.take(4096);
    if (reinterpret_cast<uintptr_t>(chunk) % 64 != 0) return std::printf("FAIL: chunk alignment\n"), 1;
    static_cast<char*>(chunk)[4095] = 1;  // writable to its last byte
    held.push_back(chunk);
  }
  std::vector<void*> sorted = held;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) return std::printf("FAIL: chunk twice\n"), 1;
  arena.give_back(held.back(), 4096);
  if (arena.take(4096) != held.back()) return std::printf("FAIL: chunk not recycled\n"), 1;
  std::printf("flat_index_test: PASS\n");
  return 0;
}
