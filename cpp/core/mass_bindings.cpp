// SPDX-License-Identifier: Apache-2.0
// Python bindings of the C++ mass passes (prefill_mass.h, decode_mass.h): torch's tensors arrive
// through DLPack as they are (strided views of the pool included; nothing is copied or converted).
#include <optional>
#include <string>
#include <stdexcept>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "amx.h"
#include "decode_mass.h"
#include "prefill_mass.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using Rows = nb::ndarray<nb::ro, nb::ndim<3>, nb::device::cpu>;
using Workspace = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Mass = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Queries = nb::ndarray<nb::ro, nb::ndim<4>, nb::device::cpu>;
using Keys = nb::ndarray<nb::ro, nb::ndim<5>, nb::device::cpu>;
using Table = nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Longs = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using BatchMass = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

const nb::dlpack::dtype kBf16{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};

// The data of a bf16 operand of `pass` with a contiguous last dimension.
template <class Array>
const uint16_t* bf16_data(const Array& t, const char* pass, const char* name) {
  if (t.dtype() != kBf16) throw std::invalid_argument(std::string(pass) + ": " + name + " must be bfloat16");
  if (t.shape(t.ndim() - 1) > 1 && t.stride(t.ndim() - 1) != 1)
    throw std::invalid_argument(std::string(pass) + ": " + name + " needs a contiguous last dimension");
  return static_cast<const uint16_t*>(t.data());
}

const nb::dlpack::dtype kF16{static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
const nb::dlpack::dtype kF32{static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 32, 1};

// The prefill pass's element type of a dtype name ("bfloat16", "float16", "float32"; torch's names).
vtoken::Element element_named(const std::string& name) {
  if (name == "bfloat16") return vtoken::Element::kBf16;
  if (name == "float16") return vtoken::Element::kF16;
  if (name == "float32") return vtoken::Element::kF32;
  throw std::invalid_argument("prefill mass: dtype " + name + ": bfloat16, float16 or float32");
}

vtoken::Element element_of(const Rows& t, const char* name) {
  if (t.dtype() == kBf16) return vtoken::Element::kBf16;
  if (t.dtype() == kF16) return vtoken::Element::kF16;
  if (t.dtype() == kF32) return vtoken::Element::kF32;
  throw std::invalid_argument(std::string("prefill_mass: ") + name + " must be bfloat16, float16 or float32");
}

// The prefill pass's [tokens, heads, head_dim] rows of `element`s.
vtoken::Rows rows_of(const Rows& t, const char* name, vtoken::Element element, int64_t heads, int64_t head_dim) {
  if (element_of(t, name) != element)
    throw std::invalid_argument(std::string("prefill_mass: ") + name + " must have q's dtype");
  if (t.shape(2) > 1 && t.stride(2) != 1)
    throw std::invalid_argument(std::string("prefill_mass: ") + name + " needs a contiguous last dimension");
  if (static_cast<int64_t>(t.shape(1)) != heads || static_cast<int64_t>(t.shape(2)) != head_dim)
    throw std::invalid_argument(std::string("prefill_mass: ") + name + " must be [tokens, heads, head_dim]");
  return {t.data(), t.stride(0), t.stride(1)};
}

void bind_decode_mass(nb::module_& m) {
  m.def("decode_mass_bf16_applies", &vtoken::decode_mass_bf16_applies, "tokens_per_block"_a, "head_dim"_a,
        "Whether the bf16 decode pass takes this pool geometry (decode_mass.h).");
  m.def("decode_mass_workspace_bytes", &vtoken::decode_mass_workspace_bytes, "max_kv_len"_a, "tokens_per_block"_a,
        "head_dim"_a, "batch"_a, "threads"_a, "Bytes of workspace decode_mass_bf16 needs (decode_mass.h).");
  m.def(
      "decode_mass_bf16",
      [](Queries q, Keys keys, Table block_table, Longs kv_lens, Longs layers, Workspace workspace, int64_t threads,
         BatchMass mass) {
        vtoken::DecodeMassArgs a;
        a.q = bf16_data(q, "decode_mass_bf16", "q");
        a.keys = bf16_data(keys, "decode_mass_bf16", "keys");
        a.batch = static_cast<int64_t>(q.shape(0));
        a.num_layers = static_cast<int64_t>(q.shape(1));
        a.num_heads = static_cast<int64_t>(q.shape(2));
        a.head_dim = static_cast<int64_t>(q.shape(3));
        a.q_row_stride = q.stride(0), a.q_layer_stride = q.stride(1), a.q_head_stride = q.stride(2);
        a.num_pool_blocks = static_cast<int64_t>(keys.shape(0));
        a.num_pool_layers = static_cast<int64_t>(keys.shape(1));
        a.num_kv_heads = static_cast<int64_t>(keys.shape(2));
        a.tokens_per_block = static_cast<int64_t>(keys.shape(3));
        a.block_stride = keys.stride(0), a.layer_stride = keys.stride(1), a.kv_head_stride = keys.stride(2);
        a.token_stride = keys.stride(3);
        if (static_cast<int64_t>(keys.shape(4)) != a.head_dim)
          throw std::invalid_argument("decode_mass_bf16: keys and queries differ in head_dim");
        const auto rows = [](const auto& t) { return static_cast<int64_t>(t.shape(0)); };
        if (rows(block_table) != a.batch || rows(kv_lens) != a.batch || rows(layers) != a.num_layers ||
            rows(mass) != a.batch)
          throw std::invalid_argument("decode_mass_bf16: block_table, kv_lens and mass need a row per query row, "
                                      "layers a pool layer per query layer");
        a.block_table = block_table.data();
        a.table_width = static_cast<int64_t>(block_table.shape(1));
        a.kv_lens = kv_lens.data();
        a.layers = layers.data();
        nb::gil_scoped_release released;
        vtoken::decode_mass_bf16(a, workspace.data(), static_cast<int64_t>(workspace.shape(0)), threads, mass.data(),
                                 static_cast<int64_t>(mass.shape(1)));
      },
      "q"_a, "keys"_a, "block_table"_a, "kv_lens"_a, "layers"_a, "workspace"_a.noconvert(), "threads"_a,
      "mass"_a.noconvert(),
      "mass[b, j] = H2O's decode mass of row b's position j over the given layers, overwritten; decode_mass.h.");
}

void bind_prefill_mass(nb::module_& m) {
  m.def(
      "prefill_mass_kind",
      [](const std::string& dtype) -> std::optional<std::string> {
        const char* kind = vtoken::prefill_mass_kind(element_named(dtype));
        return kind ? std::optional<std::string>(kind) : std::nullopt;
      },
      "dtype"_a, "\"amx\", \"avx512-bf16\", \"avx512\" or None: what prefill_mass scores rows of this dtype "
      "with here (prefill_mass.h).");
  m.def(
      "prefill_mass_workspace_bytes",
      [](int64_t num_keys, int64_t num_kv_heads, int64_t head_dim, int64_t threads, const std::string& dtype) {
        return vtoken::prefill_mass_workspace_bytes(num_keys, num_kv_heads, head_dim, threads, element_named(dtype));
      },
      "num_keys"_a, "num_kv_heads"_a, "head_dim"_a, "threads"_a, "dtype"_a,
      "Bytes of workspace prefill_mass needs (prefill_mass.h).");
  m.def(
      "prefill_mass",
      [](Rows q, Rows k, std::optional<Rows> past_k, int64_t first_query, Workspace workspace, int64_t threads,
         Mass mass) {
        vtoken::PrefillMassArgs a;
        a.element = element_of(q, "q");
        a.num_tokens = static_cast<int64_t>(q.shape(0));
        a.num_heads = static_cast<int64_t>(q.shape(1));
        a.head_dim = static_cast<int64_t>(q.shape(2));
        a.num_kv_heads = static_cast<int64_t>(k.shape(1));
        a.num_past = past_k ? static_cast<int64_t>(past_k->shape(0)) : 0;
        a.first_query = first_query;
        a.q = rows_of(q, "q", a.element, a.num_heads, a.head_dim);
        a.k = rows_of(k, "k", a.element, a.num_kv_heads, a.head_dim);
        if (static_cast<int64_t>(k.shape(0)) != a.num_tokens)
          throw std::invalid_argument("prefill_mass: q and k must have the same number of tokens");
        if (a.num_past) a.past_k = rows_of(*past_k, "past_k", a.element, a.num_kv_heads, a.head_dim);
        if (static_cast<int64_t>(mass.shape(0)) != a.num_past + a.num_tokens)
          throw std::invalid_argument("prefill_mass: mass must hold one value per key");
        nb::gil_scoped_release released;
        vtoken::prefill_mass(a, workspace.data(), static_cast<int64_t>(workspace.shape(0)), threads, mass.data());
      },
      "q"_a, "k"_a, "past_k"_a.none(), "first_query"_a, "workspace"_a.noconvert(), "threads"_a,
      "mass"_a.noconvert(),
      "mass[j] = H2O's prefill mass of key j (past keys, then the row's own), overwritten; prefill_mass.h.");
}

}  // namespace

void bind_mass_passes(nb::module_& m) {
  m.def("amx_bf16_supported", &vtoken::amx_bf16_supported,
        "Whether this CPU has AMX-BF16 and AVX-512 BF16 and the OS grants the tile state (amx.h).");
  m.def(
      "bf16_mass_kind",
      []() -> std::optional<std::string> {
        const char* kind = vtoken::bf16_mass_kind();
        return kind ? std::optional<std::string>(kind) : std::nullopt;
      },
      "\"amx\", \"avx512-bf16\" or None: what the bf16 mass passes compute their scores with here (amx.h).");
  m.def(
      "limit_mass_isa",
      [](std::optional<std::string> most) -> std::optional<std::string> {
        const char* before = vtoken::limit_mass_isa(most ? most->c_str() : nullptr);
        return before ? std::optional<std::string>(before) : std::nullopt;
      },
      "most"_a.none(),
      "Sets the most the mass passes may use (\"amx\", \"avx512-bf16\", \"avx512\", \"none\"; None: "
      "$VTOKEN_MAX_CPU_ISA's) and returns the limit it replaced (None: the environment's); ValueError "
      "for another name, nothing changed (amx.h).");
  m.def("mass_isa_ceiling", &vtoken::mass_isa_ceiling,
        "The most the mass passes may use here: limit_mass_isa's, else $VTOKEN_MAX_CPU_ISA's, else \"amx\".");
  bind_prefill_mass(m);
  bind_decode_mass(m);
}
