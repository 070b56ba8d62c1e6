// SPDX-License-Identifier: Apache-2.0
#pragma once
// Shared helpers of the CUDA suites: skipping without a device (saying so), CUDA calls checked as test
// requirements, an owning device array with host round trips, and host copies in a storage type.
#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
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

// n values mean + spread * N(0, 1) from rng.
inline std::vector<float> normal(std::size_t n, std::mt19937_64& rng, float mean = 0.f, float spread = 1.f) {
  std::normal_distribution<float> n01(0.f, 1.f);
  std::vector<float> x(n);
  for (float& e : x) e = mean + spread * n01(rng);
  return x;
}

// n positive gate values 1 + elu(N(0, 1)) (spec KVM.md: g > 0).
inline std::vector<float> gates(std::size_t n, std::mt19937_64& rng) {
  std::vector<float> g = normal(n, rng);
  for (float& e : g) e = e > 0 ? 1.f + e : std::exp(e);
  return g;
}

}  // namespace kvmem::test::cuda
