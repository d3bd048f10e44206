// SPDX-License-Identifier: Apache-2.0
// Built with -DVTOKEN_AMX=0 (a compiler or target without AMX): the prefill mass pass compiles,
// reports itself unsupported, still sizes its workspace and checks its arguments, and refuses to
// run without writing anything (the Python side then takes the torch pass).
#include <cstdio>
#include <stdexcept>
#include <vector>

#include "../core/prefill_mass.h"

int main() {
  if (vtoken::prefill_mass_amx_supported()) { std::puts("FAIL: supported without AMX"); return 1; }
  if (vtoken::prefill_mass_workspace_bytes(100, 2, 64, 4) <= 0) { std::puts("FAIL: workspace"); return 1; }
  std::vector<uint16_t> q(10 * 4 * 64), k(10 * 2 * 64);
  vtoken::PrefillMassArgs a;
  a.q = {q.data(), 4 * 64, 64};
  a.k = {k.data(), 2 * 64, 64};
  a.num_tokens = 10, a.num_heads = 4, a.num_kv_heads = 2, a.head_dim = 64;
  const int64_t bytes = vtoken::prefill_mass_workspace_bytes(10, 2, 64, 1);
  std::vector<uint8_t> workspace(bytes);
  std::vector<float> mass(10, 7.0f);
  try {
    vtoken::prefill_mass_amx(a, workspace.data(), bytes, 1, mass.data());
    std::puts("FAIL: ran without AMX");
    return 1;
  } catch (const std::runtime_error&) {
  }
  a.num_heads = 3;  // not a multiple of the KV heads: a caller's error, told before anything else
  try {
    vtoken::prefill_mass_amx(a, workspace.data(), bytes, 1, mass.data());
    std::puts("FAIL: 3 heads over 2 KV heads accepted");
    return 1;
  } catch (const std::invalid_argument&) {
  }
  for (float m : mass)
    if (m != 7.0f) { std::puts("FAIL: mass written"); return 1; }
  std::puts("PASS");
  return 0;
}
