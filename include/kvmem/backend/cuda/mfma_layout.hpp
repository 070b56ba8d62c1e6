// SPDX-License-Identifier: Apache-2.0
#pragma once
// AMD matrix cores (MFMA): the operand and accumulator layout of the one instruction the AMD attention and
// routing tiles use (mfma_tiles.hpp), and its fragment types. Plain C++ (no HIP header), so the host tests
// run the tiles over an emulation of this layout; the device side is mfma_wave.cuh.
//
// The instruction: D = A B + C, A [32 x 8] and B [8 x 32] in bf16, C and D [32 x 32] in fp32, over one
// 64-lane wavefront: v_mfma_f32_32x32x8bf16_1k on gfx90a (CDNA2) and v_mfma_f32_32x32x8_bf16 on gfx94x
// (CDNA3), the clang builtin __builtin_amdgcn_mfma_f32_32x32x8bf16_1k(a, b, c, cbsz, abid, blgp) for both
// (ROCm 5.2 and later): a and b are 4 bf16 bit patterns a lane (a vector of 4 shorts), c and the result
// 16 floats a lane; the tiles pass cbsz = abid = blgp = 0.
//
// Lane mapping (AMD Matrix Instruction Calculator, --detail-instruction, the same on CDNA2 and CDNA3, no
// modifier set). Lane l = 32 q + c with q in {0, 1} and c in [0, 32):
//   A[i][k] is element k % 4 of lane 32 floor(k / 4) + i   -> lane l holds A[c][4 q + e],  e = 0..3
//   B[k][j] is element k % 4 of lane 32 floor(k / 4) + j   -> lane l holds B[4 q + e][c],  e = 0..3
//   D[i][j] is register 4 floor(i / 8) + i % 4 of lane 32 (floor(i / 4) % 2) + j
//                                 -> register g of lane l holds D[8 floor(g / 4) + 4 q + g % 4][c]
// Operand element e sits in bits [16 (e % 2), 16 (e % 2) + 16) of the lane's register floor(e / 2), i.e.
// component e of the 4-short vector. A lane's operand elements are 4 consecutive k and its accumulator
// registers all one column c: so the tiles put the dimension they reduce over (keys, slots) on the rows
// of D, and a column's softmax or argmax is one lane's registers plus its partner lane l ^ 32.

#include <cstdint>

#include "kvmem/core/config.hpp"
#include "kvmem/core/numeric.hpp"

// Full unrolling of the tiles' fixed-count loops (their fragments stay in registers); clang-based
// compilers (hipcc) take the pragma, other host compilers unroll on their own.
#if defined(__clang__)
#define KVMEM_MFMA_UNROLL _Pragma("unroll")
#else
#define KVMEM_MFMA_UNROLL
#endif

namespace kvmem::cuda::mfma {

inline constexpr int kLanes = 64;  // one CDNA wavefront
inline constexpr int kM = 32;      // rows of A and D
inline constexpr int kN = 32;      // columns of B and D
inline constexpr int kK = 8;       // the reduction of one instruction
inline constexpr int kOperandElems = 4;
inline constexpr int kAccRegs = kM * kN / kLanes;  // 16 floats a lane

// Lane l's column of B and D, its row of A (c), and its half (q).
KVMEM_HOST_DEVICE constexpr int lane_col(int lane) {
  return lane % 32;
}
KVMEM_HOST_DEVICE constexpr int lane_half(int lane) {
  return lane / 32;
}
// The k of operand element e of lane l (row of B, column of A).
KVMEM_HOST_DEVICE constexpr int operand_k(int lane, int e) {
  return 4 * lane_half(lane) + e;
}
// The row of D that accumulator register g of lane l holds (its column is lane_col(lane)).
KVMEM_HOST_DEVICE constexpr int acc_row(int lane, int g) {
  return 8 * (g / 4) + 4 * lane_half(lane) + g % 4;
}

// The fragments. On the device (hipcc's device pass) the vector types the builtin takes; elsewhere
// structs with the same element access, for the host emulation.
#if defined(__HIP_DEVICE_COMPILE__)
typedef short Operand __attribute__((ext_vector_type(4)));  // bf16 bit patterns
typedef float Accum __attribute__((ext_vector_type(16)));
#else
struct Operand {
  short x[kOperandElems];
  KVMEM_HOST_DEVICE short& operator[](int e) { return x[e]; }
  KVMEM_HOST_DEVICE short operator[](int e) const { return x[e]; }
};
struct Accum {
  float x[kAccRegs];
  KVMEM_HOST_DEVICE float& operator[](int g) { return x[g]; }
  KVMEM_HOST_DEVICE float operator[](int g) const { return x[g]; }
};
#endif

// Operand elements from bf16 values (already rounded) and from floats (rounded to nearest even, as
// kvmem's bf16 conversion everywhere).
KVMEM_HOST_DEVICE inline Operand operand_of(const bf16* p) {
#if defined(__HIP_DEVICE_COMPILE__)
  return *reinterpret_cast<const Operand*>(p);  // one 8-byte load: the tiles' rows are 8-byte aligned
#else
  Operand a{};
  KVMEM_MFMA_UNROLL
  for (int e = 0; e < kOperandElems; ++e) a[e] = static_cast<short>(p[e].bits);
  return a;
#endif
}
KVMEM_HOST_DEVICE inline Operand operand_of(float x0, float x1, float x2, float x3) {
  Operand a{};
  a[0] = static_cast<short>(bf16::from_float(x0));
  a[1] = static_cast<short>(bf16::from_float(x1));
  a[2] = static_cast<short>(bf16::from_float(x2));
  a[3] = static_cast<short>(bf16::from_float(x3));
  return a;
}
// The value of operand element e as a float.
KVMEM_HOST_DEVICE inline float operand_value(const Operand& a, int e) {
  return bf16::to_float(static_cast<std::uint16_t>(a[e]));
}

}  // namespace kvmem::cuda::mfma
