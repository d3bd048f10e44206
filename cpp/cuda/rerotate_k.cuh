// SPDX-License-Identifier: Apache-2.0
// Re-rotating cached keys in a paged KV pool (position-shift mode), every layer and head, one launch.
//
// The pool is TensorRT-LLM's primary-pool layout, HND inside a block:
//
//     pool: [num_blocks, num_layers, 2 (K, V), num_kv_heads, tokens_per_block, head_dim]
//
// For each slot s (flat: block * tokens_per_block + offset) with shift d, the K vector of every
// (layer, head) is turned by the angle -d * inv_freq[i] on each rotating pair i; V is untouched:
//
//     element (slot, layer, head, j) = ((((block * num_layers + layer) * 2 + 0) * num_kv_heads + head)
//                                      * tokens_per_block + offset) * head_dim + j
//
// Pairs (rotary_dim <= head_dim; dimensions past rotary_dim are not touched):
//     style 0 "neox" (rotate_half, rope_gpt_neox): (j, j + rotary_dim / 2)
//     style 1 "gptj" (interleaved, rope_gptj):     (2j, 2j + 1)
//
// Arithmetic mirrors trtllm_vtoken.reclaim.rerotate.rerotate_slots, its Python specification:
// the angle d * inv_freq and its cosine and sine in double, each output as separately rounded
// double products and one sum (no fused multiply-add), then double -> float -> storage dtype.
// Results agree with the specification up to the last bit of the cosine and sine.
//
// Preconditions (the Python caller checks them): slots distinct, inside the pool; inv_freq holds
// rotary_dim / 2 floats on the device; the pool is contiguous and 2-byte aligned.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

extern "C" {

// dtype: 0 float32, 1 float16, 2 bfloat16. style: 0 neox, 1 gptj. Enqueues on `stream` and returns
// at once (cudaSuccess, cudaErrorInvalidValue for bad arguments, or the launch error).
cudaError_t vtoken_rerotate_k(void* pool, int dtype, int64_t num_layers, int64_t num_kv_heads,
                              int64_t tokens_per_block, int64_t head_dim, int64_t rotary_dim,
                              int style, const float* inv_freq, const int64_t* slots,
                              const int64_t* shifts, int64_t num_slots, cudaStream_t stream);
}
