// SPDX-License-Identifier: Apache-2.0
// Relocating token slots inside a paged KV pool, across every layer, K and V, in one launch.
//
// The pool is TensorRT-LLM's primary-pool layout, HND inside a block:
//
//     pool: [num_blocks, num_layers, 2 (K, V), num_kv_heads, tokens_per_block, head_dim]
//
// Seen from one block, the middle three dimensions are "rows": rows_per_block = num_layers * 2 *
// num_kv_heads, each row holding tokens_per_block vectors of row_bytes = head_dim * element size.
// One move copies, for every row, the vector of token slot src to the vector of slot dst, where a
// flat slot is block * tokens_per_block + offset:
//
//     byte address of (slot, row) = ((block * rows_per_block + row) * tokens_per_block + offset)
//                                   * row_bytes
//
// The copy is dtype-agnostic (fp32, fp16 and bf16 pools all move whole vectors of bytes), and
// bit-exact with trtllm_vtoken.reclaim.copy.relocate_slots, its Python specification.
//
// Precondition (the planner guarantees it; the Python caller checks it): destination slots are
// distinct and none of them is a source slot, so moves are independent and may run in any order.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

extern "C" {

// Enqueues the relocation on `stream` and returns at once (cudaSuccess, or the launch error).
// src_slots, dst_slots: device arrays of num_moves int64 flat slots. row_bytes must be a multiple
// of 2; 16-byte vectors are used when row_bytes and the pool's address allow it.
cudaError_t vtoken_relocate_kv(void* pool, int64_t rows_per_block, int64_t tokens_per_block,
                               int64_t row_bytes, const int64_t* src_slots,
                               const int64_t* dst_slots, int64_t num_moves, cudaStream_t stream);

// The library's ABI version; the Python loader refuses a library with another one.
int vtoken_relocate_kv_abi_version();
}
