// SPDX-License-Identifier: Apache-2.0
#pragma once
// The compile-time limits of the CUDA backend's kernels (core/support.hpp), for composed variants with a
// fixed head dimension. They state what the run-time checks of the CUDA backend refuse
// (kUnsupported, docs/errors.md): UA head_dim <= 256 (cuda::UaCache::create), KVM value head dim <= 256
// (kvm::step's slot readout: 32 lanes x 8 registers), accumulation fp32 (the weights are fp32).
// Plain C++ (no CUDA header), so a translation unit can check a variant without nvcc.

#include <cstdint>

#include "kvmem/core/support.hpp"

namespace kvmem::cuda {
struct Executor;
}  // namespace kvmem::cuda

namespace kvmem {

template <>
struct BackendLimits<cuda::Executor> {
  static constexpr const char* kName = "cuda";
  static constexpr std::int64_t kMaxKvmKeyDim = 0;
  static constexpr std::int64_t kMaxKvmValueDim = 256;
  static constexpr std::int64_t kMaxUaHeadDim = 256;
  static constexpr bool kKvmFp64Accumulate = false;
  static constexpr bool kUaFp8 = true;   // e4m3 rows, bf16 inputs
  static constexpr bool kKvmFp8 = true;  // KvmState<e4m3>: e4m3 readout rows, bf16 window
};

}  // namespace kvmem
