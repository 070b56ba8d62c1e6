// SPDX-License-Identifier: Apache-2.0
#pragma once
// Shared CUDA infrastructure: the executor (a stream), CUDA errors turned into kvmem::Status, an
// owning device buffer, and device discovery for tests that must skip cleanly without a GPU.
// Compiled by nvcc or hipcc (vendor.cuh); the .cuh headers are not part of the dependency-free umbrella
// header.

#include "kvmem/backend/cuda/vendor.cuh"

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"

namespace kvmem::cuda {

// Executor of the CUDA backend (DESIGN.md 3): work is enqueued on `stream` and never synchronised
// inside an operation, so an engine can overlap it or capture it in a CUDA graph.
struct Executor {
  cudaStream_t stream = nullptr;
};

inline Status to_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::ok();
  return {StatusCode::kBackendError,
          std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")"};
}

// Number of visible CUDA devices (0 when there is no driver or no device).
inline int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}

// Multiprocessors of the current device (launch shapes are sized from it).
inline Status current_sm_count(int& out) {
  int device = 0;
  KVMEM_RETURN_IF_ERROR(to_status(cudaGetDevice(&device), "cudaGetDevice"));
  return to_status(cudaDeviceGetAttribute(&out, cudaDevAttrMultiProcessorCount, device),
                   "cudaDeviceGetAttribute(multiprocessor count)");
}

// Owning device allocation. Move-only; frees on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  ~DeviceBuffer() { release(); }

  static Status allocate(std::size_t bytes, DeviceBuffer& out) {
    DeviceBuffer b;
    if (bytes > 0) KVMEM_RETURN_IF_ERROR(to_status(cudaMalloc(&b.ptr_, bytes), "cudaMalloc"));
    b.bytes_ = bytes;
    out = std::move(b);
    return Status::ok();
  }
  [[nodiscard]] void* get() const { return ptr_; }
  [[nodiscard]] std::size_t bytes() const { return bytes_; }

 private:
  void release() {
    if (ptr_) (void)cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// Opts a kernel into `bytes` of dynamic shared memory where its blocks would otherwise exceed the default
// 48 KB a block may use without opting in, which counts the kernel's static shared memory too (a launch
// past it fails with an invalid-value error).
template <class Kernel>
Status allow_shared(Kernel kernel, std::size_t bytes) {
  constexpr std::size_t kDefaultShared = 48 * 1024;
  if (bytes == 0) return Status::ok();
  cudaFuncAttributes attributes{};
  KVMEM_RETURN_IF_ERROR(
      to_status(cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel)), "cudaFuncGetAttributes"));
  if (attributes.sharedSizeBytes + bytes <= kDefaultShared) return Status::ok();
  return to_status(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
                   "cudaFuncSetAttribute(max dynamic shared memory)");
}

// Every innermost row of the view starts on a 16-byte boundary (aligned base, every outer stride a
// whole number of 16-byte vectors), so kernels may move its rows as uint4 / cp.async vectors. Checked
// on the host once per call.
template <class T, std::size_t Rank>
bool rows_16byte_aligned(const TensorView<T, Rank>& view) {
  if (reinterpret_cast<std::uintptr_t>(view.data()) % 16 != 0) return false;
  for (std::size_t i = 0; i + 1 < Rank; ++i)
    if ((view.stride(i) * std::int64_t(sizeof(T))) % 16 != 0) return false;
  return true;
}

}  // namespace kvmem::cuda

// Launch check: a bad configuration surfaces at the launch, a fault later at a synchronisation.
#define KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED(what) \
  KVMEM_RETURN_IF_ERROR(::kvmem::cuda::to_status(cudaGetLastError(), what))
