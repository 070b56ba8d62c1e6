// SPDX-License-Identifier: Apache-2.0
#pragma once
// A strided pointer that kernels index: what a kvmem::TensorView describes, reduced to plain
// members and KOKKOS_INLINE_FUNCTION accessors, so no std::array (a constexpr host type) is touched
// in device code (DESIGN.md 4: constexpr host functions are not callable from CUDA kernels).

#include <cstddef>
#include <cstdint>

#include <Kokkos_Core.hpp>

#include "kvmem/core/tensor.hpp"

namespace kvmem::kokkos::detail {

template <class T, std::size_t Rank>
struct DeviceView {
  T* data = nullptr;
  std::int64_t extent[Rank] = {};
  std::int64_t stride[Rank] = {};

  DeviceView() = default;
  template <class U>
  explicit DeviceView(const TensorView<U, Rank>& v) : data(v.data()) {
    for (std::size_t i = 0; i < Rank; ++i) {
      extent[i] = v.extent(i);
      stride[i] = v.stride(i);
    }
  }
  KOKKOS_INLINE_FUNCTION T& operator()(std::int64_t a) const { return data[a * stride[0]]; }
  KOKKOS_INLINE_FUNCTION T& operator()(std::int64_t a, std::int64_t b) const {
    return data[a * stride[0] + b * stride[1]];
  }
  KOKKOS_INLINE_FUNCTION T& operator()(std::int64_t a, std::int64_t b, std::int64_t c) const {
    return data[a * stride[0] + b * stride[1] + c * stride[2]];
  }
  KOKKOS_INLINE_FUNCTION T& operator()(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) const {
    return data[a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3]];
  }
};

// x - x is 0 for finite x and NaN for +-inf and NaN: a finiteness test without std::isfinite, which
// is host-only in some device toolchains and moved namespaces between Kokkos 3 and 4.
KOKKOS_INLINE_FUNCTION bool finite(double x) {
  return x - x == 0.0;
}

}  // namespace kvmem::kokkos::detail
