// SPDX-License-Identifier: Apache-2.0
#pragma once
// The trace runners' transport (transport.hpp) for the memory of Kokkos' default execution space:
// index lists and outputs are copied per call, and every call is fenced.

#include <cstdint>
#include <span>

#include <Kokkos_Core.hpp>

#include "kvmem/core/tensor.hpp"

namespace kvmem::replay {

struct KokkosTransport {
  using MemSpace = Kokkos::DefaultExecutionSpace::memory_space;
  using IntView = Kokkos::View<std::int32_t*, MemSpace>;
  using FloatView = Kokkos::View<float*, MemSpace>;
  template <class T>
  using HostView = Kokkos::View<T*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

  static IntView list(std::span<const std::int32_t> x) {
    IntView d(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kvmem-replay list"), x.size());
    Kokkos::deep_copy(d, HostView<const std::int32_t>(x.data(), x.size()));
    return d;
  }
  static TensorView<const std::int32_t, 1> view(const IntView& d) { return {d.data(), {std::int64_t(d.extent(0))}}; }
  static FloatView output(std::span<float> x) { return FloatView("kvmem-replay output", x.size()); }
  static float* data(const FloatView& d) { return d.data(); }
  static void read_back(const FloatView& from, std::span<float> to) {
    Kokkos::deep_copy(HostView<float>(to.data(), to.size()), from);
  }
  template <class Exec>
  static void fence(const Exec& exec) {
    exec.space.fence();
  }
};

}  // namespace kvmem::replay
