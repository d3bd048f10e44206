// SPDX-License-Identifier: Apache-2.0
// H2O's prefill attention mass of one context row on x86 CPUs with AVX-512: the keys' scores with
// float32 sums, then one exact float32 softmax per query row and its column sums. The scores are
// products of the rows as they arrive:
//
//   bf16 rows       AMX-BF16 tiles, or AVX-512 BF16 pair dot products (as the attention's own
//                   kernels on these CPUs compute them)                   "amx", "avx512-bf16"
//   any other case  float32 FMAs over the rows converted (exactly) to float32: fp16 and float32
//                   rows, and bf16 rows on a CPU with AVX-512 but no BF16 "avx512"
//
// The specification is scores.prefill_attention_mass (Python); mass_torch.py is the portable
// pass. This one differs from them in how, not what: equal to float32 rounding (the suite checks
// it on random shapes, GQA groups, reused prefixes, windows and strided inputs).
//
// Every buffer lives in the caller's workspace (prefill_mass_workspace_bytes): the manager
// allocates it as one tensor, so its size is what the cap (mass_workspace_mib) bounds and what
// the estimation forward sees.
#pragma once

#include <cstdint>

namespace vtoken {

enum class Element { kBf16, kF16, kF32 };

// Rows of a [tokens, heads, head_dim] tensor of `element`s whose last dimension is contiguous:
// element [t, h, d] at data[t * token_stride + h * head_stride + d] (strides in elements).
struct Rows {
  const void* data = nullptr;
  int64_t token_stride = 0;
  int64_t head_stride = 0;
};

struct PrefillMassArgs {
  Element element = Element::kBf16;  // of q, k and past_k alike
  Rows q;       // [num_tokens, num_heads, head_dim]: the row's queries (rotated)
  Rows k;       // [num_tokens, num_kv_heads, head_dim]: the row's own keys
  Rows past_k;  // [num_past, num_kv_heads, head_dim]: keys before them (a reused prefix, earlier chunks)
  int64_t num_tokens = 0, num_past = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t first_query = 0;  // queries [first_query, num_tokens) observe (H2O's prefill window)
};

// What the pass scores rows of `element` with here: "amx", "avx512-bf16" or "avx512" (above), or
// nullptr where this CPU, OS or build runs none of them.
const char* prefill_mass_kind(Element element);

// Bytes of workspace the pass needs over num_keys keys of `element` with this many threads (at most
// one per KV head), for the kind prefill_mass_kind names; that of "avx512" where it names none.
int64_t prefill_mass_workspace_bytes(int64_t num_keys, int64_t num_kv_heads, int64_t head_dim, int64_t threads,
                                     Element element);

// mass[j] for j < num_past + num_tokens (overwritten): the sum over heads and observing queries
// of the query's softmax weight on key j. Threads take whole KV heads and the heads' sums are
// added in head order, so the result does not depend on the thread count. Throws
// std::invalid_argument (nothing written) for inconsistent shapes or a workspace smaller than
// prefill_mass_workspace_bytes, std::runtime_error where prefill_mass_kind is nullptr.
void prefill_mass(const PrefillMassArgs& args, uint8_t* workspace, int64_t workspace_bytes, int64_t threads,
                  float* mass);

}  // namespace vtoken
