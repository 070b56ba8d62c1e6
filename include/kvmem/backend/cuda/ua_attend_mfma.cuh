// SPDX-License-Identifier: Apache-2.0
#pragma once
// Matrix-core chunk kernel of Universal Attention for bf16 storage on AMD GPUs (gfx90a, gfx94x; spec UA.md
// 4.1-4.3): the work of chunk_attend_kernel (ua_kernels.cuh) -- one split of one item's entries, every row
// of the chunk, λ carried in increasing position -- with the key/key similarity of the decay tile and the
// two attention products on MFMA (mfma_tiles.hpp: product_abt, AttendTile). What is not a product is the
// portable kernels' code: the gates and positions of a tile (load_row_gates, load_entry_meta), the decay
// fold (kernel/ua_decay.hpp), the λ carry (carry_lambda), the online softmax (core/softmax.hpp) and the
// partials, which merge_kernel merges as it merges theirs. It serves every UA prefill on AMD (p = 0
// included: the chunks of ua_prefill, whose dense single-launch kernel is NVIDIA's) and the prefill rows
// of a slot step.
//
// Four wavefronts; a row tile holds kMfmaPairs (head, row) pairs = r heads x (kMfmaPairs / r) rows, and
// wavefront w its query columns 32 w .. 32 w + 31 (pair p: head p / rows, row p % rows); entries arrive in
// tiles of kEntryTile, staged as bf16 rows in shared memory with the row tile's keys.

#include "kvmem/backend/cuda/vendor.cuh"

#if KVMEM_GPU_MFMA_PATHS
#include <cstdint>

#include "kvmem/backend/cuda/mfma_tiles.hpp"
#include "kvmem/backend/cuda/mfma_wave.cuh"
#include "kvmem/backend/cuda/ua_kernels.cuh"
#include "kvmem/core/numeric.hpp"
#include "kvmem/kernel/ua_decay.hpp"

namespace kvmem::cuda::ua_detail {

inline constexpr int kMfmaWaves = 4;
inline constexpr int kMfmaThreads = mfma::kLanes * kMfmaWaves;
inline constexpr int kMfmaPairs = mfma::kN * kMfmaWaves;  // (head, row) pairs per row tile
inline constexpr int kMfmaRows = mfma::kM;                // rows per row tile at most (r >= 4)
static_assert(mfma::kTileKeys == kEntryTile, "an entry tile is one step of the attention tile");

// Group sizes the MFMA kernel takes: r divides kMfmaPairs and leaves at most kMfmaRows rows per tile (the
// similarity of an entry block and the row tile's keys is one 32 x 32 product).
__host__ __device__ inline bool mfma_group_ok(std::int64_t r) {
  return r == 4 || r == 8;
}

// Shared memory: the key tile and the row tile's keys (bf16 rows of kD + 8 elements: 16-byte rows for the
// staging copies, 8-byte operands for the products), the value tile transposed (AttendTile: [dim][entry],
// rows past kD zero), the decay tile [entry][row] (similarity -> A -> Λ), and the gates and positions of
// the entries and rows. 53 KB at D = 128, inside the 64 KB of a CDNA workgroup.
template <int kD>
struct UaMfmaLayout {
  static_assert(kD % 8 == 0, "the MFMA UA kernel takes head dims that are multiples of 8");
  static constexpr int kKPitch = kD + 8;  // bf16
  static constexpr int kVRows = mfma::AttendTile<mfma::DeviceWave, kD, kD>::kValueRows;
  static constexpr int kVPitch = kEntryTile + 4;                                   // bf16
  static constexpr int kAPitch = kMfmaRows + 4;                                    // float
  static constexpr std::size_t kK = 0;                                             // [kEntryTile][kKPitch] keys
  static constexpr std::size_t kV = kK + std::size_t(kEntryTile) * kKPitch * 2;    // [kVRows][kVPitch] values
  static constexpr std::size_t kNK = kV + std::size_t(kVRows) * kVPitch * 2;       // [kMfmaRows][kKPitch]
  static constexpr std::size_t kA = kNK + std::size_t(kMfmaRows) * kKPitch * 2;    // [kEntryTile][kAPitch]
  static constexpr std::size_t kPos = kA + std::size_t(kEntryTile) * kAPitch * 4;  // [kEntryTile] int64
  static constexpr std::size_t kMeta = kPos + std::size_t(kEntryTile) * 8;         // e_logit, e_part, r_logit, r_part
  static constexpr std::size_t kBytes = kMeta + std::size_t(2 * kEntryTile + 2 * kMfmaRows) * 4;
  static_assert(kBytes <= 64 * 1024, "the MFMA UA kernel's tiles fit a CDNA workgroup's shared memory");
};

// grid (splits, I), block kMfmaThreads, dynamic smem UaMfmaLayout<kD>::kBytes. Same arguments and outputs
// as chunk_attend_kernel; S is bf16, rows of q/k/v 16-byte aligned (checked by the launcher).
template <class Set, int kD>
__global__ void __launch_bounds__(kMfmaThreads)
    chunk_attend_mfma_kernel(DeviceCache<bf16> c, DeviceCall<bf16> a, std::int64_t call_t0, std::int64_t call_rows) {
  using L = UaMfmaLayout<kD>;
  using W = mfma::DeviceWave;
  extern __shared__ __align__(128) unsigned char smem_raw[];  // one symbol in ua_detail: as ua_kernels.cuh
  bf16* ks = reinterpret_cast<bf16*>(smem_raw + L::kK);
  bf16* vs = reinterpret_cast<bf16*>(smem_raw + L::kV);
  bf16* nk = reinterpret_cast<bf16*>(smem_raw + L::kNK);
  float* at = reinterpret_cast<float*>(smem_raw + L::kA);  // [entry][row]: similarity -> A -> Λ
  std::int64_t* e_pos = reinterpret_cast<std::int64_t*>(smem_raw + L::kPos);
  float* e_logit = reinterpret_cast<float*>(smem_raw + L::kMeta);
  float* e_part = e_logit + kEntryTile;
  float* r_logit = e_part + kEntryTile;
  float* r_part = r_logit + kMfmaRows;

  ChunkWork w;
  if (!chunk_work(c, a, blockIdx.y, call_t0, call_rows, w)) return;
  const std::int64_t D = kD, r = c.r, item = w.item, b = w.b, g = item % c.G, t0 = w.t0, rows = w.rows;
  const int rt = static_cast<int>(kMfmaPairs / r);  // chunk rows per row tile (32 or 16)
  const std::int64_t n = c.length[item], total = n + rows;
  const std::int64_t piece = split_piece(total, a.splits, kEntryTile);
  const std::int64_t e_begin = blockIdx.x * piece;
  if (e_begin >= total) return;
  const std::int64_t e_end = e_begin + piece < total ? e_begin + piece : total;
  const std::int64_t first = c.counter[item];  // absolute position of the chunk's row 0 (input row t0)
  const int wave = static_cast<int>(threadIdx.x) / mfma::kLanes;
  const bf16* in_k = a.k + b * a.k_b + g * a.k_g;
  const bf16* in_v = a.v + b * a.v_b + g * a.v_g;
  mfma::zero_rows(vs, L::kVPitch, kD, L::kVRows);  // never written again (published by the first barrier)

  for (std::int64_t r0 = 0; r0 < rows; r0 += rt) {
    const int nr = static_cast<int>(rows - r0 < rt ? rows - r0 : rt);
    const std::int64_t m_last = first + r0 + nr - 1;
    __syncthreads();  // the previous row tile is fully consumed (nk, the row gates)
    // the row tile's keys (zeros past the chunk: their similarity rows are never read) and query-side gates
    mfma::stage_rows<kD>(nk, L::kKPitch, kMfmaRows, nr, [&](int i) { return in_k + (t0 + r0 + i) * a.k_t; });
    load_row_gates(a, b, g, t0 + r0, nr, r_logit, r_part);
    // the wavefront's query columns: pair 32 wave + col
    mfma::AttendTile<W, kD, kD> tile;
    tile.begin([&](int col) -> const bf16* {
      const int p = mfma::kN * wave + col, h = p / rt, i = p % rt;
      return i < nr ? a.q + b * a.q_b + (g * r + h) * a.q_h + (t0 + r0 + i) * a.q_t : nullptr;
    });

    for (std::int64_t e0 = e_begin; e0 < e_end; e0 += kEntryTile) {
      if (e0 >= n && first + (e0 - n) > m_last) break;  // the call's keys beyond this row tile: masked
      const int ne = static_cast<int>(e_end - e0 < kEntryTile ? e_end - e0 : kEntryTile);
      __syncthreads();  // previous entry tile consumed; nk written
      // entries: cached rows below n, then the call's own keys; zero rows past the tile
      const auto key_row = [&](int e) {
        const std::int64_t idx = e0 + e;
        return idx < n ? c.keys + c.row(item, idx) * D : in_k + (t0 + idx - n) * a.k_t;
      };
      const auto value_row = [&](int e) {
        const std::int64_t idx = e0 + e;
        return idx < n ? c.values + c.row(item, idx) * D : in_v + (t0 + idx - n) * a.v_t;
      };
      mfma::stage_rows<kD>(ks, L::kKPitch, kEntryTile, ne, key_row);
      mfma::stage_transposed<kD>(vs, L::kVPitch, kEntryTile, ne, value_row);
      load_entry_meta(c, a, item, b, n, t0, first, e0, ne, e_logit, e_part, e_pos);
      __syncthreads();
      // similarity tile K NK^T [entries x rows] on the matrix cores: one 32-entry block per wavefront
      if constexpr (Set::kNeedsSimilarity) {
        if (wave < kEntryTile / mfma::kM)
          mfma::product_abt<W, kD>(ks + wave * mfma::kM * L::kKPitch, L::kKPitch, nk, L::kKPitch,
                                   at + wave * mfma::kM * L::kAPitch, L::kAPitch);
        __syncthreads();
      }
      // A(e, m) from the similarity (spec 4.1), 0 where m <= pos_e
      decay_tile<Set>(at, L::kAPitch, ne, rt, nr, first + r0, e_pos, e_logit, e_part, r_logit, r_part,
                      [&](std::int64_t e, std::int64_t i) { return at[e * L::kAPitch + i]; });
      __syncthreads();
      carry_lambda(c, a, item, n, first, r0, nr, e0, ne, e_pos, at, L::kAPitch);
      __syncthreads();
      // logits = q.k + Λ (scale 1), online softmax, O += P V
      tile.step(ks, L::kKPitch, vs, L::kVPitch, [&](int key, int col, float dot) {
        const int i = (mfma::kN * wave + col) % rt;
        const float bias = (i < nr && key < ne) ? at[key * L::kAPitch + i] : negative_infinity<float>();
        return bias == negative_infinity<float>() ? bias : dot + bias;
      });
    }
    // this split's partial of every live pair row: max, sum (both halves of a column), unnormalised O
    const auto slot_of = [&](int col) {
      const int p = mfma::kN * wave + col;
      return ((item * a.splits + blockIdx.x) * r + p / rt) * a.P + (r0 + p % rt);
    };
    tile.finish(
        [&](int, int col, float mx, float sum) {
          if ((mfma::kN * wave + col) % rt >= nr) return;
          const std::int64_t slot = slot_of(col);
          a.part_ml[slot * 2] = mx;
          a.part_ml[slot * 2 + 1] = sum;
        },
        [&](int, int col, int d, float o, float) {
          if ((mfma::kN * wave + col) % rt < nr) a.part_acc[slot_of(col) * D + d] = o;
        });
  }
}

}  // namespace kvmem::cuda::ua_detail
#endif  // KVMEM_GPU_MFMA_PATHS
