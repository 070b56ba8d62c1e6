// SPDX-License-Identifier: Apache-2.0
#pragma once
// How a trace runner (trace.hpp's SlotRunner) gets a call's index lists (rows, slot lists) and outputs
// into a backend's memory and back, and waits for the work the backend queued, so that host buffers
// are ready when a call returns. HostTransport: host memory, used as it is (nothing to copy, nothing to
// wait for); transport_kokkos.hpp has the one for Kokkos' default execution space. The runners in
// run_kvm.hpp and run_ua.hpp are written once over a transport.

#include <cstdint>
#include <span>

#include "kvmem/core/tensor.hpp"

namespace kvmem::replay {

struct HostTransport {
  static std::span<const std::int32_t> list(std::span<const std::int32_t> x) { return x; }
  static TensorView<const std::int32_t, 1> view(std::span<const std::int32_t> x) {
    return {x.data(), {std::int64_t(x.size())}};
  }
  static std::span<float> output(std::span<float> x) { return x; }
  static float* data(std::span<float> x) { return x.data(); }
  static void read_back(std::span<float> /*from*/, std::span<float> /*to*/) {}
  template <class Exec>
  static void fence(const Exec& /*exec*/) {}
};

}  // namespace kvmem::replay
