// SPDX-License-Identifier: Apache-2.0
// H2O's decode attention mass of a batch's rows on x86 CPUs with AMX-BF16 or AVX-512 BF16, read
// straight from the paged pool: each block's keys are loaded where they lie (no gathered copy, no
// float32 copy) as AMX tiles, or key by key for vdpbf16ps dot products without AMX, scored against
// the row's queries of one KV head with float32 sums, then one exact float32 softmax per query head
// and its sum into the row's mass.
//
// The specification is scores.batch_decode_attention_mass (Python); mass_torch.py is the
// portable pass. This one differs from them in how, not what: equal to float32 rounding (the
// suite checks it on random pools, block tables, lengths, GQA groups, head dims and layer maps).
#pragma once

#include <cstdint>

namespace vtoken {

struct DecodeMassArgs {
  // [batch, num_layers, num_heads, head_dim] bf16, the rows' rotated queries; last dim contiguous.
  const uint16_t* q = nullptr;
  int64_t q_row_stride = 0, q_layer_stride = 0, q_head_stride = 0;
  // The pool's keys [num_pool_blocks, num_pool_layers, num_kv_heads, tokens_per_block, head_dim]
  // bf16 (a view of the pool's K half); last dim contiguous. Strides in elements.
  const uint16_t* keys = nullptr;
  int64_t block_stride = 0, layer_stride = 0, kv_head_stride = 0, token_stride = 0;
  int64_t num_pool_blocks = 0, num_pool_layers = 0;
  const int64_t* block_table = nullptr;  // [batch, table_width]: row b's position p in block_table[b, p / tpb]
  int64_t table_width = 0;
  const int64_t* kv_lens = nullptr;  // [batch]: positions [0, kv_lens[b]) attended
  const int64_t* layers = nullptr;   // [num_layers]: the pool layer of each query layer
  int64_t batch = 0, num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0, tokens_per_block = 0;
};

// Whether the pass takes this pool geometry: an even head_dim (bf16 pairs) and tokens_per_block
// below 16 or a multiple of it (a tile of keys never crosses a block).
bool decode_mass_bf16_applies(int64_t tokens_per_block, int64_t head_dim);

// Bytes of workspace the pass needs for rows of up to max_kv_len positions with this many threads
// (at most one per row).
int64_t decode_mass_workspace_bytes(int64_t max_kv_len, int64_t tokens_per_block, int64_t head_dim,
                                    int64_t batch, int64_t threads);

// mass[b, j] for b < batch, j < mass_width (overwritten; 0 past the row's kv_len): the sum over
// layers and heads of row b's softmax weight on position j. Threads take whole rows, so the result
// does not depend on the thread count. Throws std::invalid_argument (nothing written) for
// inconsistent shapes, a block id or pool layer outside the pool, a kv_len outside
// [1, min(table_width * tokens_per_block, mass_width)], or a workspace smaller than
// decode_mass_workspace_bytes; std::runtime_error where bf16_mass_kind (amx.h) is nullptr.
void decode_mass_bf16(const DecodeMassArgs& args, uint8_t* workspace, int64_t workspace_bytes, int64_t threads,
                     float* mass, int64_t mass_width);

}  // namespace vtoken
