// SPDX-License-Identifier: Apache-2.0
// amx_bf16_supported, avx512_bf16_supported, avx512_supported and bf16_mass_kind (amx.h): CPUID for
// the instructions, XCR0 and Linux's arch_prctl for the state.
#include "amx.h"

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

}  // namespace

bool amx_bf16_supported() {
#ifdef VTOKEN_TILE_EMULATION  // the tests' software tiles (cpp/tests/tile_emulation.h) stand in for AMX
  return tile_emulation::enabled() && support().avx512_bf16;
#else
  return support().amx;
#endif
}

bool avx512_bf16_supported() { return support().avx512_bf16; }

bool avx512_supported() { return support().avx512; }

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
