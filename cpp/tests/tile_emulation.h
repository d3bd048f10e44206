// SPDX-License-Identifier: Apache-2.0
// AMX tiles (palette 1) in software, for running the AMX mass passes on CPUs without AMX: the
// test build passes this header with -include, so every source of cpp/core sees it before its
// own headers. It takes <immintrin.h> first and then replaces the tile intrinsics the passes use;
// amx.h and amx.cpp see VTOKEN_TILE_EMULATION and load the tile configuration here, and report
// AMX while tile_emulation::enabled() is true.
//
// It checks the shape rules the passes could break (Intel SDM vol. 2: LDTILECFG, TILELOADD,
// TILESTORED, TILEZERO, TDPBF16PS; the configuration record in vol. 1, "Intel AMX") and aborts where
// the hardware raises #GP or #UD, and it holds the passes to the configuration they mean to load:
// palette 1, start_row and reserved bytes zero, tiles 8-15 unused, rows <= 16 and colsb <= 64 and
// zero together; no tile instruction before the thread's LDTILECFG, none on a tile not configured
// or past the eighth; TDPBF16PS with distinct tiles, dst.colsb == src2.colsb,
// src1.colsb / 4 == src2.rows and dst.rows == src1.rows. A load zeroes the row bytes past colsb,
// as TILELOADD does. TDPBF16PS adds each pair's two float32 products to the float32 sum one after
// the other; where the hardware rounds or flushes denormals otherwise, the low bits differ (the
// test compares to 2e-4).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define VTOKEN_TILE_EMULATION 1

namespace vtoken::tile_emulation {

// Whether amx_bf16_supported() (amx.cpp) says yes: the test switches between the AMX kind and the
// CPU's own.
inline bool& enabled() {
  static bool on = false;
  return on;
}

struct Tiles {
  bool configured = false;
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  uint8_t data[8][16 * 64] = {};
};
inline thread_local Tiles tiles;

[[noreturn]] inline void fault(const char* what, int tile) {
  std::fprintf(stderr, "tile emulation: %s (tile %d), where the hardware faults\n", what, tile);
  std::abort();
}

inline void load_config(const void* record) {
  uint8_t bytes[64];
  std::memcpy(bytes, record, 64);
  if (bytes[0] != 1) fault("palette other than 1", -1);
  for (int i = 1; i < 16; ++i)
    if (bytes[i] != 0) fault("start_row or a reserved byte not zero", -1);
  for (int t = 0; t < 16; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, bytes + 16 + 2 * t, 2);
    const uint8_t rows = bytes[48 + t];
    if (t >= 8) {
      if (colsb != 0 || rows != 0) fault("a tile past the eighth configured", t);
      continue;
    }
    if (rows > 16 || colsb > 64) fault("more than 16 rows or 64 bytes a row", t);
    if ((rows == 0) != (colsb == 0)) fault("rows and colsb not zero together", t);
    tiles.rows[t] = rows;
    tiles.colsb[t] = colsb;
  }
  tiles.configured = true;
  std::memset(tiles.data, 0, sizeof tiles.data);
}

inline void check(int t) {
  if (!tiles.configured) fault("a tile instruction before ldtilecfg", t);
  if (t < 0 || t >= 8 || tiles.rows[t] == 0) fault("an unconfigured tile", t);
}

inline void release() { tiles = Tiles{}; }

inline void zero(int t) {
  check(t);
  std::memset(tiles.data[t], 0, sizeof tiles.data[t]);
}

inline void load(int t, const void* base, long stride) {
  check(t);
  std::memset(tiles.data[t], 0, sizeof tiles.data[t]);
  for (int r = 0; r < tiles.rows[t]; ++r)
    std::memcpy(tiles.data[t] + r * 64, static_cast<const uint8_t*>(base) + r * stride, tiles.colsb[t]);
}

inline void store(int t, void* base, long stride) {
  check(t);
  for (int r = 0; r < tiles.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, tiles.data[t] + r * 64, tiles.colsb[t]);
}

inline float bf16_at(const uint8_t* p) {
  uint16_t half;
  std::memcpy(&half, p, 2);
  const uint32_t bits = uint32_t(half) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// c[m, n] += sum over k of a[m, 2k] b[k, 2n] + a[m, 2k + 1] b[k, 2n + 1] (b in VNNI pairs).
inline void dot_bf16(int c, int a, int b) {
  check(c), check(a), check(b);
  if (c == a || c == b || a == b) fault("a tile named twice", c);
  if (tiles.colsb[c] != tiles.colsb[b]) fault("dst.colsb != src2.colsb", c);
  if (tiles.colsb[a] % 4 != 0 || tiles.colsb[a] / 4 != tiles.rows[b]) fault("src1.colsb / 4 != src2.rows", a);
  if (tiles.rows[c] != tiles.rows[a]) fault("dst.rows != src1.rows", c);
  for (int m = 0; m < tiles.rows[c]; ++m)
    for (int n = 0; n < tiles.colsb[c] / 4; ++n) {
      float sum;
      std::memcpy(&sum, tiles.data[c] + m * 64 + n * 4, 4);
      for (int k = 0; k < tiles.colsb[a] / 4; ++k) {
        const uint8_t* pa = tiles.data[a] + m * 64 + k * 4;
        const uint8_t* pb = tiles.data[b] + k * 64 + n * 4;
        sum += bf16_at(pa) * bf16_at(pb);
        sum += bf16_at(pa + 2) * bf16_at(pb + 2);
      }
      std::memcpy(tiles.data[c] + m * 64 + n * 4, &sum, 4);
    }
}

}  // namespace vtoken::tile_emulation

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_release() ::vtoken::tile_emulation::release()
#define _tile_loadd(t, base, stride) ::vtoken::tile_emulation::load(t, base, stride)
#define _tile_stored(t, base, stride) ::vtoken::tile_emulation::store(t, base, stride)
#define _tile_zero(t) ::vtoken::tile_emulation::zero(t)
#define _tile_dpbf16ps(c, a, b) ::vtoken::tile_emulation::dot_bf16(c, a, b)
