// SPDX-License-Identifier: Apache-2.0
#pragma once
// State update of KV Means on the tensor cores (bf16 storage, spec 4.5 steps 2 and 4): novelty and
// merge routing as [tokens x slots] products on Hopper's warpgroup MMA (wgmma) where the device code
// is built for sm_90a, mma.sync m16n8k16 elsewhere. Split from kvm_attend_tc.cuh so the readout and
// the update chain can change apart; both use the fragment layouts described there.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

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
// kRtSlots rows (hi = khat, lo = khat_lo), kRtStages deep in shared memory with cp.async. The products
// of kRtGroup slots at a time stay in registers (lane l holds tokens l/4 and l/4 + 8, slots 2 (l % 4) +
// {0, 1} of each 8-slot group: the m16n8 accumulator layout, which wgmma's m64nN repeats) and feed
// each lane's running max; the four lanes of a quad merge at the end.
// sm_90a: the four warps of a warpgroup (64 tokens) issue a tile's products as asynchronous m64n64k16
// wgmma (A from registers, the slot rows as B from 128-byte-swizzled shared memory). H200, B8 H32 D128
// 32K: a 16 sqrt N novelty pass 266 -> 181 us, a fixed-256 routing pass 61 -> 49 us against the
// mma.sync path (results kvm_cuda_2026-11-30_h200_wgroute.md). Elsewhere (the compute_90 PTX) the
// mma.sync path, operands through ldmatrix, whose notes follow.
// What bounds the pass (ncu, B8 H32 D128 16 sqrt N, a 2600-slot novelty pass, 4 warps per scheduler at
// 128 registers): the latency of dependent instructions (mma accumulator chains, compare/select
// chains) and of ldmatrix, not bandwidth. So the loop is shaped for latency: the mma of one k-step run
// over the four accumulators of a slot group before the next k-step (four independent chains per
// warp rather than 24 dependent mma in a row); the pipeline keeps kRtStages - 1 tiles in flight
// behind one barrier per tile; the argmax tests (col < n, first candidate, sink) run only on the
// first and last groups, and the other groups take their max by a pair tree. Measured and not kept:
// 32 tokens a warp (half the ldmatrix per mma, but 226 registers leave one block of 8 warps per SM:
// 0.99 ms per 32K update against main's 0.87) and 64-slot groups (eight chains: 2.5 % slower end to
// end, and more wasted mma on the handful of appended slots of a kRtRouteNew pass). Results:
// benchmarks/results/kvm_cuda_2026-11-30_h200_route.md.
inline constexpr int kRtWarps = 8;
inline constexpr int kRtTokens = 16 * kRtWarps;  // tokens per block
inline constexpr int kRtSlots = 64;              // slots per staged tile
inline constexpr int kRtStages = 3;              // staged tiles (kRtStages - 1 in flight while one is used)
inline constexpr int kRtGroup = 32;              // slots whose products are in registers at once
// screened passes: candidates a lane keeps per token (H200: 4 entries overflowed 5 of 512 blocks of a
// 32K novelty pass into the exact sweep, the price of a fourth stage of hi tiles beside the lists)
inline constexpr int kRtListCap = 6;
// The screened passes' bound on |screened - refined score| per unit of sum_d |a_d| |b_d| (derived at
// the screen in update_tc_scores_kernel): 2^-8 from the bf16 splits, 2^-11 for every other error.
inline constexpr float kRtScreenMargin = 0x1p-8f + 0x1p-11f;

// Shared memory of update_tc_scores_kernel: kRtStages stages of a hi (and a lo) tile of kRtSlots slot
// rows. mma.sync path: rows of pitch kD + 8 (+16 bytes: the 8 rows of an ldmatrix hit 32 banks).
// wgmma path: the 128-byte swizzle layout of the readout's tiles (ptx::sw128_offset: kD / 64 column
// blocks of [slot][64 bf16]), K-major B operands read through descriptors, from a 1024-byte boundary. The launch gives the larger (the host does not know which path the device
// compiled): 104 KB at kD = 128, kTerms = 3, two blocks per SM.
template <int kD, int kTerms>
constexpr std::size_t rt_padded_bytes() {
  return std::size_t(kRtStages) * (kTerms == 3 ? 2 : 1) * kRtSlots * (kD + 8) * sizeof(bf16);
}
template <int kD, int kTerms>
constexpr std::size_t rt_swizzled_bytes() {
  return std::size_t(kRtStages) * (kTerms == 3 ? 2 : 1) * kRtSlots * kD * sizeof(bf16) + 1024;
}
// The screened passes (kTerms = 3 on sm_90a) stage hi tiles only, followed by the candidate lists
// (slot and screened value of kRtListCap entries per lane and token) and the tokens' lo operands
// (which the screen does not multiply: out of registers, 128 with them); the exact sweep a block
// falls back to reuses the same bytes for its hi and lo tiles. 105 KB at kD = 128.
template <int kD>
constexpr std::size_t rt_screen_list_bytes() {
  return std::size_t(32 * kRtWarps) * 2 * kRtListCap * (sizeof(int) + sizeof(float));
}
template <int kD>
constexpr std::size_t rt_screen_bytes() {
  return std::size_t(kRtStages) * kRtSlots * kD * sizeof(bf16) + 1024 + rt_screen_list_bytes<kD>() +
         std::size_t(32 * kRtWarps) * (kD / 4) * sizeof(std::uint32_t);
}
template <int kD, int kTerms>
constexpr std::size_t rt_shared_bytes() {
  constexpr std::size_t tiles = rt_padded_bytes<kD, kTerms>() > rt_swizzled_bytes<kD, kTerms>()
                                    ? rt_padded_bytes<kD, kTerms>()
                                    : rt_swizzled_bytes<kD, kTerms>();
  return kTerms == 3 && rt_screen_bytes<kD>() > tiles ? rt_screen_bytes<kD>() : tiles;
}

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
  using Parts = std::integral_constant<int, kParts>;
  extern __shared__ __align__(128) unsigned char rt_smem_raw[];
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // the screen and refine of the exact passes (see "Screen and refine" below); kRtRouteNew's handful
  // of appended slots keeps the exact sweep
  constexpr bool kScreen = kTerms == 3 && kMode != kRtRouteNew;
#else
  constexpr bool kScreen = false;
#endif
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
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane % 4, r = lane / 4;
  const std::int64_t c0 = (std::int64_t(blockIdx.x) % tb) * kRtTokens + warp * 16;  // the warp's first token
  const bool active = c0 < C;                                                      // warp-uniform (C % 16 == 0)
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
  // every call commits one group (empty past the last tile), so the wait below counts tiles; parts:
  // the tiles of a stage (integral_constant 1: hi only, as the screen stages them; 2: hi and lo)
  const auto issue = [&](std::int64_t k, auto parts) {
    constexpr int kP = decltype(parts)::value;
    if (k < tiles) {
      const std::int64_t base = j0 + k * kRtSlots;
      const std::int64_t n = (j1 - base) < kRtSlots ? (j1 - base) : kRtSlots;
      const unsigned buf = tiles_smem + static_cast<unsigned>(k % kRtStages) * kP * kTileBytes + dst_off;
#pragma unroll
      for (int m = 0; m < kRtSlots / kPass; ++m) {
        const int s = vrow + m * kPass;
        const std::int64_t row = base + (s < n ? s : 0);  // rows past n: zeros from a valid address
        cp_async16(buf + m * kPassBytes, khat_item + row * kD, s < n ? 16 : 0);
        if constexpr (kP == 2) cp_async16(buf + kTileBytes + m * kPassBytes, khat_lo_item + row * kD, s < n ? 16 : 0);
      }
    }
    cp_async_commit();
  };
  // Screened passes: the candidate lists follow the staged hi tiles, and the tokens' lo operands
  // (A fragments the screen does not multiply) wait there for the refine or the fallback rather than
  // in registers, register q of k-step kk of thread t at word (kk 4 + q) 32 kRtWarps + t: conflict-free.
  unsigned char* const lists = align_shared_1024(rt_smem_raw) + kRtStages * kTileBytes;
  std::uint32_t* const alo_parked = reinterpret_cast<std::uint32_t*>(lists + rt_screen_list_bytes<kD>());
  const auto parked = [&](int kk, int q) -> std::uint32_t& {
    return alo_parked[(kk * 4 + q) * 32 * kRtWarps + threadIdx.x];
  };
  // the first tiles travel while the tokens' operands are built
#pragma unroll
  for (int s = 0; s < kRtStages - 1; ++s) issue(s, std::integral_constant<int, kScreen ? 1 : kParts>{});
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
  // the screen's margin of tokens r and r + 8: twice the bound on |screened - refined| (see below)
  float two_e[2] = {0.0f, 0.0f};
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
      float a2 = 0.0f;  // |a|^2, for the screen's bound
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
          if constexpr (kScreen) a2 += o0 * o0 + o1 * o1;
          const __nv_bfloat162 hi = __floats2bfloat162_rn(o0, o1);
          ahi[kk][h + 2 * m] = *reinterpret_cast<const std::uint32_t*>(&hi);
          if constexpr (kTerms == 3) {
            const float2 hf = __bfloat1622float2(hi);
            const __nv_bfloat162 lo = __floats2bfloat162_rn(o0 - hf.x, o1 - hf.y);
            if constexpr (kScreen)
              parked(kk, h + 2 * m) = *reinterpret_cast<const std::uint32_t*>(&lo);
            else
              alo[kk][h + 2 * m] = *reinterpret_cast<const std::uint32_t*>(&lo);
          }
        }
      if constexpr (kScreen) {
        a2 += __shfl_xor_sync(0xffffffffu, a2, 1);
        a2 += __shfl_xor_sync(0xffffffffu, a2, 2);
        two_e[h] = sqrtf(a2);
      }
    }
    if constexpr (kScreen) {
      // sum_d |a_d| |K^_d| <= |a| (sqrt(D) max |w_d| + |b|) for every slot (see the screen's bound); the
      // quad's lanes see the weights of all kD dims (after the build: fewer registers live)
      float w_max = 0.0f, b2 = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kK; ++kk)
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int d = kk * 16 + 8 * m + 2 * quad + e;
            w_max = fmaxf(w_max, fabsf(st.ln_w[d]));
            b2 += st.ln_b[d] * st.ln_b[d];
          }
#pragma unroll
      for (int off = 1; off <= 2; off *= 2) {
        w_max = fmaxf(w_max, __shfl_xor_sync(0xffffffffu, w_max, off));
        b2 += __shfl_xor_sync(0xffffffffu, b2, off);
      }
      const float slot_norm = sqrtf(static_cast<float>(kD)) * w_max + sqrtf(b2);
#pragma unroll
      for (int h = 0; h < 2; ++h) two_e[h] *= 2.0f * kRtScreenMargin * slot_norm;
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
  // One accumulator a tile, folded as two groups once the products are done: on the H200 this beat
  // two m64n32k16 groups a tile with the second computed while the first is folded (a 16 sqrt N 32K
  // novelty pass 181 against 186 us; the overlap itself bought 1 %), at the cost of full-width
  // products on the few appended slots of a kRtRouteNew pass (23 against 21 us). No wgmma sits in a
  // branch that depends on the thread (ptxas then serializes every wgmma of the kernel, C7520): warps
  // past the update's tokens take part with zero operands, a wgmma needing the whole warpgroup.
  float sc[kRtSlots / 8][4];
#pragma unroll
  for (int nt = 0; nt < kRtSlots / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[nt][e] = 0.0f;
  // The exact sweep: every tile's kTerms products per k-step, folded by take_group.
  const auto exact_sweep = [&]() {
    for (std::int64_t k = 0; k < tiles; ++k) {
      cp_async_wait<kRtStages - 2>();
      // tile k is visible to the tensor cores (async proxy), and every warpgroup's products of tile
      // k - 1 are done, so the issue below may refill its stage
      fence_proxy_async_shared();
      __syncthreads();
      issue(k + kRtStages - 1, Parts{});
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
  };
  if constexpr (!kScreen) {
    exact_sweep();
  } else {
    // Screen and refine (kTerms = 3: the novelty pass and the routing pass without appends). Only
    // the max (novelty) and the argmax (routes) of a token's scores matter, and a third of the
    // products finds the few slots that can hold them: the sweep multiplies hi.hi only (the
    // kTerms = 1 arithmetic), keeps per token the running max of these screened values, and lists
    // the slots that come within the margin 2 E of it; the listed slots are then refined exactly.
    //
    // The bound E. Token operand a = a_hi + a_lo (fp32 k0 or kg to ~2^-17), slot row b = b_hi + b_lo
    // (khat + khat_lo), each hi the bf16 rounding of the sum, so |a_lo| <= 2^-9 |a|, |a_hi| <= (1 +
    // 2^-9) |a| per dim. The refined value R = sum_d a_d b_d (fp32 FMA on CUDA cores: at least as exact
    // as the three products it replaces, which drop lo.lo) and the screened value S = the tensor
    // cores' fp32 sum of a_hi b_hi differ by
    //   |a.b - a_hi.b_hi| = |a_lo.b + a_hi.b_lo| <= (2^-8 + 2^-18) sum_d |a_d| |b_d|
    // plus the accumulation errors: S's 128 tensor-core additions, counted as truncations of 2^-22
    // relative each, <= D 2^-22 = 2^-15 of sum |a||b| at D = 128, and R's D fp32 roundings, <= 2^-17.
    // So |S - R| <= E = (2^-8 + 2^-11) P with P >= sum_d |a_d| |b_d|, the 2^-11 covering the rest
    // with room to spare (also the fp32 arithmetic of P itself and of the threshold). Every slot row
    // is b = LN_s(Sk_j) = w z + c (ln_w, ln_b; |z|^2 = D var / (var + eps) <= D), hence
    //   sum_d |a_d| |b_d| <= |a| |b| <= |a| (max_d |w_d| sqrt(D) + |c|) = P,
    // one number per token, computed with its operands (two_e = 2 E). (The per-dim form sqrt(D)
    // |a w| + sum_d |a_d c_d| is tighter for uneven weights, but its products in the operand build
    // pushed the kernel past 128 registers.)
    // Candidates. Let m maximize S and j* maximize R (either among the slots of one max). Then S_j*
    // >= R_j* - E >= R_m - E >= S_m - 2E: every slot that may hold the max of R, ties included,
    // has S >= max S - 2E, and a fortiori >= the running max - 2E when its tile is screened, so
    // listing those (and dropping a listed slot once it falls below the risen threshold) keeps every
    // one, and their refined values give the exact max and argmax (ties to the smaller slot). The
    // novelty pass has two maxima: over all slots (the score: sink slots are listed against it) and
    // over the route candidates (slots >= ns0, listed against theirs, the lower threshold).
    // Lists: kRtListCap slots and screened values per lane and token in shared memory (a lane sees
    // a quarter of the slots, those of its accumulator columns); a lane with more candidates of a
    // token than that (many slots within 2 E of its max: repeated keys) overflows, and its whole block
    // falls back to the exact sweep.
    const std::int64_t ns0 = kRoute ? j0 : (j0 > sink ? j0 : sink);  // route candidates: slots >= ns0
    float top[2] = {negative_infinity<float>(), negative_infinity<float>()};      // max S, slots >= ns0
    float top_all[2] = {negative_infinity<float>(), negative_infinity<float>()};  // max S, all (novelty)
    int listed[2] = {0, 0};
    bool overflow = false;
    int* const list_slot = reinterpret_cast<int*>(lists);
    float* const list_value = reinterpret_cast<float*>(lists + 32 * kRtWarps * 2 * kRtListCap * sizeof(int));
    // entry e of token h of lane l: consecutive lanes side by side, a warp's accesses to one e in 32 banks
    const auto entry = [&](int h, int e, int l) { return ((warp * 2 + h) * kRtListCap + e) * 32 + l; };
    const auto threshold = [&](int h, std::int64_t j) { return (j >= ns0 ? top[h] : top_all[h]) - two_e[h]; };
    const auto quad_max = [](float v) {
      v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
      return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
    };
    // a tile's screened values (sc) into the running maxima, then its candidates into the lists
    const auto screen_tile = [&](std::int64_t base) {
      const bool plain = base >= ns0 && base + kRtSlots <= j1;  // every slot a valid route candidate
      const int n = static_cast<int>((j1 - base) < kRtSlots ? (j1 - base) : kRtSlots);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        unsigned mask = 0u;
        if (plain) {
          // every slot of the tile is a route candidate: one maximum, one threshold, no slot tests
          float v[kRtSlots / 8];  // a pair tree: log2 dependent steps
#pragma unroll
          for (int nt = 0; nt < kRtSlots / 8; ++nt) v[nt] = fmaxf(sc[nt][2 * h], sc[nt][2 * h + 1]);
#pragma unroll
          for (int w = kRtSlots / 16; w >= 1; w /= 2)
#pragma unroll
            for (int t = 0; t < w; ++t) v[t] = fmaxf(v[t], v[t + w]);
          const float tile_top = quad_max(v[0]);
          top[h] = fmaxf(top[h], tile_top);
          if constexpr (!kRoute) top_all[h] = fmaxf(top_all[h], tile_top);
          const float thr = top[h] - two_e[h];
          if (!(v[0] >= thr)) continue;
#pragma unroll
          for (int nt = 0; nt < kRtSlots / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) mask |= static_cast<unsigned>(sc[nt][2 * h + e] >= thr) << (2 * nt + e);
        } else {
          // the lane's maxima over its slots of the tile: route candidates, and all
          float lane_top = negative_infinity<float>(), lane_all = negative_infinity<float>();
#pragma unroll
          for (int nt = 0; nt < kRtSlots / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = nt * 8 + 2 * quad + e;
              if (col >= n) continue;
              const float val = sc[nt][2 * h + e];
              if (base + col >= ns0) lane_top = fmaxf(lane_top, val);
              lane_all = fmaxf(lane_all, val);
            }
          top[h] = fmaxf(top[h], quad_max(lane_top));
          if constexpr (!kRoute) top_all[h] = fmaxf(top_all[h], quad_max(lane_all));
          // a quick test (thr <= thr_all: top <= top_all), then the lane's candidates of the tile
          const float thr = top[h] - two_e[h], thr_all = kRoute ? thr : top_all[h] - two_e[h];
          if (!(lane_top >= thr || lane_all >= thr_all)) continue;
#pragma unroll
          for (int nt = 0; nt < kRtSlots / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = nt * 8 + 2 * quad + e;
              const bool take = col < n && sc[nt][2 * h + e] >= (base + col >= ns0 ? thr : thr_all);
              mask |= static_cast<unsigned>(take) << (2 * nt + e);
            }
        }
        while (mask != 0u) {
          const int b = __ffs(mask) - 1;
          mask &= mask - 1u;
          float val = 0.0f;  // value b by selects: no indexed registers (local memory)
#pragma unroll
          for (int t = 0; t < kRtSlots / 4; ++t) val = t == b ? sc[t / 2][2 * h + t % 2] : val;
          const int j = static_cast<int>(base) + (b / 2) * 8 + 2 * quad + b % 2;
          if (listed[h] == kRtListCap) {  // full: drop the entries the risen maxima have passed
            int kept = 0;
            for (int e = 0; e < kRtListCap; ++e) {
              const int s = list_slot[entry(h, e, lane)];
              const float sv = list_value[entry(h, e, lane)];
              if (sv >= threshold(h, s)) {
                list_slot[entry(h, kept, lane)] = s;
                list_value[entry(h, kept, lane)] = sv;
                ++kept;
              }
            }
            listed[h] = kept;
          }
          if (listed[h] == kRtListCap) {
            overflow = true;
            break;
          }
          list_slot[entry(h, listed[h], lane)] = j;
          list_value[entry(h, listed[h], lane)] = val;
          ++listed[h];
          // the refine reads the row at the end; the hi row was just staged (in L2), the lo row was not
          const bf16* const lo_row = st.khat_lo + (i * st.cap + j) * kD;
#pragma unroll
          for (int line = 0; line < kD * 2 / 128; ++line) prefetch_l2(lo_row + line * 64);
        }
      }
    };
    // The sweep's own copies and descriptors, cheap per tile (the sweep's instructions between the
    // products are what bounds it): tile k's rows from a pointer advanced by whole tiles, stages
    // counted rather than taken modulo, each descriptor an add to the first stage's.
    const bf16* const first_rows = khat_item + (j0 + vrow) * kD;
    const auto issue_hi = [&](std::int64_t k, int stage) {
      if (k < tiles) {
        const bf16* const rows = first_rows + k * (kRtSlots * kD);
        const std::int64_t left = j1 - j0 - k * kRtSlots;
        const int n = left < kRtSlots ? static_cast<int>(left) : kRtSlots;
        const unsigned buf = tiles_smem + static_cast<unsigned>(stage) * kTileBytes + dst_off;
#pragma unroll
        for (int m = 0; m < kRtSlots / kPass; ++m) {
          const bool in = vrow + m * kPass < n;  // rows past n: zeros from a valid address (the tile's first row)
          cp_async16(buf + m * kPassBytes, in ? rows + m * kPass * kD : rows - vrow * kD, in ? 16 : 0);
        }
      }
      cp_async_commit();
    };
    const std::uint64_t stage0_desc = wgmma_desc_sw128(tiles_smem, 16, 1024);
    int stage = 0, refill = kRtStages - 1;  // stages of tile k and of tile k + kRtStages - 1
    for (std::int64_t k = 0; k < tiles; ++k) {
      cp_async_wait<kRtStages - 2>();
      fence_proxy_async_shared();  // as in the exact sweep
      __syncthreads();
      issue_hi(k + kRtStages - 1, refill);
      const unsigned stage_off = static_cast<unsigned>(stage) * kTileBytes;
      stage = stage + 1 == kRtStages ? 0 : stage + 1;
      refill = refill + 1 == kRtStages ? 0 : refill + 1;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kK; ++kk)
        wgmma_m64n64k16_rs(sc, ahi[kk], wgmma_desc_advance(stage0_desc, stage_off + sw128_k16_offset(kRtSlots, kk)), kk > 0);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operands(sc);
      wgmma_fence_operands(ahi);
      if (active) screen_tile(j0 + k * kRtSlots);
    }
    if (__syncthreads_or(overflow)) {
      // every warp is past its last tile (the copies still pending are the empty groups): the stages
      // and the lists may take the exact sweep's hi and lo tiles
      cp_async_wait<0>();
#pragma unroll
      for (int kk = 0; kk < kK; ++kk)
#pragma unroll
        for (int q = 0; q < 4; ++q) alo[kk][q] = active ? parked(kk, q) : 0u;  // zeros past the tokens
      __syncthreads();  // every thread has its lo operands back before the tiles overwrite them
#pragma unroll
      for (int s = 0; s < kRtStages - 1; ++s) issue(s, Parts{});
      exact_sweep();
    } else if (active) {
      // Refine. The entries that pass the final maxima (about 1.3 a token) are few and unevenly
      // spread over the lanes, so each lane does not dot its own: the warp's entries become one list
      // of jobs that its 32 lanes share (a round for the warp's 16 tokens, usually), each dot written
      // back over the entry's screened value; the owners then take their entries' refined values in
      // slot order, and the quad merge below the max / argmax of the four lanes'. A dot reads the
      // token's hi and lo fragments, spread over its quad's four lanes, from shared memory (hi parked
      // here in the stage bytes the sweep is done with: every warpgroup's products are complete), 16
      // bytes (4 lanes) at a time, and the slot rows from global memory as 16-byte vectors (the lo rows
      // prefetched to L2 when listed). Each dot is the same sum in the same order whichever lane does it.
      unsigned char* const stage_bytes = align_shared_1024(rt_smem_raw);
      std::uint32_t* const ahi_parked = reinterpret_cast<std::uint32_t*>(stage_bytes);
      constexpr int kWarpJobs = 32 * 2 * kRtListCap;
      std::uint16_t* const jobs = reinterpret_cast<std::uint16_t*>(stage_bytes + kK * 4 * 32 * kRtWarps * sizeof(std::uint32_t)) +
                                  warp * kWarpJobs;
      static_assert(kK * 4 * 32 * kRtWarps * sizeof(std::uint32_t) + kRtWarps * kWarpJobs * sizeof(std::uint16_t) <=
                        std::size_t(kRtStages) * kTileBytes,
                    "parked hi operands and the jobs fit in the stages");
#pragma unroll
      for (int kk = 0; kk < kK; ++kk)
#pragma unroll
        for (int q = 0; q < 4; ++q) ahi_parked[(kk * 4 + q) * 32 * kRtWarps + threadIdx.x] = ahi[kk][q];
      // this lane's jobs: bit h kRtListCap + e for entry e of token h, listed and not passed by the final maxima
      unsigned mine = 0u;
#pragma unroll
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < listed[h]; ++e)
          if (list_value[entry(h, e, lane)] >= threshold(h, list_slot[entry(h, e, lane)])) mine |= 1u << (h * kRtListCap + e);
      // the lane's place in the warp's job list: an inclusive scan of the counts
      int upto = __popc(mine);
#pragma unroll
      for (int off = 1; off < 32; off *= 2) {
        const int v = __shfl_up_sync(0xffffffffu, upto, off);
        if (lane >= off) upto += v;
      }
      const int total = __shfl_sync(0xffffffffu, upto, 31);
      for (unsigned bits = mine, at = upto - __popc(mine); bits != 0u; bits &= bits - 1u, ++at)
        jobs[at] = static_cast<std::uint16_t>((lane << 8) | (__ffs(bits) - 1));  // owner lane, entry bit
      __syncwarp();  // the jobs and the parked operands of the warp's lanes are visible
      const auto widen = [](std::uint32_t w) { return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u)); };
      for (int t = lane; t < total; t += 32) {
        const int owner = jobs[t] >> 8, bit = jobs[t] & 0xff, h = bit / kRtListCap;
        const int at_entry = entry(h, bit % kRtListCap, owner), j = list_slot[at_entry];
        const int quad0 = warp * 32 + (owner & ~3);
        const uint4* const hw = reinterpret_cast<const uint4*>(st.khat + (i * st.cap + j) * kD);
        const uint4* const lw = reinterpret_cast<const uint4*>(st.khat_lo + (i * st.cap + j) * kD);
        float dot = 0.0f;
#pragma unroll
        for (int kk = 0; kk < kK; ++kk)
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            // words kk*8 + 4m + {0..3} of the row: dims kk*16 + 8m .. + 7, lane quad0 + x holding word x
            const int at = (kk * 4 + h + 2 * m) * 32 * kRtWarps + quad0;
            const uint4 th = *reinterpret_cast<const uint4*>(ahi_parked + at);
            const uint4 tl = *reinterpret_cast<const uint4*>(alo_parked + at);
            const uint4 bh = hw[kk * 2 + m], bl = lw[kk * 2 + m];
            const std::uint32_t ta[4] = {th.x, th.y, th.z, th.w}, tb[4] = {tl.x, tl.y, tl.z, tl.w};
            const std::uint32_t ra[4] = {bh.x, bh.y, bh.z, bh.w}, rb[4] = {bl.x, bl.y, bl.z, bl.w};
#pragma unroll
            for (int x = 0; x < 4; ++x) {
              // hi + lo is exact in fp32 (17 significant bits)
              const float2 ah = widen(ta[x]), al = widen(tb[x]), bhf = widen(ra[x]), blf = widen(rb[x]);
              dot = fmaf(ah.x + al.x, bhf.x + blf.x, dot);
              dot = fmaf(ah.y + al.y, bhf.y + blf.y, dot);
            }
          }
        list_value[at_entry] = dot;
      }
      __syncwarp();  // the refined values are back in the owners' entries
#pragma unroll
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < listed[h]; ++e) {
          if (!((mine >> (h * kRtListCap + e)) & 1u)) continue;
          const int j = list_slot[entry(h, e, lane)];
          const float dot = list_value[entry(h, e, lane)];
          if constexpr (kRoute) {
            if (arg[h] < 0 || dot > best[h] || (dot == best[h] && j < arg[h])) {
              best[h] = dot;
              arg[h] = j;
            }
          } else {
            if (dot > best[h]) best[h] = dot;
            if (j >= ns0 && (carg[h] < 0 || dot > cbest[h] || (dot == cbest[h] && j < carg[h]))) {
              cbest[h] = dot;
              carg[h] = j;
            }
          }
        }
    }
  }
#else
  // lane l points at slot row l % 8 of 8x8 matrix l / 8: matrices 0, 1 are slot group 2p, dims +0, +8
  // of the k-step, matrices 2, 3 the same of group 2p + 1 (the b0, b1 of two mma)
  const unsigned lane_off = static_cast<unsigned>((((lane / 16) * 8 + lane % 8) * kPitch + ((lane / 8) % 2) * 8) * 2);
  for (std::int64_t k = 0; k < tiles; ++k) {
    cp_async_wait<kRtStages - 2>();
    // tile k is visible, and every warp is done with tile k - 1, whose stage the issue below refills
    __syncthreads();
    issue(k + kRtStages - 1, Parts{});
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
    const float ob = __shfl_xor_sync(0xffffffffu, b, off);
    const int og = __shfl_xor_sync(0xffffffffu, g, off);
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
      score = fmaxf(score, __shfl_xor_sync(0xffffffffu, score, 1));
      best[h] = fmaxf(score, __shfl_xor_sync(0xffffffffu, score, 2));
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
      st.rbest[c] = cbest[h];  // an update always has a non-sink slot (|S| >= C > sink): carg >= 0
      st.target[c] = carg[h];  // the appends mark theirs -1 after this pass
    } else if constexpr (kMode == kRtRoute) {  // no appends: every token merges
      st.target[c] = arg[h];
    } else {  // an appended slot wins only if strictly better: ties go to the older, smaller slot
      if (st.target[c] != -1 && arg[h] >= 0 && best[h] > st.rbest[c]) st.target[c] = arg[h];
    }
  }
}

}  // namespace kvmem::cuda::kvm_detail
