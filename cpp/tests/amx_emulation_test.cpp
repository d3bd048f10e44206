// SPDX-License-Identifier: Apache-2.0
// The AMX kind of both bf16 mass passes, run on a CPU without AMX through software tiles
// (tile_emulation.h, passed with -include to every source), against the CPU's own "avx512-bf16"
// kind on the same inputs and against a double-precision softmax: random head dims (odd ones,
// and past one tile's 32 dims), GQA groups (past one tile's 16 query heads in decode), windows,
// reused prefixes, strided rows, shuffled block tables, blocks of 1 to 64 tokens, layer maps,
// 1 to 4 threads, and workspaces that start misaligned and hold NaN bytes; decode's pool holds
// NaN wherever no row attends. Prints PASS, or each case that differs by more than 2e-4.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../core/amx.h"
#include "../core/decode_mass.h"
#include "../core/prefill_mass.h"

namespace {

std::mt19937_64 generator(7);

int64_t pick(int64_t low, int64_t high) { return std::uniform_int_distribution<int64_t>(low, high)(generator); }

uint16_t to_bf16(float value) {  // round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

double from_bf16(uint16_t half) {
  const uint32_t bits = uint32_t(half) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

std::vector<uint16_t> random_bf16(int64_t count) {
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::vector<uint16_t> values(count);
  for (uint16_t& v : values) v = to_bf16(normal(generator));
  return values;
}

// Adds each query's softmax over scores[0, n) (already scaled) to mass.
void add_softmax(const std::vector<double>& scores, double* mass) {
  const double top = *std::max_element(scores.begin(), scores.end());
  double sum = 0;
  for (double s : scores) sum += std::exp(s - top);
  for (size_t j = 0; j < scores.size(); ++j) mass[j] += std::exp(scores[j] - top) / sum;
}

// The largest difference relative to max(|reference|, 1e-3).
double difference(const std::vector<float>& got, const std::vector<double>& reference) {
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::fabs(got[i] - reference[i]) / std::max(std::fabs(reference[i]), 1e-3));
  return worst;
}

// Runs `pass` once per kind: the CPU's own, then AMX in software. Fails unless each kind is the one named.
template <class Pass>
bool both_kinds(const char* own, const std::vector<double>& reference, const char* label, Pass pass) {
  bool good = true;
  for (bool emulated : {false, true}) {
    vtoken::tile_emulation::enabled() = emulated;
    const std::string kind = vtoken::bf16_mass_kind();
    if (kind != (emulated ? "amx" : own)) {
      std::printf("FAIL %s: the kind is %s\n", label, kind.c_str());
      return false;
    }
    const double worst = difference(pass(), reference);
    if (!(worst <= 2e-4)) {
      std::printf("FAIL %s, %s: %.3g from the reference\n", label, kind.c_str(), worst);
      good = false;
    }
  }
  vtoken::tile_emulation::enabled() = false;
  return good;
}

bool prefill_case() {
  const int64_t dims[] = {1, 8, 17, 30, 32, 33, 64, 80, 128, 256};
  const int64_t head_dim = dims[pick(0, 9)], kv_heads = pick(1, 3), group = pick(1, 5), heads = kv_heads * group;
  const int64_t tokens = pick(1, 90), past = pick(0, 1) ? pick(1, 150) : 0, first = pick(0, tokens - 1);
  const int64_t threads = pick(1, 4), q_stride = heads * head_dim + pick(0, 3), k_stride = kv_heads * head_dim + pick(0, 3);
  const std::vector<uint16_t> q = random_bf16(tokens * q_stride), k = random_bf16(tokens * k_stride),
                              past_k = random_bf16(std::max<int64_t>(past, 1) * k_stride);
  vtoken::PrefillMassArgs a;
  a.q = {q.data(), q_stride, head_dim};
  a.k = {k.data(), k_stride, head_dim};
  a.past_k = {past_k.data(), k_stride, head_dim};
  a.num_tokens = tokens, a.num_past = past, a.num_heads = heads, a.num_kv_heads = kv_heads, a.head_dim = head_dim;
  a.first_query = first;
  const int64_t keys = past + tokens;
  auto key = [&](int64_t j, int64_t h, int64_t d) {
    return j < past ? from_bf16(past_k[j * k_stride + h * head_dim + d]) : from_bf16(k[(j - past) * k_stride + h * head_dim + d]);
  };
  std::vector<double> reference(keys, 0.0);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t t = first; t < tokens; ++t) {
      std::vector<double> scores(past + t + 1);
      for (int64_t j = 0; j <= past + t; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < head_dim; ++d) dot += from_bf16(q[t * q_stride + h * head_dim + d]) * key(j, h / group, d);
        scores[j] = dot / std::sqrt(double(head_dim));
      }
      add_softmax(scores, reference.data());
    }
  char label[160];
  std::snprintf(label, sizeof label, "prefill head_dim %ld, %ld KV heads x %ld, %ld tokens after %ld, from %ld, %ld threads",
                long(head_dim), long(kv_heads), long(group), long(tokens), long(past), long(first), long(threads));
  return both_kinds("avx512-bf16", reference, label, [&] {
    const int64_t bytes = vtoken::prefill_mass_workspace_bytes(keys, kv_heads, head_dim, threads, vtoken::Element::kBf16);
    std::vector<uint8_t> workspace(bytes + 1, 0xff);  // NaN bytes, misaligned start
    std::vector<float> mass(keys, -1.0f);
    vtoken::prefill_mass(a, workspace.data() + 1, bytes, threads, mass.data());
    return mass;
  });
}

bool decode_case() {
  const int64_t dims[] = {2, 8, 30, 32, 34, 64, 80, 128, 256};
  const int64_t per_block[] = {1, 3, 7, 8, 15, 16, 32, 64};
  const int64_t head_dim = dims[pick(0, 8)], tpb = per_block[pick(0, 7)], kv_heads = pick(1, 3), group = pick(1, 20);
  const int64_t heads = kv_heads * group, batch = pick(1, 4), layers = pick(1, 3), pool_layers = layers + pick(0, 2);
  const int64_t threads = pick(1, 3);
  std::vector<int64_t> lens(batch);
  for (int64_t& len : lens) len = pick(1, 150);
  const int64_t longest = *std::max_element(lens.begin(), lens.end());
  const int64_t width = (longest + tpb - 1) / tpb + pick(0, 2), blocks = batch * width + 3;
  std::vector<int64_t> order(blocks), table(batch * width), layer_map(layers);
  for (int64_t i = 0; i < blocks; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), generator);
  std::copy(order.begin(), order.begin() + batch * width, table.begin());
  for (int64_t& layer : layer_map) layer = pick(0, pool_layers - 1);
  const int64_t token_stride = head_dim + 2 * pick(0, 1), head_stride = tpb * token_stride;
  const int64_t layer_stride = kv_heads * head_stride, block_stride = pool_layers * layer_stride;
  std::vector<uint16_t> pool(blocks * block_stride, 0x7fc0);  // NaN where no row attends
  auto key = [&](int64_t b, int64_t l, int64_t h, int64_t p) {
    return &pool[table[b * width + p / tpb] * block_stride + layer_map[l] * layer_stride + h * head_stride +
                 (p % tpb) * token_stride];
  };
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t p = 0; p < lens[b]; ++p) {
          const std::vector<uint16_t> values = random_bf16(head_dim);
          std::copy(values.begin(), values.end(), key(b, l, h, p));
        }
  const int64_t q_head = head_dim + 2 * pick(0, 1), q_layer = heads * q_head, q_row = layers * q_layer;
  const std::vector<uint16_t> q = random_bf16(batch * q_row);
  vtoken::DecodeMassArgs a;
  a.q = q.data(), a.q_row_stride = q_row, a.q_layer_stride = q_layer, a.q_head_stride = q_head;
  a.keys = pool.data(), a.block_stride = block_stride, a.layer_stride = layer_stride, a.kv_head_stride = head_stride;
  a.token_stride = token_stride, a.num_pool_blocks = blocks, a.num_pool_layers = pool_layers;
  a.block_table = table.data(), a.table_width = width, a.kv_lens = lens.data(), a.layers = layer_map.data();
  a.batch = batch, a.num_layers = layers, a.num_heads = heads, a.num_kv_heads = kv_heads, a.head_dim = head_dim;
  a.tokens_per_block = tpb;
  const int64_t mass_width = width * tpb + pick(0, 5);
  std::vector<double> reference(batch * mass_width, 0.0);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t l = 0; l < layers; ++l)
      for (int64_t h = 0; h < heads; ++h) {
        std::vector<double> scores(lens[b]);
        for (int64_t p = 0; p < lens[b]; ++p) {
          double dot = 0;
          for (int64_t d = 0; d < head_dim; ++d)
            dot += from_bf16(q[b * q_row + l * q_layer + h * q_head + d]) * from_bf16(key(b, l, h / group, p)[d]);
          scores[p] = dot / std::sqrt(double(head_dim));
        }
        add_softmax(scores, reference.data() + b * mass_width);
      }
  char label[160];
  std::snprintf(label, sizeof label, "decode head_dim %ld, %ld-token blocks, %ld KV heads x %ld, batch %ld, %ld layers, %ld threads",
                long(head_dim), long(tpb), long(kv_heads), long(group), long(batch), long(layers), long(threads));
  return both_kinds("avx512-bf16", reference, label, [&] {
    const int64_t bytes = vtoken::decode_mass_workspace_bytes(longest, tpb, head_dim, batch, threads);
    std::vector<uint8_t> workspace(bytes + 3, 0xff);
    std::vector<float> mass(batch * mass_width, -7.0f);
    vtoken::decode_mass_bf16(a, workspace.data() + 3, bytes, threads, mass.data(), mass_width);
    return mass;
  });
}

}  // namespace

int main(int argc, char** argv) {
  if (!vtoken::avx512_bf16_supported()) {
    std::puts("SKIP: this CPU has no AVX-512 BF16, which the AMX kind's other instructions need");
    return 0;
  }
  const int cases = argc > 1 ? std::atoi(argv[1]) : 60;
  int failed = 0;
  for (int i = 0; i < cases; ++i) failed += !prefill_case();
  for (int i = 0; i < cases; ++i) failed += !decode_case();
  if (failed) {
    std::printf("FAIL: %d of %d cases\n", failed, 2 * cases);
    return 1;
  }
  std::printf("PASS: %d cases, each kind within 2e-4 of the reference\n", 2 * cases);
  return 0;
}
