// SPDX-License-Identifier: Apache-2.0
#pragma once
// The trace runners' transport (transport.hpp) for the CUDA backend: index lists and outputs are copied
// into device memory per call, outputs are copied back, and fence waits for the executor's stream; and
// the device arrays the CUDA adapters of run_kvm.hpp and run_ua.hpp keep their inputs in. Compiled by
// nvcc (kvmem_replay_cuda.cu).
//
// Every copy here is a blocking runtime call on the legacy default stream, which is the stream the
// runners' executor (cuda::Executor{}) enqueues on: a list is on the device before the call that reads
// it is enqueued, and a read-back waits for the work that writes the output. Every CUDA call is checked;
// a failure throws kvmem::Error carrying CUDA's name and text of the error (kvmem_replay.cpp prints it
// as one line and exits 2).

#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "replay_core.hpp"

#include "kvmem/backend/cuda/common.cuh"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"

namespace kvmem::replay {

// Throws kvmem::Error (backend error: what, CUDA's error name and text) unless err is cudaSuccess.
inline void cuda_check(cudaError_t err, const char* what) {
  throw_if_error(cuda::to_status(err, what));
}

// Refuses the CUDA backend, with the runtime's reason, where no CUDA device is visible (no driver, no
// device): a bad environment for this run, said in one line before anything is allocated.
inline void require_cuda_device() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky error
    throw BadInput(std::string("backend cuda: no CUDA device is visible (cudaGetDeviceCount: ") +
                   cudaGetErrorName(err) + ", " + cudaGetErrorString(err) + ")");
  }
  if (count == 0) throw BadInput("backend cuda: no CUDA device is visible (cudaGetDeviceCount found none)");
}

// An owning array of n values of T in device memory (one element allocated at least, so that an empty
// list still has a valid pointer). Move-only; freed on destruction.
template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(std::size_t n) : n_(n) {
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, std::max<std::size_t>(1, n) * sizeof(T)), "kvmem-replay cudaMalloc");
    ptr_ = static_cast<T*>(p);
  }
  // A device copy of `host`.
  explicit DeviceArray(std::span<const T> host) : DeviceArray(host.size()) {
    if (!host.empty())
      cuda_check(cudaMemcpy(ptr_, host.data(), host.size_bytes(), cudaMemcpyHostToDevice),
                 "kvmem-replay copy to the device");
  }
  DeviceArray(DeviceArray&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    if (this != &o) {
      release();
      ptr_ = std::exchange(o.ptr_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { release(); }

  [[nodiscard]] T* data() const { return ptr_; }
  [[nodiscard]] std::size_t size() const { return n_; }
  [[nodiscard]] bool empty() const { return n_ == 0; }

 private:
  void release() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);  // a destructor reports nothing; the pointer is ours
    ptr_ = nullptr;
    n_ = 0;
  }
  T* ptr_ = nullptr;
  std::size_t n_ = 0;
};

// A device copy of float values stored in S (float, bf16), element by element: the trace's inputs in
// the element type the CUDA calls take (q, k, v and the KVM gate in the storage type).
template <class S>
DeviceArray<S> to_device_as(std::span<const float> x) {
  if constexpr (std::is_same_v<S, float>) {
    return DeviceArray<float>(x);
  } else {
    std::vector<S> y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = store_as<S>(x[i]);
    return DeviceArray<S>(std::span<const S>(y));
  }
}

// n zeroed floats in device memory.
inline DeviceArray<float> zeroed_device_floats(std::size_t n) {
  DeviceArray<float> d(n);
  cuda_check(cudaMemset(d.data(), 0, std::max<std::size_t>(1, n) * sizeof(float)), "kvmem-replay zeroed buffer");
  return d;
}

struct CudaTransport {
  using IntArray = DeviceArray<std::int32_t>;
  using FloatArray = DeviceArray<float>;

  static IntArray list(std::span<const std::int32_t> x) { return IntArray(x); }
  static TensorView<const std::int32_t, 1> view(const IntArray& d) { return {d.data(), {std::int64_t(d.size())}}; }
  // Zeroed, as the host buffers are, so a value the backend does not write reads back as 0.
  static FloatArray output(std::span<float> x) { return zeroed_device_floats(x.size()); }
  static float* data(const FloatArray& d) { return d.data(); }
  static void read_back(const FloatArray& from, std::span<float> to) {
    if (!to.empty())
      cuda_check(cudaMemcpy(to.data(), from.data(), to.size_bytes(), cudaMemcpyDeviceToHost),
                 "kvmem-replay copy to the host");
  }
  template <class Exec>
  static void fence(const Exec& exec) {
    cuda_check(cudaStreamSynchronize(exec.stream), "kvmem-replay stream synchronize");
  }
};

}  // namespace kvmem::replay
