// SPDX-License-Identifier: Apache-2.0
#pragma once
// Non-owning tensor views over caller memory: a pointer, extents and strides (in elements).
// Views never allocate and never own; operations check their shapes against the problem with
// check_shape(), which names the argument and both shapes in its message.

#include <array>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>

#include "kvmem/core/config.hpp"
#include "kvmem/core/status.hpp"

namespace kvmem {

template <std::size_t Rank>
using Extents = std::array<std::int64_t, Rank>;

// "[2,4,16]"
template <std::size_t Rank>
std::string shape_string(const Extents<Rank>& extents) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < Rank; ++i) out << (i ? "," : "") << extents[i];
  out << ']';
  return out.str();
}

template <std::size_t Rank>
constexpr Extents<Rank> row_major_strides(const Extents<Rank>& extents) {
  Extents<Rank> strides{};
  std::int64_t step = 1;
  for (std::size_t i = Rank; i-- > 0;) {
    strides[i] = step;
    step *= extents[i];
  }
  return strides;
}

template <class T, std::size_t Rank>
class TensorView {
 public:
  using value_type = std::remove_cv_t<T>;
  static constexpr std::size_t kRank = Rank;

  constexpr TensorView() = default;
  // Row-major contiguous view.
  constexpr TensorView(T* data, const Extents<Rank>& extents)
      : data_(data), extents_(extents), strides_(row_major_strides(extents)) {}
  constexpr TensorView(T* data, const Extents<Rank>& extents, const Extents<Rank>& strides)
      : data_(data), extents_(extents), strides_(strides) {}

  // Checked construction: rejects a null pointer for a non-empty view and negative extents or
  // strides, naming `name` in the message. On failure `out` is left unchanged.
  static Status create(T* data, const Extents<Rank>& extents, const Extents<Rank>& strides, const std::string& name,
                       TensorView& out) {
    std::int64_t elements = 1;
    for (std::size_t i = 0; i < Rank; ++i) {
      if (extents[i] < 0) return invalid_argument(name + " extents", "non-negative extents", shape_string(extents));
      if (strides[i] < 0) return invalid_argument(name + " strides", "non-negative strides", shape_string(strides));
      elements *= extents[i];
    }
    if (elements > 0 && data == nullptr)
      return invalid_argument(name, "a non-null pointer for shape " + shape_string(extents), "nullptr");
    out = TensorView(data, extents, strides);
    return Status::ok();
  }

  KVMEM_HOST_DEVICE constexpr T* data() const noexcept { return data_; }
  KVMEM_HOST_DEVICE constexpr std::int64_t extent(std::size_t i) const noexcept { return extents_[i]; }
  KVMEM_HOST_DEVICE constexpr std::int64_t stride(std::size_t i) const noexcept { return strides_[i]; }
  constexpr const Extents<Rank>& extents() const noexcept { return extents_; }
  constexpr const Extents<Rank>& strides() const noexcept { return strides_; }

  KVMEM_HOST_DEVICE constexpr std::int64_t size() const noexcept {
    std::int64_t n = 1;
    for (std::size_t i = 0; i < Rank; ++i) n *= extents_[i];
    return n;
  }
  KVMEM_HOST_DEVICE constexpr bool empty() const noexcept { return size() == 0; }

  constexpr bool is_contiguous() const noexcept { return strides_ == row_major_strides(extents_); }

  template <class... Index>
  requires(sizeof...(Index) == Rank && (std::is_integral_v<Index> && ...)) KVMEM_HOST_DEVICE constexpr std::int64_t
      offset(Index... index) const noexcept {
    const std::int64_t idx[] = {static_cast<std::int64_t>(index)...};
    std::int64_t off = 0;
    for (std::size_t i = 0; i < Rank; ++i) off += idx[i] * strides_[i];
    return off;
  }

  template <class... Index>
  requires(sizeof...(Index) == Rank && (std::is_integral_v<Index> && ...)) KVMEM_HOST_DEVICE constexpr T& operator()(
      Index... index) const noexcept {
    return data_[offset(index...)];
  }

  // Implicit conversion to a view of const elements. A template, so that TensorView<const T> does
  // not declare a conversion to its own type (nvcc warns about that even when it is constrained out).
  template <class U = T>
  requires(!std::is_const_v<U>) constexpr operator TensorView<const U, Rank>() const noexcept {
    return TensorView<const U, Rank>(data_, extents_, strides_);
  }

 private:
  T* data_ = nullptr;
  Extents<Rank> extents_{};
  Extents<Rank> strides_{};
};

// Checks that `view` has exactly `expected` extents; the message names the argument and both shapes.
template <class T, std::size_t Rank>
// The name is a view, so a check that passes builds no string (steps do not allocate, DESIGN.md 3).
Status check_shape(const TensorView<T, Rank>& view, const Extents<Rank>& expected, std::string_view name) {
  if (view.extents() != expected)
    return invalid_argument(std::string(name) + " shape", shape_string(expected), shape_string(view.extents()));
  if (view.size() > 0 && view.data() == nullptr)
    return invalid_argument(std::string(name), "a non-null pointer", "nullptr");
  return Status::ok();
}

}  // namespace kvmem
