// SPDX-License-Identifier: Apache-2.0
// Built with -DVTOKEN_AMX=0 (a compiler or target without AMX): the mass passes compile, report
// themselves unsupported, still size their workspaces and check their arguments, and refuse to
// run without writing anything (the Python side then takes the torch passes).
#include <cstdio>
#include <stdexcept>
#include <vector>

#include "../core/amx.h"
#include "../core/decode_mass.h"
#include "../core/prefill_mass.h"

namespace {

// Runs `pass`; true if it threw E (and nothing else).
template <class E, class Pass>
bool throws(Pass pass) {
  try {
    pass();
  } catch (const E&) {
    return true;
  } catch (...) {
  }
  return false;
}

int prefill() {
  if (vtoken::prefill_mass_workspace_bytes(100, 2, 64, 4, vtoken::Element::kF32) <= 0) {
    std::puts("FAIL: prefill workspace");
    return 1;
  }
  std::vector<uint16_t> q(10 * 4 * 64), k(10 * 2 * 64);
  vtoken::PrefillMassArgs a;
  a.q = {q.data(), 4 * 64, 64};
  a.k = {k.data(), 2 * 64, 64};
  a.num_tokens = 10, a.num_heads = 4, a.num_kv_heads = 2, a.head_dim = 64;
  const int64_t bytes = vtoken::prefill_mass_workspace_bytes(10, 2, 64, 1, vtoken::Element::kBf16);
  std::vector<uint8_t> workspace(bytes);
  std::vector<float> mass(10, 7.0f);
  auto run = [&] { vtoken::prefill_mass(a, workspace.data(), bytes, 1, mass.data()); };
  if (!throws<std::runtime_error>(run)) { std::puts("FAIL: prefill ran without AVX-512"); return 1; }
  a.num_heads = 3;  // not a multiple of the KV heads: a caller's error, told before anything else
  if (!throws<std::invalid_argument>(run)) { std::puts("FAIL: prefill took 3 heads over 2 KV heads"); return 1; }
  for (float m : mass)
    if (m != 7.0f) { std::puts("FAIL: prefill mass written"); return 1; }
  return 0;
}

int decode() {
  if (!vtoken::decode_mass_bf16_applies(32, 64) || vtoken::decode_mass_bf16_applies(24, 64)) {
    std::puts("FAIL: decode geometry");
    return 1;
  }
  // two rows of 20 and 32 positions over a pool of 4 blocks x 1 layer x 2 KV heads x 16 tokens x 64 dims
  std::vector<uint16_t> q(2 * 4 * 64), keys(4 * 2 * 16 * 64);
  std::vector<int64_t> table = {0, 1, 2, 3}, kv_lens = {20, 32}, layers = {0};
  vtoken::DecodeMassArgs a;
  a.q = q.data(), a.q_row_stride = 4 * 64, a.q_layer_stride = 4 * 64, a.q_head_stride = 64;
  a.keys = keys.data(), a.block_stride = 2 * 16 * 64, a.layer_stride = 2 * 16 * 64, a.kv_head_stride = 16 * 64;
  a.token_stride = 64, a.num_pool_blocks = 4, a.num_pool_layers = 1;
  a.block_table = table.data(), a.table_width = 2, a.kv_lens = kv_lens.data(), a.layers = layers.data();
  a.batch = 2, a.num_layers = 1, a.num_heads = 4, a.num_kv_heads = 2, a.head_dim = 64, a.tokens_per_block = 16;
  const int64_t bytes = vtoken::decode_mass_workspace_bytes(32, 16, 64, 2, 1);
  std::vector<uint8_t> workspace(bytes);
  std::vector<float> mass(2 * 32, 7.0f);
  auto run = [&] { vtoken::decode_mass_bf16(a, workspace.data(), bytes, 1, mass.data(), 32); };
  if (!throws<std::runtime_error>(run)) { std::puts("FAIL: decode ran without AMX or AVX-512 BF16"); return 1; }
  table[3] = 4;  // outside the pool: refused before the missing AMX is told
  if (!throws<std::invalid_argument>(run)) { std::puts("FAIL: decode took block 4 of 4"); return 1; }
  for (float m : mass)
    if (m != 7.0f) { std::puts("FAIL: decode mass written"); return 1; }
  return 0;
}

}  // namespace

int main() {
  if (vtoken::amx_bf16_supported() || vtoken::avx512_bf16_supported() || vtoken::avx512_supported() ||
      vtoken::bf16_mass_kind() || vtoken::prefill_mass_kind(vtoken::Element::kF32)) {
    std::puts("FAIL: supported without AMX intrinsics");
    return 1;
  }
  if (prefill() || decode()) return 1;
  std::puts("PASS");
  return 0;
}
