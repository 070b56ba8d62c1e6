// SPDX-License-Identifier: Apache-2.0
#pragma once
// The device wave of the AMD matrix-core tiles (mfma_tiles.hpp): each lane holds its own registers, the
// product is the MFMA instruction of mfma_layout.hpp, the exchange between the two halves of a wavefront
// a shuffle. The host tests run the same tiles over an emulated wave of 64 lanes instead
// (tests/support/mfma_host_wave.hpp); both satisfy the interface below.
//
//   W::Reg<T>        one value a lane: T itself here (the running lane's), 64 of them on the host
//   W::lanes(f)      f(lane) for every lane: here the running lane only
//   W::at(r, lane)   that lane's value of r
//   W::mma(c, a, b)  c = a b + c over the wavefront
//   W::xor32(x)      lane l receives lane l ^ 32's value of x (the other half of the same columns)
// Every lane of a wavefront must reach mma and xor32 together (they exchange registers).
// Compiled under hipcc only (KVMEM_GPU_MFMA_PATHS); the device code needs gfx90a or gfx94x, the CDNA
// GPUs with the bf16 instruction of mfma_layout.hpp.

#include "kvmem/backend/cuda/vendor.cuh"

#include <cstdint>

#include "kvmem/backend/cuda/mfma_layout.hpp"
#include "kvmem/core/numeric.hpp"

#if KVMEM_GPU_MFMA_PATHS
#if defined(__HIP_DEVICE_COMPILE__) && \
    !(defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__))
#error "kvmem's AMD matrix-core tiles need gfx90a or gfx94x; for other AMD GPUs define KVMEM_HIP_PORTABLE=1"
#endif

namespace kvmem::cuda::mfma {

static_assert(kWarpSize == kLanes, "the MFMA tiles take a 64-lane wavefront");

struct DeviceWave {
  template <class T>
  using Reg = T;

  __device__ static int lane() { return static_cast<int>(threadIdx.x) % kLanes; }
  template <class F>
  __device__ static void lanes(F&& f) {
    f(lane());
  }
  template <class T>
  __device__ static T& at(T& r, int) {
    return r;
  }
  template <class T>
  __device__ static const T& at(const T& r, int) {
    return r;
  }
  __device__ static void mma(Accum& c, const Operand& a, const Operand& b) {
#if defined(__HIP_DEVICE_COMPILE__)
    c = __builtin_amdgcn_mfma_f32_32x32x8bf16_1k(a, b, c, 0, 0, 0);
#else
    (void)c, (void)a, (void)b;  // hipcc's host pass: never called there
#endif
  }
  __device__ static float xor32(float x) {
    return warp_shfl_xor(x, 32);
  }
  __device__ static int xor32(int x) {
    return warp_shfl_xor(x, 32);
  }
};

// Staging of the tiles' shared-memory rows by a block's threads (16-byte vectors from global memory).
// Rows [0, count) of dst (`pitch` elements apart): row s from src(s) (kDim bf16, 16-byte aligned) for
// s < valid, zeros after.
template <int kDim, class Src>
__device__ inline void stage_rows(bf16* dst, int pitch, int count, int valid, Src&& src) {
  constexpr int kVec = kDim / 8;
  for (int x = static_cast<int>(threadIdx.x); x < count * kVec; x += static_cast<int>(blockDim.x)) {
    const int s = x / kVec, cv = x % kVec;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (s < valid) v = reinterpret_cast<const uint4*>(src(s))[cv];
    *reinterpret_cast<uint4*>(dst + s * pitch + cv * 8) = v;
  }
}
// The same rows transposed: element d of row s goes to dst[d * pitch + s] (AttendTile's value tile).
template <int kDim, class Src>
__device__ inline void stage_transposed(bf16* dst, int pitch, int count, int valid, Src&& src) {
  constexpr int kVec = kDim / 8;
  for (int x = static_cast<int>(threadIdx.x); x < count * kVec; x += static_cast<int>(blockDim.x)) {
    const int s = x / kVec, cv = x % kVec;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (s < valid) v = reinterpret_cast<const uint4*>(src(s))[cv];
    const unsigned words[4] = {v.x, v.y, v.z, v.w};
    KVMEM_MFMA_UNROLL
    for (int j = 0; j < 4; ++j) {
      dst[(cv * 8 + 2 * j) * pitch + s] = bf16::from_bits(static_cast<std::uint16_t>(words[j] & 0xffffu));
      dst[(cv * 8 + 2 * j + 1) * pitch + s] = bf16::from_bits(static_cast<std::uint16_t>(words[j] >> 16));
    }
  }
}
// Rows [first, count) of dst set to zero (a transposed value tile's rows past the head dim).
__device__ inline void zero_rows(bf16* dst, int pitch, int first, int count) {
  for (int x = static_cast<int>(threadIdx.x); x < (count - first) * pitch; x += static_cast<int>(blockDim.x))
    dst[first * pitch + x] = bf16::from_bits(0);
}

}  // namespace kvmem::cuda::mfma
#endif  // KVMEM_GPU_MFMA_PATHS
