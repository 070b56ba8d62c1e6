// SPDX-License-Identifier: Apache-2.0
#pragma once
// State update of KV Means on the tensor cores (bf16 storage, spec 4.5 steps 2 and 4): novelty and
// merge routing as [tokens x slots] products on Hopper's warpgroup MMA (wgmma) where the device code
// is built for sm_90a, mma.sync m16n8k16 elsewhere. Split from kvm_attend_tc.cuh so the readout and
// the update chain can change apart; both use the fragment layouts described there.

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

#include "kvmem/backend/cuda/kvm_kernels.cuh"
#include "kvmem/backend/cuda/ptx.cuh"
#include "kvmem/backend/cuda/vendor.cuh"
#include "kvmem/core/numeric.hpp"

namespace kvmem::cuda::kvm_detail {

// Novelty (max over slots of k0 . K^) and merge routing (argmax over non-sink slots of kg . K^+) as
// [tokens x slots] products. Operands are split as x = hi + lo (two bf16 values, |x - hi - lo| about
// 2^-16 |x|); with kTerms = 3 each dot is hi.hi + lo.hi + hi.lo accumulated in fp32, which is about
// as accurate as the fp32 dot of the host backend, so routes agree with it except at true near-ties.
// kTerms = 1 (KvmState::set_fast_routing) uses hi.hi only: bf16 logits like the reference's eager
// bf16 path (spec 7.2), three times fewer products, and route flips near ties.
// Each warp owns 16 tokens whose hi/lo A fragments stay in registers; slots arrive in tiles of
// kRtSlots rows (hi = khat, lo = khat_lo), kRtStages deep in shared memory with cp.async. The products
// of kRtGroup slots at a time stay in registers (lane l holds tokens l/4 and l/4 + 8, slots 2 (l % 4) +
// {0, 1} of each 8-slot group: the m16n8 accumulator layout, which wgmma's m64nN repeats) and feed
// each lane's running max; the four lanes of a quad merge at the end.
// sm_90a: the four warps of a warpgroup (64 tokens) issue a tile's products as asynchronous m64n64k16
// wgmma (A from registers, the slot rows as B from 128-byte-swizzled shared memory). Elsewhere (the
// compute_90 PTX) the mma.sync path, operands through ldmatrix, whose notes follow.
// What bounds the mma.sync pass (4 warps per scheduler at 128 registers): the latency of dependent
// instructions (mma accumulator chains, compare/select
// chains) and of ldmatrix, not bandwidth. So the loop is shaped for latency: the mma of one k-step run
// over the four accumulators of a slot group before the next k-step (four independent chains per
// warp rather than 24 dependent mma in a row); the pipeline keeps kRtStages - 1 tiles in flight
// behind one barrier per tile; the argmax tests (col < n, first candidate, sink) run only on the
// first and last groups, and the other groups take their max by a pair tree. 16 tokens a warp: 32
// would halve the ldmatrix per mma but need 226 registers, one block of 8 warps per SM.
inline constexpr int kRtWarps = 8;
inline constexpr int kRtTokens = 16 * kRtWarps;  // tokens per block
inline constexpr int kRtSlots = 64;              // slots per staged tile
inline constexpr int kRtStages = 3;              // staged tiles (kRtStages - 1 in flight while one is used)
inline constexpr int kRtGroup = 32;              // slots whose products are in registers at once

// Shared memory of update_tc_scores_kernel: kRtStages stages of a hi (and a lo) tile of kRtSlots slot
// rows. mma.sync path: rows of pitch kD + 8 (+16 bytes: the 8 rows of an ldmatrix hit 32 banks).
// wgmma path: the 128-byte swizzle layout of the readout's tiles (ptx::sw128_offset: kD / 64 column
// blocks of [slot][64 bf16]), K-major B operands read through descriptors, from a 1024-byte boundary.
// A launch gives the larger (ptx::shared_bytes_of_either_path): 104 KB at kD = 128, kTerms = 3, two
// blocks per SM.
template <int kD, int kTerms>
constexpr std::size_t rt_padded_bytes() {
  return std::size_t(kRtStages) * (kTerms == 3 ? 2 : 1) * kRtSlots * (kD + 8) * sizeof(bf16);
}
template <int kD, int kTerms>
constexpr std::size_t rt_swizzled_bytes() {
  return std::size_t(kRtStages) * (kTerms == 3 ? 2 : 1) * kRtSlots * kD * sizeof(bf16) + 1024;
}
template <int kD, int kTerms>
constexpr std::size_t rt_shared_bytes() {
  return ptx::shared_bytes_of_either_path(rt_swizzled_bytes<kD, kTerms>(), rt_padded_bytes<kD, kTerms>());
}

// What a pass computes: RtMode (kvm_kernels.cuh).

// The token operands are built here, in the A fragment layout, from the keys of the update's tokens
// [a, a + C): k0 = LN_s of the key, kg = g k0 (spec 4.2), no prepare pass and no hi/lo rows in memory.
// kRtNovelty and kRtRoute also write the fp32 kg rows (and k0 rows for ungated appends) that the
// appends and the scatter add, so every consumer of a token's kg sees the same values.
// kRtRoute writes every token's target (an update without appends merges every token).
// Block b takes item b / tb, tokens [(b % tb) kRtTokens, +kRtTokens) with tb = ceil(C / kRtTokens): the
// token blocks of one item are adjacent in launch order, so the later ones find the item's slots in L2
// (with the item fastest they ran a wave apart and each read the slots from DRAM).
// grid (I tb), block 32 * kRtWarps, dynamic smem rt_shared_bytes; needs C % 16 == 0.
template <int kD, int kTerms, int kMode>
__global__ void __launch_bounds__(32 * kRtWarps, 2)
    update_tc_scores_kernel(DeviceState<bf16, float> st, std::int64_t a, std::int64_t j0, std::int64_t j1) {
  using namespace ptx;
  constexpr int kParts = kTerms == 3 ? 2 : 1;  // hi (and lo) tiles per stage
  constexpr int kK = kD / 16;                  // k-steps
  extern __shared__ __align__(128) unsigned char rt_smem_raw[];
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr unsigned kTileBytes = kRtSlots * kD * 2;  // one hi or lo tile, swizzled
  const unsigned tiles_smem = shared_address(align_shared_1024(rt_smem_raw));
#else
  constexpr int kPitch = kD + 8;  // bf16 elements
  constexpr unsigned kTileBytes = kRtSlots * kPitch * 2;
  const unsigned tiles_smem = shared_address(rt_smem_raw);
#endif
  const std::int64_t C = st.C, tb = (C + kRtTokens - 1) / kRtTokens;
  const std::int64_t i = blockIdx.x / tb;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, quad = lane % 4, r = lane / 4;
  const std::int64_t c0 = (std::int64_t(blockIdx.x) % tb) * kRtTokens + warp * 16;  // the warp's first token
  const bool active = c0 < C;                                                       // warp-uniform (C % 16 == 0)
  // Tile k's copies: thread t moves 16-byte vector t % kVecs of rows t / kVecs + kPass m; the item's
  // row base and the thread's offsets are fixed, so each copy costs one multiply-add of the row.
  const std::int64_t tiles = (j1 - j0 + kRtSlots - 1) / kRtSlots;
  constexpr int kVecs = kD / 8, kPass = 32 * kRtWarps / kVecs;
  static_assert(kRtSlots % kPass == 0, "whole passes per tile");
  const int vec = threadIdx.x % kVecs, vcol = vec * 8, vrow = threadIdx.x / kVecs;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // the rows a thread copies are vrow + kPass m, all of the same row % 8 (kPass % 8 == 0): one swizzle
  static_assert(kPass % 8 == 0, "one swizzle pattern per thread");
  const unsigned dst_off = sw128_offset(kRtSlots, vrow, vec);
  constexpr unsigned kPassBytes = kPass * 128;
#else
  const unsigned dst_off = static_cast<unsigned>((vrow * kPitch + vcol) * 2);
  constexpr unsigned kPassBytes = kPass * kPitch * 2;
#endif
  const bf16* khat_item = st.khat + i * st.cap * kD + vcol;
  const bf16* khat_lo_item = st.khat_lo + i * st.cap * kD + vcol;
  // every call commits one group (empty past the last tile), so the wait below counts tiles
  const auto issue = [&](std::int64_t k) {
    if (k < tiles) {
      const std::int64_t base = j0 + k * kRtSlots;
      const std::int64_t n = (j1 - base) < kRtSlots ? (j1 - base) : kRtSlots;
      const unsigned buf = tiles_smem + static_cast<unsigned>(k % kRtStages) * kParts * kTileBytes + dst_off;
#pragma unroll
      for (int m = 0; m < kRtSlots / kPass; ++m) {
        const int s = vrow + m * kPass;
        const std::int64_t row = base + (s < n ? s : 0);  // rows past n: zeros from a valid address
        cp_async16(buf + m * kPassBytes, khat_item + row * kD, s < n ? 16 : 0);
        if constexpr (kTerms == 3)
          cp_async16(buf + kTileBytes + m * kPassBytes, khat_lo_item + row * kD, s < n ? 16 : 0);
      }
    }
    cp_async_commit();
  };
  // the first tiles travel while the tokens' operands are built
#pragma unroll
  for (int s = 0; s < kRtStages - 1; ++s) issue(s);
  // A fragments (hi and lo bf16 parts of the tokens' k0 or kg): element (token, dim) of k-step kk sits
  // at token r or r + 8, dims kk*16 + 2 quad + {0, 1} (+ 8)
  std::uint32_t ahi[kK][4], alo[kTerms == 3 ? kK : 1][4];
#pragma unroll
  for (int kk = 0; kk < kK; ++kk)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      ahi[kk][q] = 0u;
      if constexpr (kTerms == 3) alo[kk][q] = 0u;
    }
  if (active) {
    // lane (r, quad) holds, of token c0 + r (h = 0) and c0 + r + 8 (h = 1), dims kk*16 + 8m + 2 quad
    // + {0, 1} (m = 0, 1): the four lanes of a quad hold the token's kD dims, so LN_s reduces over
    // the quad (two xor shuffles) with the 16 tokens of the warp side by side
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
      sum += warp_shfl_xor(sum, 1);
      sum += warp_shfl_xor(sum, 2);
      const float mean = sum / static_cast<float>(kD);
      float var = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kK; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float dv = x[kk][e] - mean;
          var += dv * dv;
        }
      var += warp_shfl_xor(var, 1);
      var += warp_shfl_xor(var, 2);
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
  constexpr bool kRoute = kMode != kRtNovelty;
  // Running maxima of tokens r (index 0) and r + 8 (index 1), the first of equal values winning as in
  // the host's scan. best: the pass's argmax (kRoute), or the novelty score over the slots of the
  // tested groups (value only); cbest: the novelty pass's route candidate.
  float best[2] = {negative_infinity<float>(), negative_infinity<float>()};
  float cbest[2] = {negative_infinity<float>(), negative_infinity<float>()};
  int arg[2] = {-1, -1}, carg[2] = {-1, -1};
  const int sink = static_cast<int>(st.sink);
  // Folds the products of the kRtGroup slots [base, base + kRtGroup) of this lane's two tokens into the
  // running maxima (sc: the m16n8 accumulator layout over kRtGroup / 8 slot tiles); groups come in
  // increasing slot order.
  const auto take_group = [&](std::int64_t base, const float(&sc)[kRtGroup / 8][4]) {
    // Slots in increasing order for each token. A group inside [j0, j1) whose previous group was whole
    // and past the sink (so every lane has a candidate of each max) needs no tests: a larger value
    // wins; in the novelty pass it feeds only the route candidate, whose max is then the score's too
    // (the score takes the larger of best and cbest at the end).
    const bool plain = base + kRtGroup <= j1 && base - kRtGroup >= (kRoute ? j0 : (j0 > sink ? j0 : sink));
    if (plain) {
      // the lane's leftmost max of the group by pairs (a later value wins only if larger: the scan's
      // result for finite scores, in log2 dependent steps rather than one per value), then against
      // the running max.
      // Heap order: the values are the leaves kV + m (slot order), node t pairs 2t (earlier) and 2t + 1.
      constexpr int kV = kRtGroup / 4;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v[2 * kV];
        int col[2 * kV];
#pragma unroll
        for (int nt = 0; nt < kRtGroup / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            v[kV + 2 * nt + e] = sc[nt][2 * h + e];
            col[kV + 2 * nt + e] = nt * 8 + e;
          }
#pragma unroll
        for (int t = kV - 1; t >= 1; --t) {
          const bool later = v[2 * t + 1] > v[2 * t];
          v[t] = later ? v[2 * t + 1] : v[2 * t];
          col[t] = later ? col[2 * t + 1] : col[2 * t];
        }
        float& b = kRoute ? best[h] : cbest[h];
        int& g = kRoute ? arg[h] : carg[h];
        if (v[1] > b) {
          b = v[1];
          g = static_cast<int>(base) + 2 * quad + col[1];
        }
      }
      return;
    }
    const int n = static_cast<int>((j1 - base) < kRtGroup ? (j1 - base) : kRtGroup);
#pragma unroll
    for (int nt = 0; nt < kRtGroup / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = nt * 8 + 2 * quad + e, j = static_cast<int>(base) + col;
        if (col >= n) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float val = sc[nt][2 * h + e];
          if constexpr (kRoute) {
            if (arg[h] < 0 || val > best[h]) {
              best[h] = val;
              arg[h] = j;
            }
          } else {
            if (val > best[h]) best[h] = val;
            if (j >= sink && (carg[h] < 0 || val > cbest[h])) {
              cbest[h] = val;
              carg[h] = j;
            }
          }
        }
      }
  };
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // wgmma: warpgroup g multiplies its 64 tokens (warp w of it: tokens 16 w .., the A fragments above)
  // by the tile's 64 slots as m64n64k16 products, A from registers, B = the slot rows (K-major: no
  // transpose) through a descriptor; k16 slice kk is 32 bytes into the rows of column block kk / 4.
  // One accumulator a tile, folded as two groups once the products are done (rather than two
  // m64n32k16 groups with the second computed while the first is folded), at the cost of full-width
  // products on the few appended slots of a kRtRouteNew pass. No wgmma sits in a
  // branch that depends on the thread (ptxas then serializes every wgmma of the kernel, C7520): warps
  // past the update's tokens take part with zero operands, a wgmma needing the whole warpgroup.
  float sc[kRtSlots / 8][4];
#pragma unroll
  for (int nt = 0; nt < kRtSlots / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[nt][e] = 0.0f;
  for (std::int64_t k = 0; k < tiles; ++k) {
    cp_async_wait<kRtStages - 2>();
    // tile k is visible to the tensor cores (async proxy), and every warpgroup's products of tile
    // k - 1 are done, so the issue below may refill its stage
    fence_proxy_async_shared();
    __syncthreads();
    issue(k + kRtStages - 1);
    const unsigned hi_tile = tiles_smem + static_cast<unsigned>(k % kRtStages) * kParts * kTileBytes;
    const std::int64_t base = j0 + k * kRtSlots;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kK; ++kk) {
      const unsigned off = sw128_k16_offset(kRtSlots, kk);
      const std::uint64_t bh = wgmma_desc_sw128(hi_tile + off, 16, 1024);
      wgmma_m64n64k16_rs(sc, ahi[kk], bh, kk > 0);
      if constexpr (kTerms == 3) {
        // hi.hi, lo.hi, hi.lo: the order of the products of one dot, as in the mma.sync path
        wgmma_m64n64k16_rs(sc, alo[kk], bh, 1);
        wgmma_m64n64k16_rs(sc, ahi[kk], wgmma_desc_sw128(hi_tile + kTileBytes + off, 16, 1024), 1);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(sc);
    wgmma_fence_operands(ahi);
    wgmma_fence_operands(alo);
    // slot tiles 0-3 of the accumulator are the first group, 4-7 the second (the same fragment layout)
    take_group(base, reinterpret_cast<const float(&)[kRtGroup / 8][4]>(sc[0]));
    if (base + kRtGroup < j1)
      take_group(base + kRtGroup, reinterpret_cast<const float(&)[kRtGroup / 8][4]>(sc[kRtGroup / 8]));
  }
#else
  // lane l points at slot row l % 8 of 8x8 matrix l / 8: matrices 0, 1 are slot group 2p, dims +0, +8
  // of the k-step, matrices 2, 3 the same of group 2p + 1 (the b0, b1 of two mma)
  const unsigned lane_off = static_cast<unsigned>((((lane / 16) * 8 + lane % 8) * kPitch + ((lane / 8) % 2) * 8) * 2);
  for (std::int64_t k = 0; k < tiles; ++k) {
    cp_async_wait<kRtStages - 2>();
    // tile k is visible, and every warp is done with tile k - 1, whose stage the issue below refills
    __syncthreads();
    issue(k + kRtStages - 1);
    if (!active) continue;
    const unsigned hi_tile = tiles_smem + static_cast<unsigned>(k % kRtStages) * kParts * kTileBytes + lane_off;
    const unsigned lo_tile = hi_tile + kTileBytes;
#pragma unroll
    for (int grp = 0; grp < kRtSlots / kRtGroup; ++grp) {
      const std::int64_t base = j0 + k * kRtSlots + grp * kRtGroup;
      if (base >= j1) break;
      float sc[kRtGroup / 8][4];
#pragma unroll
      for (int nt = 0; nt < kRtGroup / 8; ++nt) sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
        // per k-step: hi.hi, then lo.hi and hi.lo (the order of the products of one dot), each over the
        // four accumulators so that independent mma follow each other
#pragma unroll
      for (int kk = 0; kk < kK; ++kk) {
        std::uint32_t bh[kRtGroup / 16][4], bl[kRtGroup / 16][4];
#pragma unroll
        for (int p = 0; p < kRtGroup / 16; ++p) {
          const unsigned off = static_cast<unsigned>((grp * kRtGroup + p * 16) * kPitch * 2 + kk * 32);
          ldmatrix_x4(bh[p], hi_tile + off);
          if constexpr (kTerms == 3) ldmatrix_x4(bl[p], lo_tile + off);
        }
#pragma unroll
        for (int nt = 0; nt < kRtGroup / 8; ++nt)
          mma_bf16_16816(sc[nt], ahi[kk], bh[nt / 2][2 * (nt % 2)], bh[nt / 2][2 * (nt % 2) + 1]);
        if constexpr (kTerms == 3) {
#pragma unroll
          for (int nt = 0; nt < kRtGroup / 8; ++nt)
            mma_bf16_16816(sc[nt], alo[kk], bh[nt / 2][2 * (nt % 2)], bh[nt / 2][2 * (nt % 2) + 1]);
#pragma unroll
          for (int nt = 0; nt < kRtGroup / 8; ++nt)
            mma_bf16_16816(sc[nt], ahi[kk], bl[nt / 2][2 * (nt % 2)], bl[nt / 2][2 * (nt % 2) + 1]);
        }
      }
      take_group(base, sc);
    }
  }
#endif
  // the four lanes of a quad hold interleaved slots of the same tokens: larger value, ties to the
  // smaller slot
  const auto merge = [](float& b, int& g, int off) {
    const float ob = warp_shfl_xor(b, off);
    const int og = warp_shfl_xor(g, off);
    if (og >= 0 && (g < 0 || ob > b || (ob == b && og < g))) {
      b = ob;
      g = og;
    }
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if constexpr (kRoute) {
      merge(best[h], arg[h], 1);
      merge(best[h], arg[h], 2);
    } else {
      // the score: every visited value went to best (tested groups) or cbest (plain groups)
      float score = cbest[h] > best[h] ? cbest[h] : best[h];
      score = fmaxf(score, warp_shfl_xor(score, 1));
      best[h] = fmaxf(score, warp_shfl_xor(score, 2));
      merge(cbest[h], carg[h], 1);
      merge(cbest[h], carg[h], 2);
    }
  }
  if (!active || quad != 0) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const std::int64_t c = i * C + c0 + r + 8 * h;
    if constexpr (kMode == kRtNovelty) {
      st.score[c] = best[h];
      st.rbest[c] = cbest[h];                  // an update always has a non-sink slot (|S| >= C > sink): carg >= 0
      st.target[c] = carg[h];                  // the appends mark theirs -1 after this pass
    } else if constexpr (kMode == kRtRoute) {  // no appends: every token merges
      st.target[c] = arg[h];
    } else {  // an appended slot wins only if strictly better: ties go to the older, smaller slot
      if (st.target[c] != -1 && arg[h] >= 0 && best[h] > st.rbest[c]) st.target[c] = arg[h];
    }
  }
}

}  // namespace kvmem::cuda::kvm_detail
