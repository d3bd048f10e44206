// SPDX-License-Identifier: Apache-2.0
// amx_bf16_supported, avx512_bf16_supported, avx512_supported and bf16_mass_kind (amx.h): CPUID for
// the instructions, XCR0 and Linux's arch_prctl for the state, under the ceiling that
// limit_mass_isa or $VTOKEN_MAX_CPU_ISA sets.
#include "amx.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#if VTOKEN_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace vtoken {
namespace {

#if VTOKEN_AMX
// AVX512F, AVX512BW, AVX512VL (and AVX512_BF16 if `bf16`) in CPUID, and the OS saving (OSXSAVE,
// XCR0) the ZMM state and that of `xcr0_bits` too.
bool cpu_and_os_support_avx512(bool bf16, unsigned xcr0_bits) {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx >> 27 & 1)) return false;  // OSXSAVE: xgetbv may run
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(ebx >> 16 & 1) || !(ebx >> 30 & 1) || !(ebx >> 31 & 1)) return false;  // AVX512F, AVX512BW, AVX512VL
  if (bf16 && (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) || !(eax >> 5 & 1))) return false;  // AVX512_BF16
  unsigned xcr0_low, xcr0_high;
  __asm__("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  const unsigned wanted = (7u << 5) | xcr0_bits;  // opmask + ZMM state
  return (xcr0_low & wanted) == wanted;
}

bool cpu_and_os_support_amx() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!(edx >> 22 & 1) || !(edx >> 24 & 1)) return false;           // AMX-BF16, AMX-TILE
  if (!cpu_and_os_support_avx512(true, 3u << 17)) return false;     // tile config + tile data
  constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;  // Linux: ask for the tile state
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
}

// What this CPU and OS run, asked once (AMX's tile state is requested from the OS then).
struct Support {
  bool amx = cpu_and_os_support_amx();
  bool avx512_bf16 = cpu_and_os_support_avx512(true, 0);
  bool avx512 = cpu_and_os_support_avx512(false, 0);
};
#else
struct Support {
  bool amx = false, avx512_bf16 = false, avx512 = false;
};
#endif

const Support& support() {
  static const Support asked;
  return asked;
}

// The ceiling's levels, lowest first: a level is used only where the CPU has it and it is at or
// under the ceiling. Index = level.
constexpr const char* kLevels[] = {"none", "avx512", "avx512-bf16", "amx"};
constexpr int kNone = 0, kAvx512 = 1, kAvx512Bf16 = 2, kAmx = 3, kUnread = -1;

int level_of(const char* name, const char* source) {
  for (int level = kNone; level <= kAmx; ++level)
    if (std::strcmp(name, kLevels[level]) == 0) return level;
  throw std::invalid_argument(std::string(source) + " must be one of amx, avx512-bf16, avx512, none; got '" + name +
                              "'");
}

// $VTOKEN_MAX_CPU_ISA's level, read once (unset or empty: no ceiling); a bad value throws on
// every question until it is mended.
int environment_level() {
  static const int level = [] {
    const char* env = std::getenv("VTOKEN_MAX_CPU_ISA");
    return env == nullptr || *env == '\0' ? kAmx : level_of(env, "VTOKEN_MAX_CPU_ISA");
  }();
  return level;
}

std::atomic<int> set_level{kUnread};  // limit_mass_isa's; kUnread: the environment's

int ceiling_level() {
  const int level = set_level.load(std::memory_order_relaxed);
  return level != kUnread ? level : environment_level();
}

bool allowed(int level) { return level <= ceiling_level(); }

}  // namespace

bool amx_bf16_supported() {
#ifdef VTOKEN_TILE_EMULATION  // the tests' software tiles (cpp/tests/tile_emulation.h) stand in for AMX
  return tile_emulation::enabled() && support().avx512_bf16 && allowed(kAmx);
#else
  return support().amx && allowed(kAmx);
#endif
}

bool avx512_bf16_supported() { return support().avx512_bf16 && allowed(kAvx512Bf16); }

bool avx512_supported() { return support().avx512 && allowed(kAvx512); }

const char* limit_mass_isa(const char* most) {
  const int before = set_level.exchange(most == nullptr ? kUnread : level_of(most, "limit_mass_isa"));
  return before == kUnread ? nullptr : kLevels[before];
}

const char* mass_isa_ceiling() { return kLevels[ceiling_level()]; }

const char* bf16_mass_kind() {
  return amx_bf16_supported() ? "amx" : avx512_bf16_supported() ? "avx512-bf16" : nullptr;
}

void require_workspace(const char* pass, int64_t workspace_bytes, int64_t needed) {
  if (workspace_bytes < needed)
    throw std::invalid_argument(std::string(pass) + ": workspace of " + std::to_string(workspace_bytes) + " bytes, " +
                                std::to_string(needed) + " needed");
}

const char* require_kind(const char* pass, const char* kind, const char* needs) {
  if (kind == nullptr) throw std::runtime_error(std::string(pass) + ": this CPU, OS or build lacks " + needs);
  return kind;
}

}  // namespace vtoken
