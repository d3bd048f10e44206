// SPDX-License-Identifier: Apache-2.0
// What the C++ mass passes (prefill_mass.cpp, decode_mass.cpp) share: whether this build, CPU and
// OS run AVX-512, AVX-512 BF16 dot products or AMX-BF16 tiles; the tiles' configuration record; a
// float32 exp for softmax rows; workspace alignment and worker threads.
//
// AMX intrinsics come with GCC 11 and Clang 12 onwards on x86-64 Linux; elsewhere (or with
// -DVTOKEN_AMX=0) the passes compile, report themselves unsupported, and callers take the
// portable torch passes.
#pragma once

#include <cstdint>
#include <thread>
#include <vector>

#ifndef VTOKEN_AMX
#if defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define VTOKEN_AMX 1
#else
#define VTOKEN_AMX 0
#endif
#endif
#if VTOKEN_AMX
#include <immintrin.h>
#endif

namespace vtoken {

// Each of the next three also needs its level at or under the ceiling (mass_isa_ceiling), so that
// one machine can run, test and time each kind of pass it has.
//
// True where the CPU has AMX-BF16 and AVX-512 (F, BW, BF16) and the OS grants this process the
// tile state (asked once, on the first call); always false in a build without AMX.
bool amx_bf16_supported();

// True where the CPU has AVX-512 F, BW, VL and BF16 (bf16 pair dot products, vdpbf16ps: AMD Zen 4 and
// later, Intel Cooper Lake and later) and the OS saves the ZMM state; false in a build without AMX
// intrinsics (the same compilers bring both).
bool avx512_bf16_supported();

// True where the CPU has AVX-512 F, BW and VL (Intel Skylake-SP and later, AMD Zen 4 and later) and
// the OS saves the ZMM state; false in a build without AMX intrinsics.
bool avx512_supported();

// The most the passes may use, whatever the CPU has: "amx" (no ceiling), "avx512-bf16", "avx512"
// or "none" (every pass refuses: callers take the torch passes): limit_mass_isa's, else
// $VTOKEN_MAX_CPU_ISA's (read on the first question; unset or empty: "amx"). limit_mass_isa(nullptr)
// goes back to the environment's; it returns the limit it replaced (nullptr: the environment's).
// std::invalid_argument for another name (from mass_isa_ceiling and every question above for a bad
// $VTOKEN_MAX_CPU_ISA), nothing changed. A pass's workspace is sized for the kind it runs: one
// sized before the ceiling changed is refused (require_workspace) where the kind it now runs needs
// more.
const char* limit_mass_isa(const char* most);
const char* mass_isa_ceiling();

// What the bf16 mass passes compute their scores with here: "amx" where this CPU and OS run
// AMX-BF16, else "avx512-bf16" where they run AVX-512 BF16 (pair dot products), else nullptr.
const char* bf16_mass_kind();

// What a pass checks after its arguments: std::invalid_argument for a workspace of fewer than
// `needed` bytes; then std::runtime_error where `kind` (what it would compute with here) is
// nullptr, saying that this CPU or OS lacks `needs`. `pass` names it in the messages.
void require_workspace(const char* pass, int64_t workspace_bytes, int64_t needed);
const char* require_kind(const char* pass, const char* kind, const char* needs);

// The passes' workspaces are caller-allocated byte tensors: each pass asks for kWorkspaceAlign
// bytes more than its regions and starts them at the first 64-byte boundary (tile rows, cache lines).
constexpr int64_t kWorkspaceAlign = 64;
inline uint8_t* aligned_start(uint8_t* workspace) {
  const uintptr_t misalign = reinterpret_cast<uintptr_t>(workspace) % kWorkspaceAlign;
  return workspace + (misalign ? kWorkspaceAlign - misalign : 0);
}

// The threads a pass runs: the caller's count, at least one, at most one per unit of work
// (a KV head, a row), since a unit is never split.
inline int64_t threads_used(int64_t threads, int64_t units) {
  return threads < 1 ? 1 : (threads < units ? threads : units);
}

// work(t) for t in [0, n): t = 0 on the calling thread, each other on a thread of its own
// (a pass runs once per step or context row, so threads are not kept between calls).
// If a thread cannot start (or work(0) throws), those started finish before the caller hears why.
template <class Work>
void run_workers(int64_t n, const Work& work) {
  struct JoinAll {
    std::vector<std::thread> threads;
    ~JoinAll() {
      for (std::thread& thread : threads) thread.join();
    }
  } others;
  for (int64_t t = 1; t < n; ++t) others.threads.emplace_back([&work, t] { work(t); });
  work(0);
}

#if VTOKEN_AMX
// Each function is compiled for the least it uses, so that what runs on a CPU without BF16 or AMX
// never holds their instructions (and the shared AVX-512 helpers inline into all three).
#define VTOKEN_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))
#define VTOKEN_AVX512_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define VTOKEN_AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

// The 64-byte record ldtilecfg reads (palette 1): per tile, its rows and bytes per row.
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads a 64-byte record");

// Loads the calling thread's tile configuration. Not _tile_loadconfig: GCC 11 and 12 give
// ldtilecfg an 8-byte operand there, so the compiler may drop the stores to the record's other 56
// bytes (GCC 12.2 at -O3 did: no tile's rows or colsb were written, and ldtilecfg then faults or
// configures empty tiles). Here the whole record is the instruction's operand.
VTOKEN_AMX_TARGET __attribute__((always_inline)) inline void load_tile_config(const TileConfig& config) {
#ifdef VTOKEN_TILE_EMULATION  // the tests' software tiles (cpp/tests/tile_emulation.h)
  tile_emulation::load_config(&config);
#else
  __asm__ volatile("ldtilecfg %0" : : "m"(config));
#endif
}

// A compiler barrier before a pass's tile loads: GCC's _tile_loadd names no memory operand, so
// without it the stores that packed the rows it reads could be ordered after it. One at a pass's
// start serves its loop: _tile_stored clobbers memory, which orders each later iteration's loads.
inline void before_tile_loads() { __asm__ volatile("" : : : "memory"); }

// Releases the tiles a thread configured (its own function, so that the AVX-512 loop calling it
// is not compiled for AMX).
VTOKEN_AMX_TARGET inline void release_tiles() { _tile_release(); }

// exp(x) for x <= 0 (and tiny positive x) in float32: x = n ln2 + r, |r| <= ln2 / 2, e^r by its
// degree-7 series (relative error under 2e-7), times 2^n. Below -87 the result is clamped at
// e^-87 (~1.6e-38), which no softmax sum can tell from the true value.
VTOKEN_AVX512_TARGET inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts: exact n * hi
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

}  // namespace vtoken
