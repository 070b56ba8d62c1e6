// SPDX-License-Identifier: Apache-2.0
#pragma once
// Shared pieces of the CUDA benchmarks: fail-fast checks (a benchmark has no caller to return a Status
// to), deterministic pseudo-random fills on the device (no cuRAND dependency), and a typed device buffer.
#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "kvmem/core/status.hpp"

#define CHECK_CUDA(expr)                                                        \
  do {                                                                          \
    const cudaError_t err_ = (expr);                                            \
    if (err_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(err_)); \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)
#define CHECK_STATUS(expr)                                                     \
  do {                                                                         \
    const kvmem::Status st_ = (expr);                                          \
    if (!st_.is_ok()) {                                                        \
      std::fprintf(stderr, "%s failed: %s\n", #expr, st_.to_string().c_str()); \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

namespace kvmem::bench {

// Unit-variance noise from a hash of (index, seed): the sum of four uniforms, centred and scaled.
__device__ inline float hash_normal(std::uint64_t i, std::uint64_t seed) {
  std::uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  float s = 0;
  for (int r = 0; r < 4; ++r) {
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    s += float(h >> 40) / float(1ull << 24);
  }
  return (s - 2.0f) * 1.7320508f;
}

template <class T>
__global__ void fill_kernel(T* x, std::int64_t n, std::uint64_t seed, float mean, float sd) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x)
    x[i] = T(mean + sd * hash_normal(std::uint64_t(i), seed));
}

// x[i] ~ mean + sd * N(0,1)-like, deterministic in (i, seed).
template <class T>
void fill(T* x, std::int64_t n, std::uint64_t seed, float mean = 0, float sd = 1) {
  fill_kernel<<<1024, 256>>>(x, n, seed, mean, sd);
  CHECK_CUDA(cudaGetLastError());
}

template <class T>
struct Buffer {
  T* ptr = nullptr;
  explicit Buffer(std::size_t n) { CHECK_CUDA(cudaMalloc(&ptr, std::max<std::size_t>(n, 1) * sizeof(T))); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { (void)cudaFree(ptr); }
};

// Milliseconds per call of a step (a callable returning a kvmem::Status, enqueued on `stream`): plain,
// after 4 warm-up calls, over steps - 4 calls (steps >= 8); and replayed `steps` times from one CUDA graph
// captured from a single call.
struct StepTimes {
  double plain_ms, graph_ms;
};
template <class Step>
StepTimes time_plain_and_graph(cudaStream_t stream, std::int64_t steps, const Step& step) {
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  const auto elapsed = [&] {
    CHECK_CUDA(cudaEventRecord(e1, stream));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    return double(ms);
  };
  for (int i = 0; i < 4; ++i) CHECK_STATUS(step());
  const std::int64_t plain_steps = steps - 4;
  CHECK_CUDA(cudaEventRecord(e0, stream));
  for (std::int64_t i = 0; i < plain_steps; ++i) CHECK_STATUS(step());
  const double plain = elapsed() / double(plain_steps);
  cudaGraph_t graph;
  cudaGraphExec_t instance;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  CHECK_STATUS(step());
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&instance, graph, 0));
  CHECK_CUDA(cudaEventRecord(e0, stream));
  for (std::int64_t i = 0; i < steps; ++i) CHECK_CUDA(cudaGraphLaunch(instance, stream));
  const double replay = elapsed() / double(steps);
  CHECK_CUDA(cudaGraphExecDestroy(instance));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  return {plain, replay};
}

}  // namespace kvmem::bench
