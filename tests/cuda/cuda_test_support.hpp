// SPDX-License-Identifier: Apache-2.0
#pragma once
// Shared helpers of the CUDA suites: skipping without a device (saying so), CUDA calls checked as test
// requirements, an owning device array with host round trips, and host copies in a storage type.
#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cstddef>
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/backend/cuda/common.cuh"
#include "kvmem/core/numeric.hpp"

namespace kvmem::test::cuda {

// True (and a "SKIPPED:" warning that ctest reports as a skip) when no CUDA device is visible.
inline bool no_device() {
  if (kvmem::cuda::device_count() > 0) return false;
  WARN("SKIPPED: no CUDA device visible; the gpu suite needs one (CI compiles it only)");
  return true;
}

#define KVMEM_CUDA_REQUIRE(expr) REQUIRE(::kvmem::cuda::to_status((expr), #expr).to_string() == "ok")

// Owning device array of n elements (at least one allocated), filled from / copied back to the host.
template <class T>
struct Dev {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit Dev(std::size_t count) : n(count) {
    KVMEM_CUDA_REQUIRE(cudaMalloc(&ptr, std::max<std::size_t>(1, n) * sizeof(T)));
  }
  explicit Dev(const std::vector<T>& host) : Dev(host.size()) {
    KVMEM_CUDA_REQUIRE(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() { (void)cudaFree(ptr); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    KVMEM_CUDA_REQUIRE(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

// x stored in S (float, bf16, fp16), element by element.
template <class S>
std::vector<S> as_storage(const std::vector<float>& x) {
  std::vector<S> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = kvmem::store_as<S>(x[i]);
  return y;
}

}  // namespace kvmem::test::cuda
