// SPDX-License-Identifier: Apache-2.0
#pragma once
// Tensor-core chunk kernel of Universal Attention for bf16 storage (spec UA.md 4.1-4.3): the same
// work as chunk_attend_kernel (ua_kernels.cuh) -- one split of one item's entries, every row of the
// chunk, λ carried in increasing position -- with the three products on the tensor cores (WMMA
// 16x16x16, bf16 operands, fp32 accumulation): the key/key similarity of the decay tile (shared by the
// r query heads of the group), q.k, and p.v. Like FlashAttention, the probabilities are rounded to bf16
// before p.v; logits, λ, the running max/sum and the accumulator stay fp32.
//
// Eight warps; a row tile holds kTcQueryRows (head, row) pairs = r heads x (kTcQueryRows / r) rows, each
// warp owns 16 of them (one head); entries arrive in tiles of kTcEntries staged in shared memory.

#include <cuda_bf16.h>
#include <mma.h>

#include <cstdint>

#include "kvmem/backend/cuda/ptx.cuh"
#include "kvmem/backend/cuda/ua_kernels.cuh"
#include "kvmem/backend/cuda/vendor.cuh"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"
#include "kvmem/kernel/ua_decay.hpp"

namespace kvmem::cuda::ua_detail {

inline constexpr int kTcWarps = 8;
inline constexpr int kTcQueryRows = 16 * kTcWarps;  // (head, row) pairs per row tile
inline constexpr int kTcEntries = 64;               // entries per tile

// Group sizes the tensor-core kernel takes: r divides 128 and leaves at most 32 rows per tile (the
// decay tile and the tile's keys then fit next to the per-warp buffers).
__host__ __device__ inline bool tc_group_ok(std::int64_t r) {
  return r == 4 || r == 8;
}

template <int kD>
struct UaTcLayout {
  static constexpr int kRows = 32;        // chunk rows per row tile at most (r >= 4)
  static constexpr int kQPitch = kD + 8;  // bf16; +16 bytes per row breaks bank conflicts
  static constexpr int kKPitch = kD + 8;
  static constexpr int kAPitch = kRows + 4;       // float: decay / bias tile [entry][row]
  static constexpr int kSPitch = kTcEntries + 4;  // float
  static constexpr int kPPitch = kTcEntries + 8;  // bf16
  static constexpr int kOPitch = kD + 4;          // float
  static constexpr std::size_t align(std::size_t x) { return (x + 127) / 128 * 128; }
  static constexpr std::size_t kQ = 0;
  static constexpr std::size_t kK = align(kQ + std::size_t(kTcQueryRows) * kQPitch * 2);
  static constexpr std::size_t kV = align(kK + std::size_t(kTcEntries) * kKPitch * 2);
  static constexpr std::size_t kNK = align(kV + std::size_t(kTcEntries) * kKPitch * 2);
  static constexpr std::size_t kA = align(kNK + std::size_t(kRows) * kKPitch * 2);
  static constexpr std::size_t kS = align(kA + std::size_t(kTcEntries) * kAPitch * 4);
  static constexpr std::size_t kP = align(kS + std::size_t(kTcQueryRows) * kSPitch * 4);
  static constexpr std::size_t kO = align(kP + std::size_t(kTcQueryRows) * kPPitch * 2);
  static constexpr std::size_t kMeta = align(kO + std::size_t(kTcQueryRows) * kOPitch * 4);
  static constexpr std::size_t kBytes = align(kMeta + std::size_t(kTcEntries) * (2 * 4 + 8) + std::size_t(kRows) * 8);
};

// One warp: out[16 x 16] (fp32, row pitch ldo) = A B^T for bf16 rows A[16 x kD], B[16 x kD] (row pitches
// lda, ldb) on the tensor cores. Serves the key/key similarity and q.k.
template <int kD>
__device__ inline void tile_abt(const __nv_bfloat16* a, int lda, const __nv_bfloat16* b, int ldb, float* out, int ldo) {
  namespace wmma = nvcuda::wmma;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.0f);
#pragma unroll
  for (int kb = 0; kb < kD / 16; ++kb) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
    wmma::load_matrix_sync(fa, a + kb * 16, lda);
    wmma::load_matrix_sync(fb, b + kb * 16, ldb);
    wmma::mma_sync(acc, fa, fb, acc);
  }
  wmma::store_matrix_sync(out, acc, ldo, wmma::mem_row_major);
}

// grid (splits, I), block 32 * kTcWarps, dynamic smem UaTcLayout<kD>::kBytes. Same arguments and
// outputs as chunk_attend_kernel; S is bf16, rows of q/k/v 16-byte aligned (checked by the launcher).
template <class Set, int kD>
__global__ void __launch_bounds__(32 * kTcWarps)
    chunk_attend_tc_kernel(DeviceCache<bf16> c, DeviceCall<bf16> a, std::int64_t call_t0, std::int64_t call_rows) {
  namespace wmma = nvcuda::wmma;
  using L = UaTcLayout<kD>;
  using nv_bf16 = __nv_bfloat16;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  nv_bf16* qs = reinterpret_cast<nv_bf16*>(smem_raw + L::kQ);
  nv_bf16* ks = reinterpret_cast<nv_bf16*>(smem_raw + L::kK);
  nv_bf16* vs = reinterpret_cast<nv_bf16*>(smem_raw + L::kV);
  nv_bf16* nk = reinterpret_cast<nv_bf16*>(smem_raw + L::kNK);
  float* at = reinterpret_cast<float*>(smem_raw + L::kA);  // [entry][row]: similarity -> A -> Λ
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, tid = threadIdx.x;
  float* ss = reinterpret_cast<float*>(smem_raw + L::kS) + warp * 16 * L::kSPitch;
  nv_bf16* ps = reinterpret_cast<nv_bf16*>(smem_raw + L::kP) + warp * 16 * L::kPPitch;
  float* os = reinterpret_cast<float*>(smem_raw + L::kO) + warp * 16 * L::kOPitch;
  float* e_logit = reinterpret_cast<float*>(smem_raw + L::kMeta);
  float* e_part = e_logit + kTcEntries;
  std::int64_t* e_pos = reinterpret_cast<std::int64_t*>(e_part + kTcEntries);
  float* r_logit = reinterpret_cast<float*>(e_pos + kTcEntries);
  float* r_part = r_logit + L::kRows;

  ChunkWork w;
  if (!chunk_work(c, a, blockIdx.y, call_t0, call_rows, w)) return;
  const std::int64_t D = kD, r = c.r, item = w.item, b = w.b, g = item % c.G, t0 = w.t0, rows = w.rows;
  const int rt = int(kTcQueryRows / r);  // chunk rows per row tile (32 or 16)
  const std::int64_t n = c.length[item], total = n + rows;
  const std::int64_t piece = split_piece(total, a.splits, kTcEntries);
  const std::int64_t e_begin = blockIdx.x * piece;
  if (e_begin >= total) return;
  const std::int64_t e_end = e_begin + piece < total ? e_begin + piece : total;
  const std::int64_t first = c.counter[item];
  // this warp's 16 (head, row) pairs: one head, rows [row_base, row_base + 16) of the row tile
  const int head = (warp * 16) / rt, row_base = (warp * 16) % rt;
  // softmax bookkeeping: lane -> pair row lr = lane / 2, columns [half * 32, half * 32 + 32)
  const int lr = lane / 2, half = lane % 2;
  constexpr int kVec = kD / 8;  // 16-byte vectors per row

  for (std::int64_t r0 = 0; r0 < rows; r0 += rt) {
    const std::int64_t nr = rows - r0 < rt ? rows - r0 : rt;
    const std::int64_t m_last = first + r0 + nr - 1;
    __syncthreads();  // the previous row tile is fully consumed
    // queries of every (head, row) pair (zeros past the chunk), the row tile's keys and gates. Rows are
    // staged with cp.async (every vector in flight at once; zero-filled past the chunk); the wait
    // before the barrier that follows the first entry tile's staging makes them visible.
    for (int x = tid; x < kTcQueryRows * kVec; x += blockDim.x) {
      const int pr = x / kVec, cv = x % kVec, h = pr / rt, i = pr % rt;
      const bool live = i < nr;
      const bf16* src = a.q + b * a.q_b + (g * r + h) * a.q_h + (t0 + r0 + (live ? i : 0)) * a.q_t + cv * 8;
      ptx::cp_async16(qs + pr * L::kQPitch + cv * 8, src, live ? 16 : 0);
    }
    for (int x = tid; x < L::kRows * kVec; x += blockDim.x) {
      const int i = x / kVec, cv = x % kVec;
      const bool live = i < nr;
      const bf16* src = a.k + b * a.k_b + g * a.k_g + (t0 + r0 + (live ? i : 0)) * a.k_t + cv * 8;
      ptx::cp_async16(nk + i * L::kKPitch + cv * 8, src, live ? 16 : 0);
    }
    ptx::cp_async_commit();
    load_row_gates(a, b, g, t0 + r0, nr, r_logit, r_part);
    for (int x = lane; x < 16 * kD; x += kWarpSize) os[(x / kD) * L::kOPitch + x % kD] = 0.0f;
    OnlineSoftmax<float> sm;  // this lane's half of pair row lr

    for (std::int64_t e0 = e_begin; e0 < e_end; e0 += kTcEntries) {
      if (e0 >= n && first + (e0 - n) > m_last) break;  // the call's keys beyond this row tile: masked
      const std::int64_t ne = e_end - e0 < kTcEntries ? e_end - e0 : kTcEntries;
      __syncthreads();  // previous entry tile consumed; qs / nk written
      for (int x = tid; x < kTcEntries * kVec; x += blockDim.x) {
        const int e = x / kVec, cv = x % kVec;
        const std::int64_t idx = e0 + (e < ne ? e : 0);  // rows past the tile: zero-filled from row e0
        const bf16* kp = idx < n ? c.keys + c.row(item, idx) * D : a.k + b * a.k_b + g * a.k_g + (t0 + idx - n) * a.k_t;
        const bf16* vp =
            idx < n ? c.values + c.row(item, idx) * D : a.v + b * a.v_b + g * a.v_g + (t0 + idx - n) * a.v_t;
        ptx::cp_async16(ks + e * L::kKPitch + cv * 8, kp + cv * 8, e < ne ? 16 : 0);
        ptx::cp_async16(vs + e * L::kKPitch + cv * 8, vp + cv * 8, e < ne ? 16 : 0);
      }
      ptx::cp_async_commit();
      load_entry_meta(c, a, item, b, n, t0, first, e0, ne, e_logit, e_part, e_pos);
      ptx::cp_async_wait<0>();  // this tile's rows (and the row tile's queries and keys) have landed
      __syncthreads();
      // similarity tile K NK^T [entries x rows] on the tensor cores (one 16 x 16 tile per warp)
      if constexpr (Set::kNeedsSimilarity) {
        const int tiles_r = rt / 16;
        if (warp < (kTcEntries / 16) * tiles_r) {
          const int te = warp / tiles_r, tr = warp % tiles_r;
          tile_abt<kD>(ks + (te * 16) * L::kKPitch, L::kKPitch, nk + (tr * 16) * L::kKPitch, L::kKPitch,
                       at + (te * 16) * L::kAPitch + tr * 16, L::kAPitch);
        }
        __syncthreads();
      }
      // A(e, m) from the similarity (spec 4.1), 0 where m <= pos_e
      decay_tile<Set>(at, L::kAPitch, ne, rt, nr, first + r0, e_pos, e_logit, e_part, r_logit, r_part,
                      [&](std::int64_t e, std::int64_t i) { return at[e * L::kAPitch + i]; });
      __syncthreads();
      carry_lambda(c, a, item, n, first, r0, nr, e0, ne, e_pos, at, L::kAPitch);
      __syncthreads();
      // S = Q K^T for the warp's 16 pairs and the tile's entries
#pragma unroll
      for (int nb = 0; nb < kTcEntries / 16; ++nb)
        tile_abt<kD>(qs + (warp * 16) * L::kQPitch, L::kQPitch, ks + (nb * 16) * L::kKPitch, L::kKPitch, ss + nb * 16,
                     L::kSPitch);
      warp_sync();
      // logits = q.k + Λ (scale 1), online softmax on the lane's 32 columns
      const int row_in_tile = row_base + lr;
      const bool row_live = row_in_tile < nr;
      float logit[32];
      float tile_max = negative_infinity<float>();
#pragma unroll
      for (int x = 0; x < 32; ++x) {
        const int col = half * 32 + x;
        const float bias = (row_live && col < ne) ? at[col * L::kAPitch + row_in_tile] : negative_infinity<float>();
        logit[x] = bias == negative_infinity<float>() ? bias : ss[lr * L::kSPitch + col] + bias;
        tile_max = fmaxf(tile_max, logit[x]);
      }
      tile_max = fmaxf(tile_max, warp_shfl_xor(tile_max, 1));
      const float rescale = sm.raise_max(tile_max);
#pragma unroll
      for (int x = 0; x < 32; ++x) ps[lr * L::kPPitch + half * 32 + x] = __float2bfloat16_rn(sm.accumulate(logit[x]));
      if (rescale != 1.0f)
        for (int d = half; d < kD; d += 2) os[lr * L::kOPitch + d] *= rescale;
      warp_sync();
      // O += P V
#pragma unroll
      for (int db = 0; db < kD / 16; ++db) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::load_matrix_sync(acc, os + db * 16, L::kOPitch, wmma::mem_row_major);
#pragma unroll
        for (int kb = 0; kb < kTcEntries / 16; ++kb) {
          wmma::fragment<wmma::matrix_a, 16, 16, 16, nv_bf16, wmma::row_major> fa;
          wmma::fragment<wmma::matrix_b, 16, 16, 16, nv_bf16, wmma::row_major> fb;
          wmma::load_matrix_sync(fa, ps + kb * 16, L::kPPitch);
          wmma::load_matrix_sync(fb, vs + (kb * 16) * L::kKPitch + db * 16, L::kKPitch);
          wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(os + db * 16, acc, L::kOPitch, wmma::mem_row_major);
      }
      warp_sync();
    }
    ptx::cp_async_wait<0>();  // a row tile without entry tiles: its staging lands before qs / nk are reused
    // this split's partial of every live pair row: max, sum (both halves), unnormalised accumulator
    const float total_sum = sm.sum + warp_shfl_xor(sm.sum, 1);
    const int row_in_tile = row_base + lr;
    if (row_in_tile < nr) {
      const std::int64_t slot = ((item * a.splits + blockIdx.x) * r + head) * a.P + (r0 + row_in_tile);
      if (half == 0) {
        a.part_ml[slot * 2] = sm.max;
        a.part_ml[slot * 2 + 1] = total_sum;
      }
      for (int d = half; d < kD; d += 2) a.part_acc[slot * D + d] = os[lr * L::kOPitch + d];
    }
  }
}

}  // namespace kvmem::cuda::ua_detail
