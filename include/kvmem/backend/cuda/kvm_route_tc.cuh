// SPDX-License-Identifier: Apache-2.0
#pragma once
// State update of KV Means on the tensor cores (bf16 storage, spec 4.5 steps 2 and 4): novelty and
// merge routing as [tokens x slots] products with mma.sync. Split from kvm_attend_tc.cuh so the
// readout and the update chain can change apart; both use the fragment layouts described there.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kvmem/backend/cuda/kvm_kernels.cuh"
#include "kvmem/backend/cuda/ptx.cuh"
#include "kvmem/core/numeric.hpp"

namespace kvmem::cuda::kvm_detail {

// Novelty (max over slots of k0 . K^) and merge routing (argmax over non-sink slots of kg . K^+) as
// [tokens x slots] products. Operands are split as x = hi + lo (two bf16 values, |x - hi - lo| about
// 2^-16 |x|); with kTerms = 3 each dot is hi.hi + lo.hi + hi.lo accumulated in fp32, which is about
// as accurate as the fp32 dot of the host backend, so routes agree with it except at true near-ties.
// kTerms = 1 (KvmState::set_fast_routing) uses hi.hi only: bf16 logits like the reference's eager
// bf16 path (spec 7.2), three times fewer products, and route flips near ties.
// Each warp owns 16 tokens whose hi/lo A fragments stay in registers; slots arrive in tiles of
// kRtSlots rows (hi = khat, lo = khat_lo), double-buffered in shared memory with cp.async, and reach
// the tensor cores through ldmatrix as in attend_tc_kernel. The products of a tile stay in registers
// (mma.sync m16n8k16: lane l holds tokens l/4 and l/4 + 8, slots 2 (l % 4) + {0, 1} of each 8-slot
// group) and feed each lane's running max; the four lanes of a quad merge at the end.
inline constexpr int kRtWarps = 8;
inline constexpr int kRtTokens = 16 * kRtWarps;  // tokens per block
inline constexpr int kRtSlots = 32;              // slots per staged tile

// What a pass computes (argmax: the first slot of the largest value, the host's sequential scan).
// An update that appends scans the pre-update slots once: with g > 0, argmax_j kg . K^+_j equals
// argmax_j k0 . K^+_j (spec 4.5), and merges change no slot before the routes are taken, so the
// novelty pass also gives the best old slot of every token, and the routing pass then only scans
// the appended slots (a handful per update once the state is large).
enum RtMode : int {
  kRtNovelty = 0,   // st.score[c] = max_{j in [j0, j1)} k0_c . K^_j (every slot, sink included), and the
                    // route candidate st.rbest[c], st.target[c] = max, argmax_{j in [max(j0, sink), j1)}
  kRtRoute = 1,     // no appends: for tokens with target != -1, st.target[c] = argmax_{j in [j0, j1)} kg_c . K^_j
  kRtRouteNew = 2,  // after appends, slots [j0, j1) = the appended ones: for tokens with target != -1,
                    // st.target[c] = that argmax of k0_c . K^+_j if its value exceeds st.rbest[c]
};

// The token operands are built here, in the A fragment layout, from the keys of the update's tokens
// [a, a + C): k0 = LN_s of the key, kg = g k0 (spec 4.2), no prepare pass and no hi/lo rows in memory.
// kRtNovelty and kRtRoute also write the fp32 kg rows (and k0 rows for ungated appends) that the
// appends and the scatter add, so every consumer of a token's kg sees the same values.
// kRtRoute writes every token's target (an update without appends merges every token).
// grid (I, ceil(C / kRtTokens)), block 32 * kRtWarps; needs C % 16 == 0.
template <int kD, int kTerms, int kMode>
__global__ void __launch_bounds__(32 * kRtWarps, 2)
    update_tc_scores_kernel(DeviceState<bf16, float> st, std::int64_t a, std::int64_t j0, std::int64_t j1) {
  using namespace ptx;
  constexpr int kPitch = kD + 8;               // bf16 elements (+16 bytes: the 8 rows of an ldmatrix hit 32 banks)
  constexpr int kTile = kRtSlots * kPitch;     // elements of one hi or lo tile
  constexpr int kParts = kTerms == 3 ? 2 : 1;  // hi (and lo) tiles per buffer
  __shared__ __align__(128) bf16 tiles_smem[2 * kParts * kTile];
  const std::int64_t i = blockIdx.x, C = st.C;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane % 4, r = lane / 4;
  const std::int64_t c0 = std::int64_t(blockIdx.y) * kRtTokens + warp * 16;  // the warp's first token
  const bool active = c0 < C;                                                // warp-uniform (C % 16 == 0)
  // A fragments (hi and lo bf16 parts of the tokens' k0 or kg): element (token, dim) of k-step kk sits
  // at token r or r + 8, dims kk*16 + 2 quad + {0, 1} (+ 8)
  std::uint32_t ahi[kD / 16][4], alo[kTerms == 3 ? kD / 16 : 1][4];
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      ahi[kk][q] = 0u;
      if constexpr (kTerms == 3) alo[kk][q] = 0u;
    }
  if (active) {
    // lane (r, quad) holds, of token c0 + r (h = 0) and c0 + r + 8 (h = 1), dims kk*16 + 8m + 2 quad
    // + {0, 1} (m = 0, 1): the four lanes of a quad hold the token's kD dims, so LN_s reduces over
    // the quad (two xor shuffles) with the 16 tokens of the warp side by side
    constexpr int kK = kD / 16;
    const bool rows = kMode != kRtRouteNew;  // the pass that sees the tokens first writes their rows
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const std::int64_t c = c0 + r + 8 * h, p = a + c;
      const std::uint32_t* kw = reinterpret_cast<const std::uint32_t*>(token_key(st, i, p));
      float x[kK][4];
      float sum = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kK; ++kk)
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const std::uint32_t w = kw[kk * 8 + 4 * m + quad];
          const int d = kk * 16 + 8 * m + 2 * quad;
          x[kk][2 * m] = d >= st.rope_dims ? __uint_as_float(w << 16) : 0.0f;  // spec 4.2 step 1
          x[kk][2 * m + 1] = d + 1 >= st.rope_dims ? __uint_as_float(w & 0xffff0000u) : 0.0f;
          sum += x[kk][2 * m] + x[kk][2 * m + 1];
        }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float mean = sum / static_cast<float>(kD);
      float var = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kK; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float dv = x[kk][e] - mean;
          var += dv * dv;
        }
      var += __shfl_xor_sync(0xffffffffu, var, 1);
      var += __shfl_xor_sync(0xffffffffu, var, 2);
      const float inv = 1.0f / sqrtf(var / static_cast<float>(kD) + st.eps);
      const float g = token_gate(st, i, p);
      float* kg_row = st.kg + (i * C + c) * kD;
      float* k0_row = st.k0 + (i * C + c) * kD;
#pragma unroll
      for (int kk = 0; kk < kK; ++kk)
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int d = kk * 16 + 8 * m + 2 * quad;
          const float y0 = st.ln_w[d] * ((x[kk][2 * m] - mean) * inv) + st.ln_b[d];  // k0 (spec 4.2 step 2)
          const float y1 = st.ln_w[d + 1] * ((x[kk][2 * m + 1] - mean) * inv) + st.ln_b[d + 1];
          const float g0 = gated_key(st.merge_gate_keys, g, y0), g1 = gated_key(st.merge_gate_keys, g, y1);
          if (rows) *reinterpret_cast<float2*>(kg_row + d) = make_float2(g0, g1);
          if (kMode == kRtNovelty && !st.gate_appends) *reinterpret_cast<float2*>(k0_row + d) = make_float2(y0, y1);
          const float o0 = kMode == kRtRoute ? g0 : y0, o1 = kMode == kRtRoute ? g1 : y1;  // kg or k0
          const __nv_bfloat162 hi = __floats2bfloat162_rn(o0, o1);
          ahi[kk][h + 2 * m] = *reinterpret_cast<const std::uint32_t*>(&hi);
          if constexpr (kTerms == 3) {
            const float2 hf = __bfloat1622float2(hi);
            const __nv_bfloat162 lo = __floats2bfloat162_rn(o0 - hf.x, o1 - hf.y);
            alo[kk][h + 2 * m] = *reinterpret_cast<const std::uint32_t*>(&lo);
          }
        }
    }
  }
  const std::int64_t tiles = (j1 - j0 + kRtSlots - 1) / kRtSlots;
  const auto issue = [&](std::int64_t k) {
    const std::int64_t base = j0 + k * kRtSlots;
    const std::int64_t n = (j1 - base) < kRtSlots ? (j1 - base) : kRtSlots;
    bf16* buf = tiles_smem + (k % 2) * kParts * kTile;
    constexpr int kVecs = kD / 8;
    for (int e = threadIdx.x; e < kRtSlots * kVecs; e += blockDim.x) {
      const int s = e / kVecs, c = e % kVecs;
      const std::int64_t row = i * st.cap + base + (s < n ? s : 0);  // rows past n: zeros from a valid address
      cp_async16(buf + s * kPitch + c * 8, st.khat + row * kD + c * 8, s < n ? 16 : 0);
      if constexpr (kTerms == 3)
        cp_async16(buf + kTile + s * kPitch + c * 8, st.khat_lo + row * kD + c * 8, s < n ? 16 : 0);
    }
    cp_async_commit();
  };
  constexpr bool kRoute = kMode != kRtNovelty;
  float best_a = negative_infinity<float>(), best_b = negative_infinity<float>();  // tokens r, r + 8
  int arg_a = -1, arg_b = -1;
  float cbest_a = negative_infinity<float>(), cbest_b = negative_infinity<float>();  // route candidates
  int carg_a = -1, carg_b = -1;
  // running max (and its slot) of one token: the first of equal values wins, as in the host's scan
  const auto visit = [](float val, int j, float& best, int& arg) {
    if (val > best) {
      best = val;
      arg = j;
    }
  };
  const auto visit_route = [](float val, int j, float& best, int& arg) {
    if (arg < 0 || val > best) {
      best = val;
      arg = j;
    }
  };
  const int sink = static_cast<int>(st.sink);
  if (tiles > 0) issue(0);
  for (std::int64_t k = 0; k < tiles; ++k) {
    issue_next_and_wait(k, tiles, issue);
    __syncthreads();
    if (active) {
      const std::int64_t base = j0 + k * kRtSlots;
      const int n = static_cast<int>((j1 - base) < kRtSlots ? (j1 - base) : kRtSlots);
      const unsigned hi_tile = shared_address(tiles_smem + (k % 2) * kParts * kTile);
      const unsigned lo_tile = hi_tile + kTile * 2;
      float sc[kRtSlots / 8][4];
#pragma unroll
      for (int nt = 0; nt < kRtSlots / 8; ++nt) {
        sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
        // lane l points at slot row l % 8 of 8x8 matrix l / 8: dims +0, +8, +16, +24 of the k-step pair
        const unsigned off = static_cast<unsigned>(((nt * 8 + lane % 8) * kPitch + (lane / 8) * 8) * 2);
#pragma unroll
        for (int kk = 0; kk < kD / 16; kk += 2) {
          std::uint32_t bh[4], bl[4];
          ldmatrix_x4(bh, hi_tile + off + kk * 32);
          if constexpr (kTerms == 3) ldmatrix_x4(bl, lo_tile + off + kk * 32);
          // per k-step: hi.hi, then lo.hi and hi.lo (the order of the products of one dot)
          mma_bf16_16816(sc[nt], ahi[kk], bh[0], bh[1]);
          if constexpr (kTerms == 3) {
            mma_bf16_16816(sc[nt], alo[kk], bh[0], bh[1]);
            mma_bf16_16816(sc[nt], ahi[kk], bl[0], bl[1]);
          }
          mma_bf16_16816(sc[nt], ahi[kk + 1], bh[2], bh[3]);
          if constexpr (kTerms == 3) {
            mma_bf16_16816(sc[nt], alo[kk + 1], bh[2], bh[3]);
            mma_bf16_16816(sc[nt], ahi[kk + 1], bl[2], bl[3]);
          }
        }
      }
      // slots in increasing order for each token
#pragma unroll
      for (int nt = 0; nt < kRtSlots / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = nt * 8 + 2 * quad + e;
          if (col < n) {
            const int j = static_cast<int>(base) + col;
            if constexpr (kRoute) {
              visit_route(sc[nt][e], j, best_a, arg_a);
              visit_route(sc[nt][2 + e], j, best_b, arg_b);
            } else {
              visit(sc[nt][e], j, best_a, arg_a);
              visit(sc[nt][2 + e], j, best_b, arg_b);
              if (j >= sink) {
                visit_route(sc[nt][e], j, cbest_a, carg_a);
                visit_route(sc[nt][2 + e], j, cbest_b, carg_b);
              }
            }
          }
        }
      }
    }
    __syncthreads();  // this buffer is refilled by the issue two tiles on
  }
  // the four lanes of a quad hold interleaved slots of the same tokens: larger value, ties to the
  // smaller slot
  const auto merge = [](float& best, int& arg, int off) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, off);
    const int oa = __shfl_xor_sync(0xffffffffu, arg, off);
    if (oa >= 0 && (arg < 0 || ob > best || (ob == best && oa < arg))) {
      best = ob;
      arg = oa;
    }
  };
  merge(best_a, arg_a, 1);
  merge(best_a, arg_a, 2);
  merge(best_b, arg_b, 1);
  merge(best_b, arg_b, 2);
  if constexpr (!kRoute) {
    merge(cbest_a, carg_a, 1);
    merge(cbest_a, carg_a, 2);
    merge(cbest_b, carg_b, 1);
    merge(cbest_b, carg_b, 2);
  }
  if (!active || quad != 0) return;
  const std::int64_t ca = i * C + c0 + r, cb = ca + 8;
  if constexpr (kMode == kRtNovelty) {
    st.score[ca] = best_a;
    st.score[cb] = best_b;
    st.rbest[ca] = cbest_a;  // an update always has a non-sink slot (|S| >= C > sink): carg >= 0
    st.rbest[cb] = cbest_b;
    st.target[ca] = carg_a;  // the appends mark theirs -1 after this pass
    st.target[cb] = carg_b;
  } else if constexpr (kMode == kRtRoute) {  // no appends: every token merges
    st.target[ca] = arg_a;
    st.target[cb] = arg_b;
  } else {  // an appended slot wins only if strictly better: ties go to the older, smaller slot
    if (st.target[ca] != -1 && arg_a >= 0 && best_a > st.rbest[ca]) st.target[ca] = arg_a;
    if (st.target[cb] != -1 && arg_b >= 0 && best_b > st.rbest[cb]) st.target[cb] = arg_b;
  }
}

}  // namespace kvmem::cuda::kvm_detail
