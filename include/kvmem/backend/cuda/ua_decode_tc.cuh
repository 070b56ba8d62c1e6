// SPDX-License-Identifier: Apache-2.0
#pragma once
// Tensor-core pass of a long item's decode step for bf16 storage (spec UA.md 4.4, 4.5): the work of
// decode_split_rows (ua_kernels.cuh) -- one split of one item's entries, every live row's λ updated from
// its similarity to the new key, evicted rows marked dead in place, one online-softmax partial per query
// head of the group -- with the two products on the tensor cores (mma.sync m16n8k16, bf16 operands, fp32
// accumulation). Like FlashAttention and the tensor-core chunk kernel, the probabilities are 2^x on
// ex2.approx (relative error about 2^-22) rounded to bf16 before p.v; logits, λ, the running max/sum and the
// accumulators stay fp32, and λ takes the exact fold of every pass (update_row). The similarity and
// q.k are exact bf16 products summed in fp32 in another order than the other passes (the tests' near-tie
// bound for the similarity holds for any order).
//
// The block walks its range in windows of kDtcWindow entries. A window's λ (and page places) are loaded
// by every thread while the window before it is attended; the live entries (λ > -inf, and the new
// token) are then listed in ascending order in shared memory (ballots and one prefix sum), so the
// tensor-core tiles hold live rows only, whatever the kept fraction. Tile k (16 listed entries) belongs to
// warp k % warps: the warp copies its keys and values with cp.async into a stage of its own (kDtcStages
// per warp, no block barrier between tiles: a warp waits only for its own copies), together with the
// entries' key-gate logits and positions, and computes (with more than one stage, while the next tile is in
// flight; with one, the other block's warps on the multiprocessor hide the copies)
//   S^T = A K^T        A = [q_0 .. q_{r-1}, 0 .., k_new (row 8), 0 ..] (16 x D, shared memory, ldmatrix
//                      per k-step: the pass stays within 128 registers, two blocks per multiprocessor),
//                      two n-tiles of 8 entries, K from ldmatrix (the row-major rows are K^T col-major);
//   the λ update and eviction of entry j on lane j (update_row, with row 8 of S^T: the similarity);
//   one online-softmax step per head h (lanes 4h .. 4h + 3, quad shuffles);
//   O^T += V^T P^T     A = V^T from ldmatrix.trans of the staged value rows, B = P^T straight from the
//                      registers: the C fragment of S^T's rows 0-7 is the B fragment of P^T.
// At the end the warps' states merge in warp order (deterministic) into this split's partial, the format
// of decode_split_rows. Dead rows are never read beyond their λ.
//
// NVIDIA only (KVMEM_GPU_VENDOR_PATHS): included by backend/cuda/ua.cuh on the vendor path, where
// decode_part takes this pass for bf16, r in {4, 8}, D a multiple of 16 up to 128, 16-byte input rows and no
// page move (decode_tc_ok, decode_kernel_dims).

#include "kvmem/backend/cuda/vendor.cuh"

#include <cstdint>

#include "kvmem/backend/cuda/ptx.cuh"
#include "kvmem/backend/cuda/ua_kernels.cuh"
#include "kvmem/core/numeric.hpp"
#include "kvmem/kernel/ua_decay.hpp"

namespace kvmem::cuda::ua_detail {

// Page places a window's list holds besides pool rows: the new token (its rows are the call's inputs) and
// a tile's padding past the list (zero rows, never attended).
inline constexpr std::int64_t kDtcNewToken = -1;
inline constexpr std::int64_t kDtcNone = -2;

// The addresses of a staged entry's key and value rows (in the pool, or the call's new token).
struct alignas(16) RowPair {
  const bf16* key;
  const bf16* value;
};

template <class Set, bool kEvict, int kDmax, int kR>
__device__ inline int decode_split_tc(const DeviceCache<bf16>& c, const DeviceCall<bf16>& a, std::int64_t item,
                                      std::int64_t b, std::int64_t n, int split, Range range, unsigned char* smem) {
  static_assert(kR == 4 || kR == 8, "the heads of a group are rows 0-7 of S^T, the new key row 8");
  static_assert(kDmax % 16 == 0 && kDmax <= 128, "D / 16 k-steps of A and m-tiles of O^T in registers");
  static_assert(kWarpSize == 32, "mma.sync fragments are 32-lane layouts");
  constexpr int kSteps = kDmax / 16;                     // k-steps of S^T, m-tiles of O^T (at most)
  constexpr int kCounts = kDtcPerThread * kDecodeWarps;  // (window slice, warp) live counts
  constexpr float kNegInf = negative_infinity<float>();
  const int D = int(c.D), steps = D / 16, per_row = D / 8;                   // D <= kDmax, a multiple of 16
  const int rows_pass = kWarpSize % per_row == 0 ? kWarpSize / per_row : 0;  // tile rows one copy covers
  const DecodeTcLayout L(D, kR);
  const int pitch = int(L.pitch);
  const std::int64_t g = item % c.G, t = c.counter[item];
  const prune::Cut cut = item_cut<kEvict>(a, item);
  const int tid = int(threadIdx.x), lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int lane_e = rows_pass > 0 ? lane / per_row : 0, lane_w = rows_pass > 0 ? (lane % per_row) * 8 : 0;
  bf16* qs = reinterpret_cast<bf16*>(smem + L.qs);                              // A: [16][pitch]
  std::int64_t* list_row = reinterpret_cast<std::int64_t*>(smem + L.list_row);  // [kDtcWindow] page places
  float* list_lam = reinterpret_cast<float*>(smem + L.list_lam);                // [kDtcWindow] λ at the step's start
  int* counts = reinterpret_cast<int*>(smem + L.counts);                        // [kCounts + 1]
  unsigned char* stages = smem + L.stages + std::size_t(warp) * kDtcStages * L.stage_bytes;
  __shared__ int marked_block;
  const bf16* in_k = a.k + b * a.k_b + g * a.k_g;
  const bf16* in_v = a.v + b * a.v_b + g * a.v_g;
  const float zq = a.z_q[b * a.zq_b + g * a.zq_g];

  // The next window's page places (kDtcNewToken, kDtcNone) and λ, loaded into registers.
  std::int64_t srow[kDtcPerThread];
  float slam[kDtcPerThread];
  const auto scan = [&](std::int64_t w0) {  // loads in flight until publish reads them
#pragma unroll
    for (int i = 0; i < kDtcPerThread; ++i) {
      const std::int64_t e = w0 + std::int64_t(i) * kDecodeThreads + tid;
      srow[i] = e >= range.end ? kDtcNone : e < n ? c.row(item, e) : kDtcNewToken;
      slam[i] = srow[i] >= 0 ? c.lambda[srow[i]] : 0.0f;
    }
  };
  // 1. the first window's page places and λ (in registers), then A = the group's queries (rows 0 .. kR - 1)
  //    and the new key (row 8), zeros elsewhere, in 16-byte pieces with cp.async (no registers: both sets
  //    of loads in flight together, one round trip for the block's setup); a piece whose source is not
  //    16-byte aligned is copied element by element
  scan(range.begin);
  for (int x = tid; x < kDtcRows * per_row; x += kDecodeThreads) {
    const int row = x / per_row, w = (x - row * per_row) * 8;
    const bf16* src = row < kR ? a.q + b * a.q_b + (g * kR + row) * a.q_h : row == 8 ? in_k : nullptr;
    bf16* to = qs + row * pitch + w;
    if (src == nullptr)
      *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
    else if (reinterpret_cast<std::uintptr_t>(src + w) % 16 == 0)
      ptx::cp_async16(to, src + w, 16);
    else
      for (int k = 0; k < 8; ++k) to[k] = src[w + k];
  }
  ptx::cp_async_commit();
  ptx::cp_async_wait<0>();
  if (tid == 0) marked_block = 0;
  __syncthreads();
  // ldmatrix addresses: A row lane % 16, columns + 8 for lanes 16-31 (a0..a3 of m16n8k16), read per tile
  // from shared memory (32 registers fewer than holding A: two blocks fit a multiprocessor); K and V: entry
  // lane % 8 (+ 8 for lanes 16-31), columns + 8 for lanes 8-15 and 24-31
  const bf16* a_at = qs + (lane % 16) * pitch + (lane / 16) * 8;
  const int kv_row = lane % 8 + (lane / 16) * 8, kv_col = ((lane / 8) % 2) * 8;
  const float q_part = kernel::ua::query_gate_part(zq);  // zq loaded with the setup
  // O^T[d][h]: m-tile mt holds d = 16 mt + lane / 4 (+ 8 in [2], [3]), heads 2 (lane % 4) + {0, 1}
  float acc[kSteps][4];
#pragma unroll
  for (int mt = 0; mt < kSteps; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.0f;
  const int quad = lane % 4, head = lane / 4;  // S^T: lane holds row `head`, entries 2 quad + {0, 1} (+ 8)
  float m_run = kNegInf, l_run = 0.0f;         // head `head`: running max (equal in the quad), this lane's sum

  // The stage of a warp's tile: K and V rows [16][pitch], then the entries' page places, positions, λ (at
  // the step's start; then the logit bias: λ after the update, or -inf where not attended), key-gate logits.
  const auto stage_at = [&](int j) { return stages + std::size_t(j % kDtcStages) * L.stage_bytes; };
  int count = 0;  // live entries listed for the current window
  const auto issue = [&](int j) {
    unsigned char* st = stage_at(j);
    bf16* ks = reinterpret_cast<bf16*>(st);
    bf16* vs = ks + kDtcRows * pitch;
    std::int64_t* m_row = reinterpret_cast<std::int64_t*>(st + L.meta);
    std::int64_t* m_pos = m_row + kDtcRows;
    float* m_lam = reinterpret_cast<float*>(m_pos + kDtcRows);
    float* m_zk = m_lam + kDtcRows;
    RowPair* m_src = reinterpret_cast<RowPair*>(st + L.src);  // [kDtcRows]
    const int first = (warp + j * kDecodeWarps) * kDtcRows;
    const int cnt = count - first < kDtcRows ? count - first : kDtcRows;
    if (lane < kDtcRows) {  // entry `lane`: its meta and the addresses of its rows, once
      const bool valid = lane < cnt;
      const std::int64_t row = valid ? list_row[first + lane] : kDtcNone;
      m_row[lane] = row;
      m_lam[lane] = valid ? list_lam[first + lane] : 0.0f;
      if (row >= 0) {
        ptx::cp_async_ca<4>(m_zk + lane, c.key_logit + row);
        ptx::cp_async_ca<8>(m_pos + lane, c.pos + row);
      } else {
        m_zk[lane] = 0.0f;
        m_pos[lane] = t;
      }
      // padding rows copy 0 bytes (zeros) from a valid address
      const bool cached = row >= 0, fresh = row == kDtcNewToken;
      const bf16* key = cached ? c.keys + row * D : c.keys;
      const bf16* value = cached ? c.values + row * D : c.values;
      m_src[lane] = {fresh ? in_k : key, fresh ? in_v : value};
    }
    warp_sync();  // every entry's row addresses are in the stage
    // K and V rows in 16-byte pieces, whole rows per instruction (contiguous reads): where a row's pieces
    // divide the warp (D = 16, 32, 64, 128), lane l copies piece l % per_row of entries l / per_row,
    // + rows_pass, ... (a fixed column: one shared-memory read of the entry's two addresses per piece pair);
    // else the pieces are dealt in order.
    const auto piece = [&](int e, int w) {
      const int bytes = e < cnt ? 16 : 0;  // padding rows: zeros
      const RowPair src = m_src[e];        // one 16-byte shared-memory read
      ptx::cp_async16(ks + e * pitch + w, src.key + w, bytes);
      ptx::cp_async16(vs + e * pitch + w, src.value + w, bytes);
    };
    if (rows_pass > 0) {
#pragma unroll 4
      for (int e = lane_e; e < kDtcRows; e += rows_pass) piece(e, lane_w);
    } else {
#pragma unroll 1
      for (int x = lane; x < kDtcRows * per_row; x += kWarpSize) piece(x / per_row, (x % per_row) * 8);
    }
    ptx::cp_async_commit();
  };
  const auto attend = [&](int j) {
    unsigned char* st = stage_at(j);
    const bf16* ks = reinterpret_cast<const bf16*>(st);
    const bf16* vs = ks + kDtcRows * pitch;
    const std::int64_t* m_row = reinterpret_cast<const std::int64_t*>(st + L.meta);
    const std::int64_t* m_pos = m_row + kDtcRows;
    float* m_lam = reinterpret_cast<float*>(st + L.meta + 2 * kDtcRows * sizeof(std::int64_t));
    const float* m_zk = m_lam + kDtcRows;
    // S^T = A K^T: n-tile 0 entries 0-7, n-tile 1 entries 8-15
    float s0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 2
    for (int kk = 0; kk < kSteps; ++kk)  // two k-steps' fragments live at a time: within 128 registers
      if (kk < steps) {
        std::uint32_t af[4], bk[4];
        ptx::ldmatrix_x4(af, a_at + kk * 16);
        ptx::ldmatrix_x4(bk, ks + kv_row * pitch + kk * 16 + kv_col);
        ptx::mma_bf16_16816(s0, af, bk[0], bk[1]);
        ptx::mma_bf16_16816(s1, af, bk[2], bk[3]);
      }
    // row 8 (the similarity to the new key) lies in [2], [3] of lanes 0-3: entry e at lane (e % 8) / 2,
    // element 2 + e % 2 of n-tile e / 8; lane e < 16 takes entry e's
    const int src = (lane % 8) / 2;
    const float x0 = warp_shfl(s0[2], src), x1 = warp_shfl(s0[3], src), x2 = warp_shfl(s1[2], src),
                x3 = warp_shfl(s1[3], src);
    if (lane < kDtcRows) {
      const float sim = lane < 8 ? (lane % 2 == 0 ? x0 : x1) : (lane % 2 == 0 ? x2 : x3);
      const std::int64_t row = m_row[lane];
      float bias = kNegInf;  // padding: never attended
      if (row >= 0) {        // a live cached row: λ update (spec 4.4 step 1), eviction (4.5), λ written back
        const RowUpdate up = update_row<Set, kEvict>(a, cut, m_lam[lane], sim, m_zk[lane], m_pos[lane], zq, q_part, t);
        c.lambda[row] = up.stored();
        if (up.evict) atomicAdd(&marked_block, 1);  // a shared counter: no register held over the windows
        bias = up.attend ? up.lambda : kNegInf;
      } else if (row == kDtcNewToken) {
        bias = 0.0f;  // the new token: λ = 0, attended, never evicted (appended by the last block)
      }
      m_lam[lane] = bias;
    }
    warp_sync();  // every entry's bias is in m_lam
    const float2 b0 = *reinterpret_cast<const float2*>(m_lam + 2 * quad);
    const float2 b1 = *reinterpret_cast<const float2*>(m_lam + 8 + 2 * quad);
    const bool active = head < kR;  // rows kR .. 7 of S^T are zero rows: no head
    float sl[4];
    sl[0] = active ? s0[0] + b0.x : kNegInf;  // logits (scale 1) + λ; -inf where not attended
    sl[1] = active ? s0[1] + b0.y : kNegInf;
    sl[2] = active ? s1[0] + b1.x : kNegInf;
    sl[3] = active ? s1[1] + b1.y : kNegInf;
    // one online-softmax step of head `head` over the tile (quad reductions: every lane runs them)
    float mx = fmaxf(fmaxf(sl[0], sl[1]), fmaxf(sl[2], sl[3]));
    mx = fmaxf(mx, warp_shfl_xor(mx, 1));
    mx = fmaxf(mx, warp_shfl_xor(mx, 2));
    mx = fmaxf(mx, m_run);
    // the weights as 2^x on ex2.approx, like the tensor-core prefill kernels (ua_dense_tc.cuh): a logit or
    // running maximum of -inf gives 0, and mx = -inf only when m_run is
    const float base = mx == kNegInf ? 0.0f : mx * kLog2eFloat;
    const float scale = ptx::ex2_approx_ftz(fmaf(m_run, kLog2eFloat, -base));
    float p[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) p[u] = ptx::ex2_approx_ftz(fmaf(sl[u], kLog2eFloat, -base));
    // P^T's B fragment: entries 2 quad + {0, 1} (b0) and 8 + 2 quad + {0, 1} (b1) of head `head`, in bf16;
    // the sum takes the rounded weights, the ones p.v applies
    const std::uint32_t p01 = ptx::pack_bf16(p[0], p[1]), p23 = ptx::pack_bf16(p[2], p[3]);
    const float rounded = __uint_as_float(p01 << 16) + __uint_as_float(p01 & 0xffff0000u) + __uint_as_float(p23 << 16) +
                          __uint_as_float(p23 & 0xffff0000u);
    l_run = l_run * scale + rounded;
    m_run = mx;
    // O^T's lane holds heads 2 quad and 2 quad + 1, whose scales lanes 8 quad and 8 quad + 4 computed
    const float sa = warp_shfl(scale, 8 * quad), sb = warp_shfl(scale, 8 * quad + 4);
#pragma unroll
    for (int mt = 0; mt < kSteps; ++mt)
      if (mt < steps) {
        acc[mt][0] *= sa;
        acc[mt][1] *= sb;
        acc[mt][2] *= sa;
        acc[mt][3] *= sb;
        std::uint32_t av[4];
        ptx::ldmatrix_x4_trans(av, vs + kv_row * pitch + mt * 16 + kv_col);
        ptx::mma_bf16_16816(acc[mt], av, p01, p23);
      }
  };

  // 2. the windows: list the live entries, then attend them in tiles of 16
  // The live entries of the scanned window in ascending order: entry w0 + i * threads + tid is listed after
  // the live entries of slices before i, warps before this one, lanes below this one.
  const auto publish = [&]() {
    LaneMask masks[kDtcPerThread];
    bool live[kDtcPerThread];
#pragma unroll
    for (int i = 0; i < kDtcPerThread; ++i) {
      live[i] = srow[i] != kDtcNone && !(srow[i] >= 0 && is_dead(slam[i]));
      masks[i] = warp_ballot(live[i]);
      if (lane == 0) counts[i * kDecodeWarps + warp] = mask_popc(masks[i]);
    }
    __syncthreads();
    if (warp == 0) {  // exclusive prefix sum of the counts, a warp of them at a time
      int carry = 0;
      for (int j0 = 0; j0 < kCounts; j0 += kWarpSize) {
        const int j = j0 + lane;
        const int own = j < kCounts ? counts[j] : 0;
        int inclusive = own;
        for (int o = 1; o < kWarpSize; o *= 2) {
          const int up = warp_shfl_up(inclusive, unsigned(o));
          if (lane >= o) inclusive += up;
        }
        if (j < kCounts) counts[j] = carry + inclusive - own;
        carry += warp_shfl(inclusive, kWarpSize - 1);
      }
      if (lane == 0) counts[kCounts] = carry;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kDtcPerThread; ++i)
      if (live[i]) {
        const int at = counts[i * kDecodeWarps + warp] + mask_popc(masks[i] & lanes_below(lane));
        list_row[at] = srow[i];
        list_lam[at] = slam[i];
      }
    const int listed = counts[kCounts];
    __syncthreads();
    return listed;
  };
  for (std::int64_t w0 = range.begin; w0 < range.end; w0 += kDtcWindow) {
    count = publish();
    if (w0 + kDtcWindow < range.end) scan(w0 + kDtcWindow);  // in flight while this window is attended
    const int tiles = (count + kDtcRows - 1) / kDtcRows;
    const int mine = tiles > warp ? (tiles - warp + kDecodeWarps - 1) / kDecodeWarps : 0;
    if constexpr (kDtcStages == 1) {
      // one stage per warp: the other warps of the multiprocessor (two blocks) hide a tile's copies
      for (int j = 0; j < mine; ++j) {
        issue(j);
        ptx::cp_async_wait<0>();  // this lane's copies of tile j have landed
        warp_sync();              // every lane's have
        attend(j);
        warp_sync();  // every lane is done with the stage before the next tile's copies
      }
    } else {
#pragma unroll
      for (int j = 0; j < kDtcStages - 1; ++j) {
        if (j < mine)
          issue(j);
        else
          ptx::cp_async_commit();  // empty group: every wait below counts the same groups
      }
      for (int j = 0; j < mine; ++j) {
        ptx::cp_async_wait<(kDtcStages > 1 ? kDtcStages - 2 : 0)>();  // this lane's copies of tile j have landed
        warp_sync();  // every lane's have, and tile j - 1's stage is free
        if (j + kDtcStages - 1 < mine)
          issue(j + kDtcStages - 1);
        else
          ptx::cp_async_commit();
        attend(j);
      }
    }
    ptx::cp_async_wait<0>();
    __syncthreads();  // the list and the stages are free for the next window
  }

  // 3. merge the warps in order through shared memory (the stages are free) into this split's partial
  l_run += warp_shfl_xor(l_run, 1);
  l_run += warp_shfl_xor(l_run, 2);
  float* red = reinterpret_cast<float*>(smem + L.stages);  // [warps][kR][D + 2]: max, sum, accumulator
#pragma unroll
  for (int mt = 0; mt < kSteps; ++mt)
    if (mt < steps)
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int h = 2 * quad + u % 2, d = mt * 16 + lane / 4 + (u / 2) * 8;
        if (h < kR) red[(std::size_t(warp) * kR + h) * std::size_t(D + 2) + 2 + d] = acc[mt][u];
      }
  if (quad == 0 && head < kR) {
    red[(std::size_t(warp) * kR + head) * std::size_t(D + 2)] = m_run;
    red[(std::size_t(warp) * kR + head) * std::size_t(D + 2) + 1] = l_run;
  }
  __syncthreads();
  write_split_partial(a, red, kR, D, item, split);
  return marked_block;
}

}  // namespace kvmem::cuda::ua_detail
