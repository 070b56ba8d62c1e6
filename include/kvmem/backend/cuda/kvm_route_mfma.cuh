// SPDX-License-Identifier: Apache-2.0
#pragma once
// State update of KV Means on the AMD matrix cores (gfx90a, gfx94x; bf16 storage, spec KVM.md 4.5 steps 2
// and 4): the novelty and routing passes of update_tc_scores_kernel (kvm_route_tc.cuh, RtMode) as
// [slots x tokens] products on MFMA (mfma_tiles.hpp's RouteTile: the tokens' LN_s, the hi/lo split of
// tokens and slots, running maxima with first-slot ties). Same inputs and outputs as the NVIDIA kernel,
// so the update chain around it (appends, scatter) is the one both vendors run.
// A block holds kMfmaRouteTokens tokens of one item, wavefront w the tokens 32 w .. 32 w + 31 of it (its
// columns); slots arrive in tiles of kMfmaRouteSlots rows (khat as hi, khat_lo as lo) staged in shared
// memory, two MFMA steps of 32 slots each.

#include "kvmem/backend/cuda/vendor.cuh"

#if KVMEM_GPU_MFMA_PATHS
#include <cstdint>

#include "kvmem/backend/cuda/common.cuh"
#include "kvmem/backend/cuda/kvm_kernels.cuh"
#include "kvmem/backend/cuda/mfma_tiles.hpp"
#include "kvmem/backend/cuda/mfma_wave.cuh"
#include "kvmem/core/numeric.hpp"

namespace kvmem::cuda::kvm_detail {

inline constexpr int kMfmaRouteWaves = 4;
inline constexpr int kMfmaRouteThreads = mfma::kLanes * kMfmaRouteWaves;
inline constexpr int kMfmaRouteTokens = mfma::kN * kMfmaRouteWaves;  // tokens per block
inline constexpr int kMfmaRouteSlots = 2 * mfma::kRouteSlots;        // slots per staged tile

// Shared memory: a hi and a lo tile of kMfmaRouteSlots slot rows, bf16 rows of kD + 8 elements (16-byte
// rows for the staging copies, 8-byte operands for the products). 34 KB at D = 128.
template <int kD>
struct MfmaRouteLayout {
  static constexpr int kPitch = kD + 8;
  static constexpr std::size_t kTile = std::size_t(kMfmaRouteSlots) * kPitch * 2;
  static constexpr std::size_t kBytes = 2 * kTile;
  static_assert(kBytes <= 64 * 1024, "the MFMA routing tiles fit a CDNA workgroup's shared memory");
};

// One pass (kMode: RtMode) for the update of tokens [a, a + C) over slots [j0, j1), as
// update_tc_scores_kernel: kRtNovelty and kRtRoute also write the fp32 kg rows (and the k0 rows of ungated
// appends) that the appends and the scatter add, so every consumer of a token's kg sees the same values.
// Block b takes item b / tb, tokens [(b % tb) kMfmaRouteTokens, + kMfmaRouteTokens), tb = ceil(C /
// kMfmaRouteTokens): the token blocks of an item are adjacent in launch order and share its slots in L2.
// grid (I tb), block kMfmaRouteThreads, dynamic smem MfmaRouteLayout<kD>::kBytes.
template <int kD, int kTerms, int kMode>
__global__ void __launch_bounds__(kMfmaRouteThreads)
    update_mfma_scores_kernel(DeviceState<bf16, float> st, std::int64_t a, std::int64_t j0, std::int64_t j1) {
  using L = MfmaRouteLayout<kD>;
  using W = mfma::DeviceWave;
  constexpr bool kNovelty = kMode == kRtNovelty;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* hi_tile = reinterpret_cast<bf16*>(smem_raw);
  bf16* lo_tile = reinterpret_cast<bf16*>(smem_raw + L::kTile);
  const std::int64_t C = st.C, tb = (C + kMfmaRouteTokens - 1) / kMfmaRouteTokens;
  const std::int64_t i = blockIdx.x / tb;
  const int wave = static_cast<int>(threadIdx.x) / mfma::kLanes, lane = W::lane();
  const std::int64_t c0 = (std::int64_t(blockIdx.x) % tb) * kMfmaRouteTokens + wave * mfma::kN;  // column 0's token
  const auto live = [&](int col) { return c0 + col < C; };
  // the lane's token (column lane_col(lane)): its gate, and the rows its kg / k0 go to
  const std::int64_t c_lane = c0 + mfma::lane_col(lane);
  const bool lane_live = c_lane < C;
  const float gate = lane_live ? token_gate(st, i, a + c_lane) : 0.0f;
  float* kg_row = st.kg + (i * C + c_lane) * kD;
  float* k0_row = st.k0 + (i * C + c_lane) * kD;

  // the tokens' operands: k0 = LN_s of the key (spec 4.2), routed as k0 (novelty, appended slots) or as
  // kg = g k0 (routing without appends); the pass that sees the tokens first writes their rows
  mfma::RouteTile<W, kD, kTerms> tile;
  tile.prepare(
      live, [&](int col, int d) { return load_as<float>(token_key(st, i, a + c0 + col)[d]); }, st.ln_w, st.ln_b, st.eps,
      static_cast<int>(st.rope_dims),
      [&](int, int, int d, float k0) {
        const float kg = gated_key(st.merge_gate_keys, gate, k0);
        if (kMode != kRtRouteNew) kg_row[d] = kg;
        if (kMode == kRtNovelty && !st.gate_appends) k0_row[d] = k0;
        return kMode == kRtRoute ? kg : k0;
      });

  // slot tiles: khat rows as hi, khat_lo rows as lo (zeros past j1)
  const bf16* khat_item = st.khat + i * st.cap * kD;
  const bf16* khat_lo_item = st.khat_lo + i * st.cap * kD;
  constexpr int kVec = kD / 8;
  for (std::int64_t base = j0; base < j1; base += kMfmaRouteSlots) {
    const int n = static_cast<int>(j1 - base < kMfmaRouteSlots ? j1 - base : kMfmaRouteSlots);
    __syncthreads();  // the previous tile is consumed
    for (int x = static_cast<int>(threadIdx.x); x < kMfmaRouteSlots * kVec; x += kMfmaRouteThreads) {
      const int s = x / kVec, cv = x % kVec;
      uint4 h = make_uint4(0u, 0u, 0u, 0u), l = h;
      if (s < n) {
        h = reinterpret_cast<const uint4*>(khat_item + (base + s) * kD)[cv];
        if constexpr (kTerms == 3) l = reinterpret_cast<const uint4*>(khat_lo_item + (base + s) * kD)[cv];
      }
      *reinterpret_cast<uint4*>(hi_tile + s * L::kPitch + cv * 8) = h;
      if constexpr (kTerms == 3) *reinterpret_cast<uint4*>(lo_tile + s * L::kPitch + cv * 8) = l;
    }
    __syncthreads();
    for (int part = 0; part * mfma::kRouteSlots < n; ++part) {  // block-uniform: every lane takes both steps
      const int off = part * mfma::kRouteSlots;
      const int m = n - off < mfma::kRouteSlots ? n - off : mfma::kRouteSlots;
      tile.template step<kNovelty>(hi_tile + off * L::kPitch, lo_tile + off * L::kPitch, L::kPitch,
                                   static_cast<int>(base) + off, m, static_cast<int>(st.sink));
    }
  }
  tile.template finish<kNovelty>();
  if (!lane_live || mfma::lane_half(lane) != 0) return;
  const std::int64_t c = i * C + c_lane;
  if constexpr (kMode == kRtNovelty) {
    st.score[c] = tile.best;
    st.rbest[c] = tile.cbest;                // an update always has a non-sink slot (|S| >= C > sink): carg >= 0
    st.target[c] = tile.carg;                // the appends mark theirs -1 after this pass
  } else if constexpr (kMode == kRtRoute) {  // no appends: every token merges
    st.target[c] = tile.arg;
  } else {  // an appended slot wins only if strictly better: ties go to the older, smaller slot
    if (st.target[c] != -1 && tile.arg >= 0 && tile.best > st.rbest[c]) st.target[c] = tile.arg;
  }
}

// One pass of update_mfma_scores_kernel (kMode: RtMode) for the update of tokens [a, a + C) over slots
// [j0, j1); bf16 storage with d.tc_route only (head dims 64 and 128).
template <int kD, int kTerms, int kMode>
Status launch_mfma_scores_as(const Executor& exec, const DeviceState<bf16, float>& d, std::int64_t items,
                             std::int64_t a, std::int64_t j0, std::int64_t j1) {
  const auto kernel = update_mfma_scores_kernel<kD, kTerms, kMode>;
  constexpr std::size_t bytes = MfmaRouteLayout<kD>::kBytes;
  KVMEM_RETURN_IF_ERROR(allow_shared(kernel, bytes));
  const std::int64_t blocks = items * ((d.C + kMfmaRouteTokens - 1) / kMfmaRouteTokens);
  kernel<<<static_cast<unsigned>(blocks), kMfmaRouteThreads, bytes, exec.stream>>>(d, a, j0, j1);
  return to_status(cudaGetLastError(), kMode == kRtNovelty ? "kvm update_mfma_scores_kernel (novelty)"
                                                           : "kvm update_mfma_scores_kernel (routes)");
}

}  // namespace kvmem::cuda::kvm_detail
#endif  // KVMEM_GPU_MFMA_PATHS
