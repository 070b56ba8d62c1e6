// SPDX-License-Identifier: Apache-2.0
#pragma once
// Tensor-core KVM prefill readout for bf16 storage (spec 4.4): the same joint online softmax over
// [state slots | causal window] as attend_rows_kernel, with q.k and p.v on the tensor cores
// (WMMA 16x16x16, bf16 operands, fp32 accumulation). Like FlashAttention, the probabilities are
// rounded to bf16 before the p.v product; logits, the running max/sum and the output accumulator stay
// fp32. Four warps own 16 query rows each (64 rows of one head per block); keys arrive in tiles of
// 64 rows staged in shared memory.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>

#include "kvmem/backend/cuda/kvm_kernels.cuh"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"

namespace kvmem::cuda::kvm_detail {

inline constexpr int kTcWarps = 4;
inline constexpr int kTcRows = 16 * kTcWarps;  // query rows per block
inline constexpr int kTcKeys = 64;             // keys per tile

template <int kD, int kDv>
struct TcLayout {
  static constexpr int kQPitch = kD + 8;     // bf16 elements; +16 bytes breaks bank conflicts
  static constexpr int kKPitch = kD + 8;
  static constexpr int kVPitch = kDv + 8;
  static constexpr int kSPitch = kTcKeys + 4;  // float
  static constexpr int kPPitch = kTcKeys + 8;  // bf16
  static constexpr int kOPitch = kDv + 4;      // float
  static constexpr std::size_t align(std::size_t x) { return (x + 127) / 128 * 128; }
  static constexpr std::size_t kQ = 0;
  static constexpr std::size_t kK = align(kQ + std::size_t(kTcRows) * kQPitch * 2);
  static constexpr std::size_t kV = align(kK + std::size_t(kTcKeys) * kKPitch * 2);
  static constexpr std::size_t kS = align(kV + std::size_t(kTcKeys) * kVPitch * 2);
  static constexpr std::size_t kP = align(kS + std::size_t(kTcRows) * kSPitch * 4);
  static constexpr std::size_t kO = align(kP + std::size_t(kTcRows) * kPPitch * 2);
  static constexpr std::size_t kBytes = align(kO + std::size_t(kTcRows) * kOPitch * 4);
};

// grid (B*Hq, ceil((t1 - t0) / kTcRows)), block 32 * kTcWarps, dynamic smem TcLayout::kBytes.
// q: [B,Hq,T,kD], out: [B,T,Hq,kDv]
template <class In, class Out, int kD, int kDv>
__global__ void attend_tc_kernel(DeviceState<bf16, float> st, const In* q, Out* out, std::int64_t T, std::int64_t n0,
                                 std::int64_t t0, std::int64_t t1, std::int64_t w, std::int64_t slots) {
  namespace wmma = nvcuda::wmma;
  using L = TcLayout<kD, kDv>;
  using nv_bf16 = __nv_bfloat16;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  nv_bf16* qs = reinterpret_cast<nv_bf16*>(smem_raw + L::kQ);
  nv_bf16* ks = reinterpret_cast<nv_bf16*>(smem_raw + L::kK);
  nv_bf16* vs = reinterpret_cast<nv_bf16*>(smem_raw + L::kV);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* ss = reinterpret_cast<float*>(smem_raw + L::kS) + warp * 16 * L::kSPitch;
  nv_bf16* ps = reinterpret_cast<nv_bf16*>(smem_raw + L::kP) + warp * 16 * L::kPPitch;
  float* os = reinterpret_cast<float*>(smem_raw + L::kO) + warp * 16 * L::kOPitch;

  const std::int64_t Hq = st.Hq, bh = blockIdx.x, b = bh / Hq, h = bh % Hq, item = b * st.Hk + h / st.rep();
  const std::int64_t row0 = t0 + std::int64_t(blockIdx.y) * kTcRows;  // position of the block's first row
  const std::int64_t last_t = (row0 + kTcRows - 1) < (t1 - 1) ? (row0 + kTcRows - 1) : (t1 - 1);
  // queries -> bf16 rows of qs (zeros past t1); output accumulator -> 0
  for (int e = threadIdx.x; e < kTcRows * kD; e += blockDim.x) {
    const int r = e / kD, d = e % kD;
    const std::int64_t t = row0 + r;
    const float x = t < t1 ? load_as<float>(q[((b * Hq + h) * T + (t - n0)) * kD + d]) : 0.0f;
    qs[r * L::kQPitch + d] = __float2bfloat16_rn(x);
  }
  for (int e = lane; e < 16 * kDv; e += 32) os[(e / kDv) * L::kOPitch + e % kDv] = 0.0f;

  // softmax bookkeeping: lane -> row r = lane / 2 of the warp's 16, columns [half*32, half*32 + 32)
  const int r = lane / 2, half = lane % 2;
  const std::int64_t t_row = row0 + warp * 16 + r;
  const bool row_active = t_row < t1;
  OnlineSoftmax<float> sm;  // this lane's half of the row; both halves see the same maxima
  const float ls_state = st.scale * (st.head_temps ? st.tau_s[h] : 1.0f);
  const float ls_window = st.scale * (st.head_temps ? st.tau_w[h] : 1.0f);

  for (int phase = 0; phase < 2; ++phase) {
    const std::int64_t begin = phase == 0 ? 0 : w;
    const std::int64_t end = phase == 0 ? (w > 0 ? slots : 0) : last_t + 1;
    const float ls = phase == 0 ? ls_state : ls_window;
    for (std::int64_t base = begin; base < end; base += kTcKeys) {
      const std::int64_t n = (end - base) < kTcKeys ? (end - base) : kTcKeys;
      __syncthreads();  // previous tile fully consumed (and qs/os initialised on the first pass)
      // stage K and V rows with 16-byte loads; rows past n are zero. Slots come from the readout
      // copies, window keys from the ring (position p at p mod W).
      const auto stage = [&](nv_bf16* dst, int pitch, int dim, const bf16* slot_rows, const bf16* ring_rows) {
        const int vecs = dim / 8;
        for (int e = threadIdx.x; e < kTcKeys * vecs; e += blockDim.x) {
          const int s = e / vecs, c = e % vecs;
          uint4 x = make_uint4(0, 0, 0, 0);
          if (s < n) {
            const bf16* src = phase == 0 ? slot_rows + (item * st.cap + base + s) * dim
                                         : ring_rows + (item * st.W + (base + s) % st.W) * dim;
            x = reinterpret_cast<const uint4*>(src)[c];
          }
          *reinterpret_cast<uint4*>(dst + s * pitch + c * 8) = x;
        }
      };
      stage(ks, L::kKPitch, kD, st.khat, st.wk);
      stage(vs, L::kVPitch, kDv, st.vhat, st.wv);
      __syncthreads();
      // S = Q K^T for the warp's 16 rows and the tile's 64 keys
      for (int nb = 0; nb < kTcKeys / 16; ++nb) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::fill_fragment(acc, 0.0f);
#pragma unroll
        for (int kb = 0; kb < kD / 16; ++kb) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, nv_bf16, wmma::row_major> fa;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, nv_bf16, wmma::col_major> fb;
          wmma::load_matrix_sync(fa, qs + (warp * 16) * L::kQPitch + kb * 16, L::kQPitch);
          wmma::load_matrix_sync(fb, ks + (nb * 16) * L::kKPitch + kb * 16, L::kKPitch);
          wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(ss + nb * 16, acc, L::kSPitch, wmma::mem_row_major);
      }
      __syncwarp();
      // online softmax on the lane's 32 columns; the row max is combined across the two lanes
      float logit[32];
      float tile_max = negative_infinity<float>();
#pragma unroll
      for (int x = 0; x < 32; ++x) {
        const int col = half * 32 + x;
        const bool visible = row_active && col < n && (phase == 0 || base + col <= t_row);
        logit[x] = visible ? ls * ss[r * L::kSPitch + col] : negative_infinity<float>();
        tile_max = fmaxf(tile_max, logit[x]);
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      const float rescale = sm.raise_max(tile_max);
#pragma unroll
      for (int x = 0; x < 32; ++x) ps[r * L::kPPitch + half * 32 + x] = __float2bfloat16_rn(sm.accumulate(logit[x]));
      if (rescale != 1.0f)
        for (int d = half; d < kDv; d += 2) os[r * L::kOPitch + d] *= rescale;
      __syncwarp();
      // O += P V
#pragma unroll
      for (int db = 0; db < kDv / 16; ++db) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::load_matrix_sync(acc, os + db * 16, L::kOPitch, wmma::mem_row_major);
#pragma unroll
        for (int kb = 0; kb < kTcKeys / 16; ++kb) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, nv_bf16, wmma::row_major> fa;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, nv_bf16, wmma::row_major> fb;
          wmma::load_matrix_sync(fa, ps + kb * 16, L::kPPitch);
          wmma::load_matrix_sync(fb, vs + (kb * 16) * L::kVPitch + db * 16, L::kVPitch);
          wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(os + db * 16, acc, L::kOPitch, wmma::mem_row_major);
      }
      __syncwarp();
    }
  }
  // l = both halves' sums (each half was rescaled by the same maxima)
  const float total = sm.sum + __shfl_xor_sync(0xffffffffu, sm.sum, 1);
  if (!row_active) return;
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  Out* orow = out + (((b * T + (t_row - n0)) * Hq) + h) * kDv;
  for (int d = half; d < kDv; d += 2) orow[d] = store_as<Out>(os[r * L::kOPitch + d] * inv);
}

// ---- State update on the tensor cores (bf16 storage, spec 4.5 steps 2 and 4) ----------------------
// Novelty (max over slots of k0 . K^) and merge routing (argmax over non-sink slots of kg . K^+) as
// [tokens x slots] products. Operands are split as x = hi + lo (two bf16 values, |x - hi - lo| about
// 2^-16 |x|); with kTerms = 3 each dot is hi.hi + lo.hi + hi.lo accumulated in fp32, which is about
// as accurate as the fp32 dot of the host backend, so routes agree with it except at true near-ties.
// kTerms = 1 (KvmState::set_fast_routing) uses hi.hi only: bf16 logits like the reference's eager
// bf16 path (spec 7.2), three times fewer products, and route flips near ties.
// Each warp owns 16 tokens whose hi/lo fragments stay in registers; slots arrive in tiles of
// kRtSlots rows staged in shared memory (hi = khat, lo = khat_lo).
inline constexpr int kRtWarps = 8;
inline constexpr int kRtTokens = 16 * kRtWarps;  // tokens per block
inline constexpr int kRtSlots = 32;              // slots per staged tile

// kRoute = false: st.score[c] = max_{j in [j0, j1)} k0_c . K^_j. kRoute = true: for tokens not
// appended (target != -1), st.target[c] = argmax_{j in [j0, j1)} kg_c . K^_j, ties to the smaller j.
// grid (I, ceil(C / kRtTokens)), block 32 * kRtWarps; needs C % 16 == 0.
template <int kD, int kTerms, bool kRoute>
__global__ void __launch_bounds__(32 * kRtWarps) update_tc_scores_kernel(DeviceState<bf16, float> st, std::int64_t j0,
                                                                         std::int64_t j1) {
  namespace wmma = nvcuda::wmma;
  using nv_bf16 = __nv_bfloat16;
  constexpr int kPitch = kD + 8;         // bf16 elements (+16 bytes against bank conflicts)
  constexpr int kSPitch = kRtSlots + 4;  // float
  __shared__ __align__(128) nv_bf16 khi[kRtSlots * kPitch];
  __shared__ __align__(128) nv_bf16 klo[kTerms == 3 ? kRtSlots * kPitch : 8];
  __shared__ __align__(128) float ss[kRtTokens * kSPitch];
  const std::int64_t i = blockIdx.x, C = st.C;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::int64_t c0 = std::int64_t(blockIdx.y) * kRtTokens + warp * 16;  // the warp's first token
  const bool active = c0 < C;  // warp-uniform (C % 16 == 0)
  const nv_bf16* tok = reinterpret_cast<const nv_bf16*>(kRoute ? st.kg_hl : st.k0_hl) + ((i * C + (active ? c0 : 0)) * 2) * kD;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, nv_bf16, wmma::row_major> ahi[kD / 16], alo[kTerms == 3 ? kD / 16 : 1];
  if (active) {
#pragma unroll
    for (int kb = 0; kb < kD / 16; ++kb) {
      wmma::load_matrix_sync(ahi[kb], tok + kb * 16, 2 * kD);  // token rows are (hi, lo) pairs
      if constexpr (kTerms == 3) wmma::load_matrix_sync(alo[kb], tok + kD + kb * 16, 2 * kD);
    }
  }
  float* sw = ss + warp * 16 * kSPitch;
  const int r = lane / 2, half = lane % 2;  // lane -> token row r, columns [half*16, half*16 + 16)
  float best = negative_infinity<float>();
  int arg = -1;
  // Slot tiles are fetched into registers one tile ahead, so their loads overlap the products of
  // the tile before (each thread moves kPer 16-byte vectors of hi and of lo per tile).
  constexpr int kVecs = kD / 8;
  constexpr int kPer = kRtSlots * kVecs / (32 * kRtWarps);
  static_assert(kPer * 32 * kRtWarps == kRtSlots * kVecs, "slot tile must split evenly over the block");
  uint4 nh[kPer], nl[kPer];
  const auto fetch = [&](std::int64_t base) {
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int e = threadIdx.x + k * 32 * kRtWarps, s = e / kVecs, v = e % kVecs;
      nh[k] = make_uint4(0, 0, 0, 0);
      nl[k] = make_uint4(0, 0, 0, 0);
      if (base + s < j1) {  // rows past the end are zero (and masked below)
        const std::int64_t row = i * st.cap + base + s;
        nh[k] = reinterpret_cast<const uint4*>(st.khat + row * kD)[v];
        if constexpr (kTerms == 3) nl[k] = reinterpret_cast<const uint4*>(st.khat_lo + row * kD)[v];
      }
    }
  };
  fetch(j0);
  for (std::int64_t base = j0; base < j1; base += kRtSlots) {
    const std::int64_t n = (j1 - base) < kRtSlots ? (j1 - base) : kRtSlots;
    __syncthreads();  // the previous tile is consumed
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int e = threadIdx.x + k * 32 * kRtWarps, s = e / kVecs, v = e % kVecs;
      *reinterpret_cast<uint4*>(khi + s * kPitch + v * 8) = nh[k];
      if constexpr (kTerms == 3) *reinterpret_cast<uint4*>(klo + s * kPitch + v * 8) = nl[k];
    }
    __syncthreads();
    if (base + kRtSlots < j1) fetch(base + kRtSlots);
    if (!active) continue;
#pragma unroll
    for (int nb = 0; nb < kRtSlots / 16; ++nb) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kb = 0; kb < kD / 16; ++kb) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, nv_bf16, wmma::col_major> fb;
        wmma::load_matrix_sync(fb, khi + (nb * 16) * kPitch + kb * 16, kPitch);
        wmma::mma_sync(acc, ahi[kb], fb, acc);
        if constexpr (kTerms == 3) {
          wmma::mma_sync(acc, alo[kb], fb, acc);
          wmma::load_matrix_sync(fb, klo + (nb * 16) * kPitch + kb * 16, kPitch);
          wmma::mma_sync(acc, ahi[kb], fb, acc);
        }
      }
      wmma::store_matrix_sync(sw + nb * 16, acc, kSPitch, wmma::mem_row_major);
    }
    __syncwarp();
#pragma unroll
    for (int x = 0; x < kRtSlots / 2; ++x) {
      const int col = half * (kRtSlots / 2) + x;
      if (col >= n) break;
      const float val = sw[r * kSPitch + col];
      if (kRoute ? (arg < 0 || val > best) : val > best) {
        best = val;
        arg = static_cast<int>(base + col);
      }
    }
    __syncwarp();
  }
  // the two lanes of a row: larger value, ties to the smaller slot
  const float ob = __shfl_xor_sync(0xffffffffu, best, 1);
  const int oa = __shfl_xor_sync(0xffffffffu, arg, 1);
  if (oa >= 0 && (arg < 0 || ob > best || (ob == best && oa < arg))) {
    best = ob;
    arg = oa;
  }
  if (!active || half != 0) return;
  const std::int64_t c = c0 + r;
  if constexpr (kRoute) {
    if (st.target[i * C + c] != -1) st.target[i * C + c] = arg;
  } else {
    st.score[i * C + c] = best;
  }
}

}  // namespace kvmem::cuda::kvm_detail
