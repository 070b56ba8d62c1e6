// SPDX-License-Identifier: Apache-2.0
#pragma once
// Matrix-core KVM prefill readout for bf16 storage on AMD GPUs (gfx90a, gfx94x; spec KVM.md 4.4): the joint
// online softmax of attend_rows_kernel over [state slots | causal window], with q.k and p.v on MFMA
// (mfma_tiles.hpp's AttendTile: bf16 operands, fp32 accumulation, the weights rounded to bf16 before p.v
// as on the NVIDIA tensor cores) and the portable kernels' online softmax (core/softmax.hpp). It reads
// the keys where the NVIDIA tensor-core readout reads them (TcSources: the state's readout copies, the
// window ring or the call's inputs), so both vendors share the host dispatch (kvm.cuh).
// A block holds kMfmaReadoutRows query rows of one head, wavefront w the rows 32 w .. 32 w + 31 (its
// query columns); keys and values arrive in tiles of mfma::kTileKeys rows, staged as bf16 in shared
// memory.

#include "kvmem/backend/cuda/vendor.cuh"

#if KVMEM_GPU_MFMA_PATHS
#include <cstdint>

#include "kvmem/backend/cuda/kvm_kernels.cuh"
#include "kvmem/backend/cuda/mfma_tiles.hpp"
#include "kvmem/backend/cuda/mfma_wave.cuh"
#include "kvmem/core/numeric.hpp"

namespace kvmem::cuda::kvm_detail {

inline constexpr int kMfmaReadoutWaves = 4;
inline constexpr int kMfmaReadoutThreads = mfma::kLanes * kMfmaReadoutWaves;
inline constexpr int kMfmaReadoutRows = mfma::kN * kMfmaReadoutWaves;  // query rows per block

// Shared memory: one key tile, bf16 rows of kD + 8 elements (16-byte rows for the staging copies, 8-byte
// operands for the products), and one value tile transposed (AttendTile: [dim][key], rows past kDv
// zero). 35 KB at D = 128.
template <int kD, int kDv>
struct MfmaReadoutLayout {
  static_assert(kD % 8 == 0 && kDv % 8 == 0, "the MFMA readout takes head dims that are multiples of 8");
  static constexpr int kKPitch = kD + 8, kVPitch = mfma::kTileKeys + 4;
  static constexpr int kVRows = mfma::AttendTile<mfma::DeviceWave, kD, kDv>::kValueRows;
  static constexpr std::size_t kK = 0;
  static constexpr std::size_t kV = std::size_t(mfma::kTileKeys) * kKPitch * 2;
  static constexpr std::size_t kBytes = kV + std::size_t(kVRows) * kVPitch * 2;
  static_assert(kBytes <= 64 * 1024, "the MFMA readout's tiles fit a CDNA workgroup's shared memory");
};

// Readout of rows [t0, t1) on the matrix cores: block rb of head bh = b*Hq + h holds rows t0 + rb *
// kMfmaReadoutRows + [0, kMfmaReadoutRows); the row blocks of one head are adjacent in the grid (they read
// the head's tiles from L2 together). Key tiles are [state slots...][window...] in steps of kTileKeys:
// state keys are seen by every row (spec 4.4), window keys causally, each with its head's temperature.
// grid B*Hq*ceil((t1 - t0) / kMfmaReadoutRows), block kMfmaReadoutThreads, dynamic smem
// MfmaReadoutLayout::kBytes. q: [B,Hq,T,kD], out: [B,T,Hq,kDv]
template <class In, class Out, int kD, int kDv>
__global__ void __launch_bounds__(kMfmaReadoutThreads)
    attend_mfma_kernel(DeviceState<bf16, float> st, TcSources src, const In* q, Out* out, std::int64_t T,
                       std::int64_t n0, std::int64_t t0, std::int64_t t1, std::int64_t w, std::int64_t slots) {
  using L = MfmaReadoutLayout<kD, kDv>;
  using W = mfma::DeviceWave;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* ks = reinterpret_cast<bf16*>(smem_raw + L::kK);
  bf16* vs = reinterpret_cast<bf16*>(smem_raw + L::kV);
  const int wave = static_cast<int>(threadIdx.x) / mfma::kLanes;
  const std::int64_t row_blocks = (t1 - t0 + kMfmaReadoutRows - 1) / kMfmaReadoutRows;
  const std::int64_t bh = blockIdx.x / row_blocks, rb = blockIdx.x % row_blocks;
  const std::int64_t Hq = st.Hq, b = bh / Hq, h = bh % Hq, item = b * st.Hk + h / st.rep();
  const std::int64_t row0 = t0 + rb * kMfmaReadoutRows;  // the block's first row
  const std::int64_t last_t = (row0 + kMfmaReadoutRows - 1) < (t1 - 1) ? (row0 + kMfmaReadoutRows - 1) : (t1 - 1);
  const std::int64_t wave_row0 = row0 + wave * mfma::kN;  // the row of query column 0 of this wavefront
  const float ls_state = st.scale * (st.head_temps ? st.tau_s[h] : 1.0f);
  const float ls_window = st.scale * (st.head_temps ? st.tau_w[h] : 1.0f);
  mfma::zero_rows(vs, L::kVPitch, kDv, L::kVRows);  // never written again (published by the first barrier)

  mfma::AttendTile<W, kD, kDv> tile;
  tile.begin([&](int col) -> const In* {
    const std::int64_t t = wave_row0 + col;
    return t < t1 ? q + ((b * Hq + h) * T + (t - n0)) * kD : nullptr;
  });
  const std::int64_t n_state = w > 0 ? slots : 0;
  const std::int64_t state_tiles = (n_state + mfma::kTileKeys - 1) / mfma::kTileKeys;
  const std::int64_t tiles = state_tiles + (last_t + 1 - w + mfma::kTileKeys - 1) / mfma::kTileKeys;
  for (std::int64_t k = 0; k < tiles; ++k) {
    // tile k: slots base .. or window positions base .., n of them
    const bool in_state = k < state_tiles;
    const std::int64_t base = in_state ? k * mfma::kTileKeys : w + (k - state_tiles) * mfma::kTileKeys;
    const std::int64_t end = in_state ? n_state : last_t + 1;
    const int n = static_cast<int>(end - base < mfma::kTileKeys ? end - base : mfma::kTileKeys);
    // window position p: ring row p mod W, or input row p - n0
    const auto window_row = [&](std::int64_t p) { return src.ring ? p % st.W : p - src.first; };
    __syncthreads();  // the previous tile is consumed
    mfma::stage_rows<kD>(ks, L::kKPitch, mfma::kTileKeys, n, [&](int s) {
      return in_state ? src.khat + (item * st.cap + base + s) * kD
                      : src.wk + (item * src.rows + window_row(base + s)) * kD;
    });
    mfma::stage_transposed<kDv>(vs, L::kVPitch, mfma::kTileKeys, n, [&](int s) {
      return in_state ? src.vhat + (item * st.cap + base + s) * kDv
                      : src.wv + (item * src.rows + window_row(base + s)) * kDv;
    });
    __syncthreads();
    const float ls = in_state ? ls_state : ls_window;
    tile.step(ks, L::kKPitch, vs, L::kVPitch, [&](int key, int col, float dot) {
      const std::int64_t t = wave_row0 + col;
      const bool visible = key < n && t < t1 && (in_state || base + key <= t);
      return visible ? ls * dot : negative_infinity<float>();
    });
  }
  tile.finish([](int, int, float, float) {},
              [&](int, int col, int d, float o, float sum) {
                const std::int64_t t = wave_row0 + col;
                if (t < t1)
                  out[((b * T + (t - n0)) * Hq + h) * kDv + d] = store_as<Out>(o * (sum > 0.0f ? 1.0f / sum : 0.0f));
              });
}

}  // namespace kvmem::cuda::kvm_detail
#endif  // KVMEM_GPU_MFMA_PATHS
