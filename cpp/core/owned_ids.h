// SPDX-License-Identifier: Apache-2.0
// The bindings' one way of handing a result vector to Python: a numpy array that owns the
// vector's buffer (no copy).
#pragma once

#include <cstdint>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

namespace vtoken {

using OwnedIds = nanobind::ndarray<nanobind::numpy, int64_t, nanobind::ndim<1>>;

inline OwnedIds to_numpy(std::vector<int64_t>&& values) {
  auto* owner = new std::vector<int64_t>(std::move(values));
  nanobind::capsule free_when_done(owner, [](void* p) noexcept { delete static_cast<std::vector<int64_t>*>(p); });
  return OwnedIds(owner->data(), {owner->size()}, free_when_done);
}

}  // namespace vtoken
