// SPDX-License-Identifier: Apache-2.0
#pragma once
// An emulated 64-lane wavefront for the AMD matrix-core tiles (backend/cuda/mfma_tiles.hpp), so the host
// tests run the code hipcc compiles for the matrix cores. It holds every lane's registers; lanes(f) runs
// f for each lane in turn; mma() performs the instruction of backend/cuda/mfma_layout.hpp by scattering
// the lanes' operand elements and accumulator registers to the A, B and D matrices with the layout's
// lane mapping, multiplying, and gathering D back; xor32() swaps the two halves of the wavefront.
// The product is exact bf16 x bf16 products summed in fp32 in increasing k onto C (the hardware's own
// order of the 8 products is not specified; tests compare at bf16 tolerances).

#include <array>
#include <cstdint>
#include <stdexcept>

#include "kvmem/backend/cuda/mfma_layout.hpp"

namespace kvmem::test {

struct MfmaHostWave {
  template <class T>
  using Reg = std::array<T, cuda::mfma::kLanes>;

  template <class F>
  static void lanes(F&& f) {
    for (int l = 0; l < cuda::mfma::kLanes; ++l) f(l);
  }
  template <class T>
  static T& at(Reg<T>& r, int l) {
    return r[std::size_t(l)];
  }
  template <class T>
  static const T& at(const Reg<T>& r, int l) {
    return r[std::size_t(l)];
  }

  static void mma(Reg<cuda::mfma::Accum>& c, const Reg<cuda::mfma::Operand>& a, const Reg<cuda::mfma::Operand>& b) {
    using namespace cuda::mfma;
    float A[kM][kK], B[kK][kN], D[kM][kN];
    int seen_a[kM][kK] = {}, seen_b[kK][kN] = {}, seen_d[kM][kN] = {};
    for (int l = 0; l < kLanes; ++l) {
      for (int e = 0; e < kOperandElems; ++e) {
        const int k = operand_k(l, e), i = lane_col(l);
        A[i][k] = operand_value(a[std::size_t(l)], e);
        B[k][i] = operand_value(b[std::size_t(l)], e);
        ++seen_a[i][k];
        ++seen_b[k][i];
      }
      for (int g = 0; g < kAccRegs; ++g) {
        D[acc_row(l, g)][lane_col(l)] = c[std::size_t(l)][g];
        ++seen_d[acc_row(l, g)][lane_col(l)];
      }
    }
    // the layout places every matrix element in exactly one (lane, element) slot
    for (int i = 0; i < kM; ++i)
      for (int k = 0; k < kK; ++k)
        if (seen_a[i][k] != 1 || seen_b[k][i] != 1) throw std::logic_error("MFMA operand layout is not a bijection");
    for (int i = 0; i < kM; ++i)
      for (int j = 0; j < kN; ++j)
        if (seen_d[i][j] != 1) throw std::logic_error("MFMA accumulator layout is not a bijection");
    for (int i = 0; i < kM; ++i)
      for (int j = 0; j < kN; ++j) {
        float sum = D[i][j];
        for (int k = 0; k < kK; ++k) sum += A[i][k] * B[k][j];
        D[i][j] = sum;
      }
    for (int l = 0; l < kLanes; ++l)
      for (int g = 0; g < kAccRegs; ++g) c[std::size_t(l)][g] = D[acc_row(l, g)][lane_col(l)];
    ++mma_count;
  }

  template <class T>
  static Reg<T> xor32(const Reg<T>& x) {
    Reg<T> y;
    for (int l = 0; l < cuda::mfma::kLanes; ++l) y[std::size_t(l)] = x[std::size_t(l ^ 32)];
    return y;
  }

  static inline std::int64_t mma_count = 0;  // instructions issued, for tests that count them
};

}  // namespace kvmem::test
