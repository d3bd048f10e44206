// SPDX-License-Identifier: Apache-2.0
// Python bindings of the AMX prefill mass pass (prefill_mass.h): torch's bf16 tensors arrive
// through DLPack as they are (strided views included; nothing is copied or converted).
#include <optional>
#include <stdexcept>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>

#include "prefill_mass.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using Rows = nb::ndarray<nb::ro, nb::ndim<3>, nb::device::cpu>;
using Workspace = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Mass = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// [tokens, heads, head_dim] bf16 with a contiguous last dimension.
vtoken::Bf16Rows bf16_rows(const Rows& t, const char* name, int64_t heads, int64_t head_dim) {
  const nb::dlpack::dtype bf16{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
  if (t.dtype() != bf16) throw std::invalid_argument(std::string("prefill_mass_amx: ") + name + " must be bfloat16");
  if (static_cast<int64_t>(t.shape(1)) != heads || static_cast<int64_t>(t.shape(2)) != head_dim ||
      (t.shape(2) > 1 && t.stride(2) != 1)) {
    throw std::invalid_argument(std::string("prefill_mass_amx: ") + name +
                                " must be [tokens, heads, head_dim] with a contiguous last dimension");
  }
  return {static_cast<const uint16_t*>(t.data()), t.stride(0), t.stride(1)};
}

}  // namespace

void bind_prefill_mass(nb::module_& m) {
  m.def("prefill_mass_amx_supported", &vtoken::prefill_mass_amx_supported,
        "Whether this CPU has AMX-BF16 and AVX-512 BF16 and the OS grants the tile state.");
  m.def("prefill_mass_workspace_bytes", &vtoken::prefill_mass_workspace_bytes, "num_keys"_a, "num_kv_heads"_a,
        "head_dim"_a, "threads"_a, "Bytes of workspace prefill_mass_amx needs (prefill_mass.h).");
  m.def(
      "prefill_mass_amx",
      [](Rows q, Rows k, std::optional<Rows> past_k, int64_t first_query, Workspace workspace, int64_t threads,
         Mass mass) {
        vtoken::PrefillMassArgs a;
        a.num_tokens = static_cast<int64_t>(q.shape(0));
        a.num_heads = static_cast<int64_t>(q.shape(1));
        a.head_dim = static_cast<int64_t>(q.shape(2));
        a.num_kv_heads = static_cast<int64_t>(k.shape(1));
        a.num_past = past_k ? static_cast<int64_t>(past_k->shape(0)) : 0;
        a.first_query = first_query;
        a.q = bf16_rows(q, "q", a.num_heads, a.head_dim);
        a.k = bf16_rows(k, "k", a.num_kv_heads, a.head_dim);
        if (static_cast<int64_t>(k.shape(0)) != a.num_tokens)
          throw std::invalid_argument("prefill_mass_amx: q and k must have the same number of tokens");
        if (a.num_past) a.past_k = bf16_rows(*past_k, "past_k", a.num_kv_heads, a.head_dim);
        if (static_cast<int64_t>(mass.shape(0)) != a.num_past + a.num_tokens)
          throw std::invalid_argument("prefill_mass_amx: mass must hold one value per key");
        nb::gil_scoped_release released;
        vtoken::prefill_mass_amx(a, workspace.data(), static_cast<int64_t>(workspace.shape(0)), threads,
                                 mass.data());
      },
      "q"_a, "k"_a, "past_k"_a.none(), "first_query"_a, "workspace"_a.noconvert(), "threads"_a,
      "mass"_a.noconvert(),
      "mass[j] = H2O's prefill mass of key j (past keys, then the row's own), overwritten; prefill_mass.h.");
}
