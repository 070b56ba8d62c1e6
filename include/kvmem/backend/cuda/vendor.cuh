// SPDX-License-Identifier: Apache-2.0
#pragma once
// One GPU backend source, two vendors: the .cuh files of backend/cuda compile with nvcc (NVIDIA) and
// with hipcc (AMD, ROCm) from this header's mapping, with no vendor test in the kernels themselves.
//
// - The runtime API: the sources call the CUDA runtime by its names (cudaMalloc, cudaStream_t,
//   cudaGraphLaunch, ...); under hipcc the names below are macros for the HIP runtime's equivalents.
//   A file that includes this header under hipcc therefore sees `cudaMalloc` as `hipMalloc`.
// - Warp-level primitives with a compile-time warp size: kWarpSize lanes (32 on NVIDIA, 64 on CDNA),
//   LaneMask (one bit per lane) and the shuffles, ballots and lane-mask counts over a full warp. Kernels
//   never name 32 or a 32-bit mask: a reduction over a warp runs its xor offsets from kWarpSize / 2.
// - The path switch: KVMEM_GPU_VENDOR_PATHS is 1 where the NVIDIA-only instruction paths are compiled
//   (tensor cores: mma.sync, wgmma, ldmatrix; cp.async; thread-block clusters; programmatic dependent
//   launch) and 0 on the portable path, which every kernel has: always under hipcc, and under nvcc with
//   KVMEM_CUDA_PORTABLE defined to 1 (CMake option KVMEM_CUDA_PORTABLE), so the portable code hipcc
//   compiles is the code an NVIDIA GPU can test.
// - The AMD switch: KVMEM_GPU_MFMA_PATHS is 1 under hipcc, where the attention and routing tiles run on
//   the matrix cores (MFMA, gfx90a and gfx94x: mfma_layout.hpp), unless KVMEM_HIP_PORTABLE is defined to
//   1 (CMake option KVMEM_HIP_PORTABLE), which keeps every kernel on the portable path. Never 1 under nvcc.

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#define KVMEM_GPU_HIP 1
#include <hip/hip_runtime.h>
#else
#define KVMEM_GPU_HIP 0
#include <cuda_runtime.h>
#endif

#if KVMEM_GPU_HIP || (defined(KVMEM_CUDA_PORTABLE) && KVMEM_CUDA_PORTABLE)
#define KVMEM_GPU_VENDOR_PATHS 0
#else
#define KVMEM_GPU_VENDOR_PATHS 1
#endif

#if KVMEM_GPU_HIP && !(defined(KVMEM_HIP_PORTABLE) && KVMEM_HIP_PORTABLE)
#define KVMEM_GPU_MFMA_PATHS 1
#else
#define KVMEM_GPU_MFMA_PATHS 0
#endif

#include <cstdint>

#if KVMEM_GPU_HIP
// ---- the CUDA runtime names the backend, its tests and its benchmarks use, as HIP's --------------
#define cudaError_t hipError_t
#define cudaSuccess hipSuccess
#define cudaErrorNotReady hipErrorNotReady
#define cudaGetErrorName hipGetErrorName
#define cudaGetErrorString hipGetErrorString
#define cudaGetLastError hipGetLastError
#define cudaGetDeviceCount hipGetDeviceCount
#define cudaGetDevice hipGetDevice
#define cudaGetDeviceProperties hipGetDeviceProperties
#define cudaDeviceProp hipDeviceProp_t
#define cudaDeviceGetAttribute hipDeviceGetAttribute
#define cudaDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define cudaDeviceSynchronize hipDeviceSynchronize
#define cudaDeviceGetStreamPriorityRange hipDeviceGetStreamPriorityRange
#define cudaFuncSetAttribute hipFuncSetAttribute
#define cudaFuncGetAttributes hipFuncGetAttributes
#define cudaFuncAttributes hipFuncAttributes
#define cudaFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define cudaMalloc hipMalloc
#define cudaFree hipFree
#define cudaHostAlloc hipHostMalloc
#define cudaHostAllocMapped hipHostMallocMapped
#define cudaHostGetDevicePointer hipHostGetDevicePointer
#define cudaFreeHost hipHostFree
#define cudaMemGetInfo hipMemGetInfo
#define cudaMemcpy hipMemcpy
#define cudaMemcpyAsync hipMemcpyAsync
#define cudaMemcpyHostToDevice hipMemcpyHostToDevice
#define cudaMemcpyDeviceToHost hipMemcpyDeviceToHost
#define cudaMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define cudaMemset hipMemset
#define cudaMemsetAsync hipMemsetAsync
#define cudaMemset2DAsync hipMemset2DAsync
#define cudaMemcpy2DAsync hipMemcpy2DAsync
#define cudaStream_t hipStream_t
#define cudaStreamCreate hipStreamCreate
#define cudaStreamCreateWithFlags hipStreamCreateWithFlags
#define cudaStreamCreateWithPriority hipStreamCreateWithPriority
#define cudaStreamNonBlocking hipStreamNonBlocking
#define cudaStreamDestroy hipStreamDestroy
#define cudaStreamSynchronize hipStreamSynchronize
#define cudaStreamQuery hipStreamQuery
#define cudaStreamWaitEvent hipStreamWaitEvent
#define cudaStreamBeginCapture hipStreamBeginCapture
#define cudaStreamEndCapture hipStreamEndCapture
#define cudaStreamCaptureModeThreadLocal hipStreamCaptureModeThreadLocal
#define cudaEvent_t hipEvent_t
#define cudaEventCreate hipEventCreate
#define cudaEventCreateWithFlags hipEventCreateWithFlags
#define cudaEventDisableTiming hipEventDisableTiming
#define cudaEventDestroy hipEventDestroy
#define cudaEventRecord hipEventRecord
#define cudaEventSynchronize hipEventSynchronize
#define cudaEventElapsedTime hipEventElapsedTime
#define cudaGraph_t hipGraph_t
#define cudaGraphExec_t hipGraphExec_t
#define cudaGraphLaunch hipGraphLaunch
#define cudaGraphDestroy hipGraphDestroy
#define cudaGraphExecDestroy hipGraphExecDestroy
// CUDA 12's three-argument form (flags 0 in kvmem's callers); HIP's takes an error node and a log.
#define cudaGraphInstantiate(exec, graph, flags) hipGraphInstantiate((exec), (graph), nullptr, nullptr, 0)
// An upload ahead of the first launch is an optimisation; HIP 5.2 has none and uploads at the launch.
#define cudaGraphUpload(exec, stream) ((void)(exec), (void)(stream), hipSuccess)
// CUDA's signed 64-bit atomicMin, which HIP 5.2 lacks (it has the unsigned one).
__device__ inline long long atomicMin(long long* address, long long value) {
  return __hip_atomic_fetch_min(address, value, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
#endif  // KVMEM_GPU_HIP

namespace kvmem::cuda {

// ---- warps -------------------------------------------------------------------------------------
#if KVMEM_GPU_HIP
// A CDNA wavefront (gfx90a, gfx94x: the targets kvmem builds for; RDNA's wave32 mode is not one).
inline constexpr int kWarpSize = 64;
using LaneMask = unsigned long long;
#else
inline constexpr int kWarpSize = 32;
using LaneMask = unsigned;
#endif
static_assert(int(sizeof(LaneMask)) * 8 == kWarpSize, "one LaneMask bit per lane of a warp");
inline constexpr LaneMask kFullWarp = ~LaneMask(0);
// Whether the NVIDIA-only instruction paths are compiled (KVMEM_GPU_VENDOR_PATHS), for host dispatch.
inline constexpr bool kVendorPaths = KVMEM_GPU_VENDOR_PATHS != 0;
// Whether the AMD matrix-core tiles are compiled (KVMEM_GPU_MFMA_PATHS), for host dispatch; the shapes
// they take are those of the NVIDIA tensor-core kernels, so a dispatch tests kMatrixPaths for both.
inline constexpr bool kMfmaPaths = KVMEM_GPU_MFMA_PATHS != 0;
inline constexpr bool kMatrixPaths = kVendorPaths || kMfmaPaths;

// Shuffles over every lane of a warp (all lanes must reach them); `width` splits the warp into
// independent groups of that many lanes, as CUDA's and HIP's own shuffles do.
template <class T>
__device__ inline T warp_shfl(T v, int src_lane, int width = kWarpSize) {
#if KVMEM_GPU_HIP
  return __shfl(v, src_lane, width);
#else
  return __shfl_sync(kFullWarp, v, src_lane, width);
#endif
}
template <class T>
__device__ inline T warp_shfl_xor(T v, int lane_mask, int width = kWarpSize) {
#if KVMEM_GPU_HIP
  return __shfl_xor(v, lane_mask, width);
#else
  return __shfl_xor_sync(kFullWarp, v, lane_mask, width);
#endif
}
template <class T>
__device__ inline T warp_shfl_up(T v, unsigned delta, int width = kWarpSize) {
#if KVMEM_GPU_HIP
  return __shfl_up(v, delta, width);
#else
  return __shfl_up_sync(kFullWarp, v, delta, width);
#endif
}
template <class T>
__device__ inline T warp_shfl_down(T v, unsigned delta, int width = kWarpSize) {
#if KVMEM_GPU_HIP
  return __shfl_down(v, delta, width);
#else
  return __shfl_down_sync(kFullWarp, v, delta, width);
#endif
}
// Bit l set where lane l's predicate holds.
__device__ inline LaneMask warp_ballot(bool pred) {
#if KVMEM_GPU_HIP
  return __ballot(pred);
#else
  return __ballot_sync(kFullWarp, pred);
#endif
}
__device__ inline bool warp_any(bool pred) {
#if KVMEM_GPU_HIP
  return __any(pred);
#else
  return __any_sync(kFullWarp, pred);
#endif
}
__device__ inline bool warp_all(bool pred) {
#if KVMEM_GPU_HIP
  return __all(pred);
#else
  return __all_sync(kFullWarp, pred);
#endif
}
// Lanes set in m; the 1-based index of its lowest set lane (0: none); the lanes below `lane`.
__device__ inline int mask_popc(LaneMask m) {
#if KVMEM_GPU_HIP
  return __popcll(m);
#else
  return __popc(m);
#endif
}
__device__ inline int mask_ffs(LaneMask m) {
#if KVMEM_GPU_HIP
  return __ffsll(static_cast<long long>(m));
#else
  return __ffs(static_cast<int>(m));
#endif
}
__device__ inline LaneMask lanes_below(int lane) {
  return (LaneMask(1) << lane) - 1;
}
// Memory ordering among the lanes of a warp: shared-memory writes of one lane before it are visible
// to the others after it. A CDNA wavefront runs its lanes in lock step, so there it is a fence at
// wavefront scope that the compiler may not move accesses across.
__device__ inline void warp_sync() {
#if KVMEM_GPU_HIP
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
  __syncwarp();
#endif
}

// ---- memory -----------------------------------------------------------------------------------
// A load of what other blocks of the running kernel wrote: through the device-wide cache, past the
// multiprocessor's own (CUDA's ld.global.cg; on AMD a relaxed atomic load at agent scope, which
// bypasses the compute unit's non-coherent L1).
template <class T>
__device__ inline T load_cg(const T* p) {
#if KVMEM_GPU_HIP
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
#else
  return __ldcg(p);
#endif
}

}  // namespace kvmem::cuda
