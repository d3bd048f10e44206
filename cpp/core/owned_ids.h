// SPDX-License-Identifier: Apache-2.0
// The bindings' one way of handing a result vector to Python: a numpy array that owns the
// vector's buffer (no copy).
#pragma once

#include <cstdint>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

namespace vtoken {

template <typename T>
using Owned = nanobind::ndarray<nanobind::numpy, T, nanobind::ndim<1>>;
using OwnedIds = Owned<int64_t>;

template <typename T>
Owned<T> to_numpy(std::vector<T>&& values) {
  auto* owner = new std::vector<T>(std::move(values));
  nanobind::capsule free_when_done(owner, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return Owned<T>(owner->data(), {owner->size()}, free_when_done);
}

}  // namespace vtoken
