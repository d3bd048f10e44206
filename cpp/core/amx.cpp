// SPDX-License-Identifier: Apache-2.0
// amx_bf16_supported (amx.h): CPUID for the instructions, XCR0 and Linux's arch_prctl for the state.
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
bool cpu_and_os_support_amx() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool avx512 = (ebx >> 16 & 1) && (ebx >> 30 & 1);        // AVX512F, AVX512BW
  const bool amx = (edx >> 22 & 1) && (edx >> 24 & 1);           // AMX-BF16, AMX-TILE
  if (!avx512 || !amx || !__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) || !(eax >> 5 & 1)) return false;  // AVX512_BF16
  unsigned xcr0_low, xcr0_high;
  __asm__("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  const unsigned wanted = (7u << 5) | (3u << 17);  // opmask + ZMM state, tile config + tile data
  if ((xcr0_low & wanted) != wanted) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;  // Linux: ask for the tile state
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
}
#endif

}  // namespace

bool amx_bf16_supported() {
#if VTOKEN_AMX
  static const bool supported = cpu_and_os_support_amx();
  return supported;
#else
  return false;
#endif
}

void require_workspace_and_amx(const char* pass, int64_t workspace_bytes, int64_t needed) {
  if (workspace_bytes < needed)
    throw std::invalid_argument(std::string(pass) + ": workspace of " + std::to_string(workspace_bytes) + " bytes, " +
                                std::to_string(needed) + " needed");
  if (!amx_bf16_supported()) throw std::runtime_error(std::string(pass) + ": this CPU or OS has no AMX-BF16");
}

}  // namespace vtoken
