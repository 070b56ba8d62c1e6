// SPDX-License-Identifier: Apache-2.0
#pragma once
// Tensor-core KVM prefill readout for bf16 storage (spec 4.4): the same joint online softmax over
// [state slots | causal window] as attend_rows_kernel, with q.k and p.v on the tensor cores (bf16
// operands, fp32 accumulation, accumulators in registers): Hopper's asynchronous warpgroup MMA
// (wgmma) where the device code is built for sm_90a, mma.sync m16n8k16 elsewhere. Like
// FlashAttention, the probabilities are rounded to bf16 before the p.v product; logits, the running
// max/sum and the output accumulator stay fp32. A block holds 128 query rows of one head; keys arrive
// in tiles of 64 rows, double-buffered in shared memory with cp.async.
// The update's novelty and routing passes are in kvm_route_tc.cuh.

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "kvmem/backend/cuda/kvm_kernels.cuh"
#include "kvmem/backend/cuda/ptx.cuh"
#include "kvmem/backend/cuda/vendor.cuh"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"

namespace kvmem::cuda::kvm_detail {

inline constexpr int kTcWarps = 8;             // two warpgroups (wgmma) or eight warps of one m16 atom (mma.sync)
inline constexpr int kTcRows = 16 * kTcWarps;  // query rows per block: 64 a warpgroup, 16 a warp
inline constexpr int kTcKeys = 64;             // keys per tile
inline constexpr int kTcThreads = 32 * kTcWarps;
// Blocks per SM the registers are budgeted for. wgmma: 2 (127 registers; S, P and the O rows of a
// warpgroup's 64 rows take 112 per thread): the two warpgroups of each of two blocks interleave
// softmax and products, and an SM keeps room for the update kernels that run beside a prefill's
// readout. (Keeping P_{k-1} V_{k-1} in flight during the softmax of tile k, FlashAttention-3's
// intra-warpgroup overlap, would hold a second P and the next S in registers: one block per SM, or a
// spill at two.) mma.sync: 1 (197 registers).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
inline constexpr int kTcMinBlocks = 2;
#else
inline constexpr int kTcMinBlocks = 1;
#endif

// Shared memory of the mma.sync path: the block's query rows (bf16, loaded once), then two K/V tile
// buffers (cp.async double buffering); rows padded by 16 bytes so the 8 rows of an ldmatrix hit 32
// different banks. Offsets in bytes of row `row`, 16-byte vector `vec`.
template <int kD, int kDv>
struct TcPaddedLayout {
  static constexpr int kQPitch = kD + 8;  // bf16 elements
  static constexpr int kKPitch = kD + 8;
  static constexpr int kVPitch = kDv + 8;
  static constexpr unsigned kKRowBytes = kKPitch * 2, kVRowBytes = kVPitch * 2;
  static constexpr std::size_t kQTile = std::size_t(kTcRows) * kQPitch * 2;
  static constexpr std::size_t kKTile = std::size_t(kTcKeys) * kKPitch * 2;
  static constexpr std::size_t kVTile = std::size_t(kTcKeys) * kVPitch * 2;
  static constexpr std::size_t kBuffer = kKTile + kVTile;
  static constexpr std::size_t kBytes = kQTile + 2 * kBuffer;
  __device__ static unsigned q_offset(int row, int vec) { return static_cast<unsigned>((row * kQPitch + vec * 8) * 2); }
  __device__ static unsigned k_offset(int row, int vec) { return static_cast<unsigned>((row * kKPitch + vec * 8) * 2); }
  __device__ static unsigned v_offset(int row, int vec) { return static_cast<unsigned>((row * kVPitch + vec * 8) * 2); }
};

// Shared memory of the wgmma path, in the 128-byte swizzle layout the tensor cores read through
// descriptors (ptx::sw128_offset, ptx::wgmma_desc_sw128: the 8 rows of an atom spread their 16-byte
// chunks over all banks). Q is K-major (the A operand of S = Q K^T), K as well
// (the B operand), V is MN-major (the B operand of O = P V, read transposed). The region starts on a
// 1024-byte boundary (ptx::align_shared_1024), hence the 1024 spare bytes.
template <int kD, int kDv>
struct TcSwizzledLayout {
  static_assert(kD % 64 == 0 && kDv % 64 == 0, "whole 128-byte rows");
  static constexpr unsigned kKRowBytes = 128, kVRowBytes = 128;  // the step of 8 rows is 8 x 128 bytes
  static constexpr std::size_t kQTile = std::size_t(kTcRows) * kD * 2;
  static constexpr std::size_t kKTile = std::size_t(kTcKeys) * kD * 2;
  static constexpr std::size_t kVTile = std::size_t(kTcKeys) * kDv * 2;
  static constexpr std::size_t kBuffer = kKTile + kVTile;
  static constexpr std::size_t kBytes = kQTile + 2 * kBuffer + 1024;
  __device__ static unsigned q_offset(int row, int vec) { return ptx::sw128_offset(kTcRows, row, vec); }
  __device__ static unsigned k_offset(int row, int vec) { return ptx::sw128_offset(kTcKeys, row, vec); }
  __device__ static unsigned v_offset(int row, int vec) { return ptx::sw128_offset(kTcKeys, row, vec); }
};

// The dynamic shared memory a launch gives attend_tc_kernel (either path's layout fits).
template <int kD, int kDv>
struct TcLayout {
  static constexpr std::size_t kBytes =
      ptx::shared_bytes_of_either_path(TcSwizzledLayout<kD, kDv>::kBytes, TcPaddedLayout<kD, kDv>::kBytes);
};

// The online softmax of OnlineSoftmax<float> in base 2 with the hardware exponential (ex2.approx,
// about 2 ulp): the logits arrive already multiplied by log2(e) (folded into the per-head scale, one
// multiply per logit), so a weight is one subtraction and one MUFU op. The probabilities are rounded
// to bf16 before p.v anyway, so the accurate expf bought nothing here. Every row sees a key in the
// first tile of its walk (a slot, or window position w <= t), so the maximum is finite from then on:
// masked logits (-inf) give ex2(-inf) = 0 with no test per logit.
struct TcSoftmax {
  float max = negative_infinity<float>();
  float sum = 0.0f;
  __device__ float raise_max(float block_max) {
    if (!(block_max > max)) return 1.0f;
    const float rescale = max == negative_infinity<float>() ? 0.0f : ptx::ex2_approx_ftz(max - block_max);
    max = block_max;
    sum *= rescale;
    return rescale;
  }
  __device__ float accumulate(float logit2) {
    const float weight = ptx::ex2_approx_ftz(logit2 - max);
    sum += weight;
    return weight;
  }
};

// Where a readout finds its keys: TcSources (kvm_kernels.cuh).

// The key tiles of a row block's walk, [state slots...][window...] in steps of kTcKeys, and their
// copies into the tile buffers of layout L (starting at kv0) by all kTcThreads threads.
template <class L, int kD, int kDv>
struct TcKeyWalk {
  DeviceState<bf16, float> st;
  TcSources src;
  std::int64_t item, w, n_state, state_tiles, last_t, tiles;
  unsigned kv0;

  __device__ TcKeyWalk(const DeviceState<bf16, float>& st_, const TcSources& src_, std::int64_t item_, std::int64_t w_,
                       std::int64_t slots, std::int64_t last_t_, unsigned kv0_)
      : st(st_), src(src_), item(item_), w(w_), n_state(w_ > 0 ? slots : 0), last_t(last_t_), kv0(kv0_) {
    state_tiles = (n_state + kTcKeys - 1) / kTcKeys;
    tiles = state_tiles + (last_t + 1 - w + kTcKeys - 1) / kTcKeys;
  }
  // tile k -> its first key (slot index or window position) and key count
  __device__ void tile_of(std::int64_t k, bool& in_state, std::int64_t& base, int& n) const {
    in_state = k < state_tiles;
    base = in_state ? k * kTcKeys : w + (k - state_tiles) * kTcKeys;
    const std::int64_t end = in_state ? n_state : last_t + 1;
    n = static_cast<int>((end - base) < kTcKeys ? (end - base) : kTcKeys);
  }
  // The K tiles' two buffers, then the V tiles' (tile k in buffer k % 2 of each).
  __device__ unsigned key_buffer(std::int64_t k) const { return kv0 + static_cast<unsigned>((k % 2) * L::kKTile); }
  __device__ unsigned value_buffer(std::int64_t k) const {
    return kv0 + static_cast<unsigned>(2 * L::kKTile + (k % 2) * L::kVTile);
  }
  // Copies the key rows (kValues: the value rows) of tile k to their buffer; the caller commits. Each
  // thread copies the same 16-byte column c of tile rows s0, s0 + kStep, ...: the column, the first row
  // and the shared-memory offsets are fixed per thread, so a full tile of contiguous rows (every slot
  // tile but the last, every window tile from the inputs, ring tiles that do not wrap) is a pointer
  // stride per copy; only a partial or wrapping tile works out each row.
  template <bool kValues>
  __device__ void copy(std::int64_t k) const {
    constexpr int kDim = kValues ? kDv : kD, kVecs = kDim / 8;
    static_assert(kTcThreads % kVecs == 0, "whole rows per pass");
    constexpr int kStep = kTcThreads / kVecs;
    static_assert(kStep % 8 == 0, "a row step keeps the swizzle phase (row % 8)");
    constexpr unsigned kRowBytes = kValues ? L::kVRowBytes : L::kKRowBytes;
    const int c = threadIdx.x % kVecs, s0 = threadIdx.x / kVecs;
    const unsigned dst0 = kValues ? value_buffer(k) + L::v_offset(s0, c) : key_buffer(k) + L::k_offset(s0, c);
    const int ring_len = static_cast<int>(st.W);
    bool in_state;
    std::int64_t base;
    int n;
    tile_of(k, in_state, base, n);
    // Tile row s is slot base + s, or window position base + s at ring row (base + s) mod W or input
    // row base + s - n0 (32-bit arithmetic per row, no 64-bit modulo).
    const bf16* src_base = kValues
                               ? (in_state ? src.vhat + (item * st.cap + base) * kDv : src.wv + item * src.rows * kDv)
                               : (in_state ? src.khat + (item * st.cap + base) * kD : src.wk + item * src.rows * kD);
    const bool wraps = !in_state && src.ring;
    const int first_row = in_state ? 0 : static_cast<int>(src.ring ? base % st.W : base - src.first);
    if (n == kTcKeys && (!wraps || first_row + kTcKeys <= ring_len)) {
      const bf16* p = src_base + std::int64_t(first_row + s0) * kDim + c * 8;
#pragma unroll
      for (int i = 0; i < kTcKeys / kStep; ++i) ptx::cp_async16(dst0 + i * kStep * kRowBytes, p + i * kStep * kDim, 16);
    } else {
      const auto row_of = [&](int s) {  // rows past n read row 0 (a valid address; zero-filled)
        if (s >= n) s = 0;
        int r = first_row + s;
        if (wraps)
          while (r >= ring_len) r -= ring_len;
        return r;
      };
#pragma unroll
      for (int i = 0; i < kTcKeys / kStep; ++i) {
        const int s = s0 + i * kStep;
        ptx::cp_async16(dst0 + i * kStep * kRowBytes, src_base + std::int64_t(row_of(s)) * kDim + c * 8,
                        s < n ? 16 : 0);
      }
    }
  }
  // Tile k whole, one group.
  __device__ void issue(std::int64_t k) const {
    copy<false>(k);
    copy<true>(k);
    ptx::cp_async_commit();
  }
};

// Q rows row0 .. row0 + kTcRows - 1 of head (b, h) -> shared memory at smem0 as bf16 in layout L (rows
// past t1: zeros). bf16 inputs in 16-byte rows travel as they are, by cp.async: the copies of a thread
// are all in flight at once, and the first key tile's with them (the caller commits them with that
// tile's group; returns true), rather than a global round trip per vector before the first tile is
// issued. Other inputs are converted and stored; the loop's first barrier publishes them.
template <class L, class In, int kD>
__device__ bool load_query_rows(const In* q_head, unsigned char* smem, std::int64_t row0, std::int64_t t1,
                                std::int64_t n0) {
  constexpr int kVecs = kD / 8;
  const unsigned smem0 = ptx::shared_address(smem);
  if constexpr (std::is_same_v<In, bf16>) {
    if (reinterpret_cast<std::uintptr_t>(q_head) % 16 == 0) {  // kD % 8 == 0: then every row is 16-byte aligned
      constexpr int kPerThread = kTcRows * kVecs / kTcThreads;
      static_assert(kTcRows * kVecs % kTcThreads == 0, "whole vectors per thread");
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int e = threadIdx.x + i * kTcThreads, row = e / kVecs, c = e % kVecs;
        const std::int64_t t = row0 + row;
        ptx::cp_async16(smem0 + L::q_offset(row, c), t < t1 ? q_head + (t - n0) * kD + c * 8 : q_head, t < t1 ? 16 : 0);
      }
      return true;
    }
  }
  for (int e = threadIdx.x; e < kTcRows * kVecs; e += kTcThreads) {
    const int row = e / kVecs, c = e % kVecs;
    const std::int64_t t = row0 + row;
    std::uint32_t packed[4] = {0u, 0u, 0u, 0u};
    if (t < t1) {
      const In* qr = q_head + (t - n0) * kD + c * 8;
#pragma unroll
      for (int j = 0; j < 4; ++j) packed[j] = ptx::pack_bf16(load_as<float>(qr[2 * j]), load_as<float>(qr[2 * j + 1]));
    }
    *reinterpret_cast<uint4*>(smem + L::q_offset(row, c)) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
  return false;
}

// The softmax of one tile on a thread's fragment of S (a 16-row atom: rows r and r + 8 of the atom,
// columns 2 (lane % 4) + {0, 1} of every 8-key tile; the mma.sync and wgmma accumulator layouts agree):
// scale to base 2, mask (key col is visible to row e iff col < lim[e]), row maxima over the quad, raise
// the running maxima; returns the factors the output rows must be rescaled by.
template <bool kMasked>
__device__ void tile_softmax(float (&s)[kTcKeys / 8][4], TcSoftmax (&sm)[2], float ls, const int (&lim)[2],
                             float (&resc)[2]) {
  const int quad = threadIdx.x % 4;
  float mx[2] = {negative_infinity<float>(), negative_infinity<float>()};
#pragma unroll
  for (int nt = 0; nt < kTcKeys / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nt][e] *= ls;
      if constexpr (kMasked) {
        if (nt * 8 + 2 * quad + (e & 1) >= lim[e / 2]) s[nt][e] = negative_infinity<float>();
      }
      mx[e / 2] = fmaxf(mx[e / 2], s[nt][e]);
    }
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    mx[e] = fmaxf(mx[e], warp_shfl_xor(mx[e], 1));
    mx[e] = fmaxf(mx[e], warp_shfl_xor(mx[e], 2));
    resc[e] = sm[e].raise_max(mx[e]);
  }
}
template <int kDv>
__device__ void rescale_rows(float (&o)[kDv / 8][4], const float (&resc)[2]) {
  if (resc[0] != 1.0f || resc[1] != 1.0f) {
#pragma unroll
    for (int nd = 0; nd < kDv / 8; ++nd) {
      o[nd][0] *= resc[0];
      o[nd][1] *= resc[0];
      o[nd][2] *= resc[1];
      o[nd][3] *= resc[1];
    }
  }
}
// The weights of keys 16 kk .. 16 kk + 15 as the A fragment of P (rounded to bf16, as FlashAttention
// does), straight from the S registers; adds them to the running sums.
__device__ inline void probabilities(const float (&s)[kTcKeys / 8][4], TcSoftmax (&sm)[2], int kk,
                                     std::uint32_t (&pa)[4]) {
  pa[0] = ptx::pack_bf16(sm[0].accumulate(s[2 * kk][0]), sm[0].accumulate(s[2 * kk][1]));
  pa[1] = ptx::pack_bf16(sm[1].accumulate(s[2 * kk][2]), sm[1].accumulate(s[2 * kk][3]));
  pa[2] = ptx::pack_bf16(sm[0].accumulate(s[2 * kk + 1][0]), sm[0].accumulate(s[2 * kk + 1][1]));
  pa[3] = ptx::pack_bf16(sm[1].accumulate(s[2 * kk + 1][2]), sm[1].accumulate(s[2 * kk + 1][3]));
}

// Readout of rows [t0, t1) on the tensor cores. Block: rows t0 + rb*kTcRows + [0, kTcRows) of head
// bh = b*Hq + h; the row blocks of one head are adjacent in the grid, so they run together and read
// the head's key/value tiles from L2 instead of each from DRAM. Warp i owns query rows 16 i .. 16 i + 15
// of the block, thread (lane) rows r = lane/4 and r + 8 of them, columns 2*(lane%4) + {0,1} of every
// 8-wide tile of S and of O, in registers (the FlashAttention-2 layout); the four lanes of a quad share
// a row's maxima (shuffles) and add their partial sums at the end. Key tiles are [state slots...]
// [window...] in steps of kTcKeys, the next one loading (cp.async) while the current one is used.
// Built for sm_90a (wgmma): the two warpgroups of the block each run S = Q K^T and O += P V as
// asynchronous warpgroup MMA (m64n64k16 and m64nDvk16), Q, K and V read by the tensor cores from
// swizzled shared memory (P from registers). Elsewhere (the compute_90 PTX, JIT-compiled for later
// GPUs): mma.sync m16n8k16, operands through ldmatrix. Same arithmetic otherwise: fp32 logits scaled
// to base 2, masked, online softmax, P rounded to bf16, fp32 accumulation.
// bf16 / fp16 output rows leave through shared memory as 16-byte row segments.
// grid B*Hq*ceil((t1 - t0) / kTcRows) (row block fastest), block kTcThreads, dynamic smem TcLayout::kBytes.
// q: [B,Hq,T,kD], out: [B,T,Hq,kDv]
template <class In, class Out, int kD, int kDv>
__global__ void __launch_bounds__(kTcThreads, kTcMinBlocks)
    attend_tc_kernel(DeviceState<bf16, float> st, TcSources src, const In* q, Out* out, std::int64_t T, std::int64_t n0,
                     std::int64_t t0, std::int64_t t1, std::int64_t w, std::int64_t slots) {
  using namespace ptx;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = TcSwizzledLayout<kD, kDv>;
#else
  using L = TcPaddedLayout<kD, kDv>;
#endif
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize, quad = lane % 4, r = lane / 4;
  const std::int64_t row_blocks = (t1 - t0 + kTcRows - 1) / kTcRows;
  const std::int64_t bh = blockIdx.x / row_blocks, rb = blockIdx.x % row_blocks;
  const std::int64_t Hq = st.Hq, b = bh / Hq, h = bh % Hq, item = b * st.Hk + h / st.rep();
  const std::int64_t row0 = t0 + rb * kTcRows;  // the block's first row
  const std::int64_t last_t = (row0 + kTcRows - 1) < (t1 - 1) ? (row0 + kTcRows - 1) : (t1 - 1);
  const std::int64_t warp_row0 = row0 + warp * 16;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  unsigned char* const smem = align_shared_1024(smem_raw);
#else
  unsigned char* const smem = smem_raw;
#endif
  const unsigned smem0 = shared_address(smem);
  const bool q_in_flight = load_query_rows<L, In, kD>(q + (b * Hq + h) * T * kD, smem, row0, t1, n0);
  const TcKeyWalk<L, kD, kDv> walk(st, src, item, w, slots, last_t, smem0 + static_cast<unsigned>(L::kQTile));

  float o[kDv / 8][4];
#pragma unroll
  for (int nd = 0; nd < kDv / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;
  TcSoftmax sm[2];  // this lane's columns of its two rows (a quad sees the same maxima)
  // base-2 logits (TcSoftmax): the scale, the head's temperature and log2(e) in one factor
  const float ls_state = st.scale * (st.head_temps ? st.tau_s[h] : 1.0f) * kLog2eFloat;
  const float ls_window = st.scale * (st.head_temps ? st.tau_w[h] : 1.0f) * kLog2eFloat;
  // The softmax of tile k on this thread's S fragment. Masks (spec 4.4: state keys see every slot,
  // window keys are causal): only a partial tile or a window tile that reaches past the warp's first
  // row needs them, one or two tiles of a row block's walk (warp-uniform branch).
  const auto softmax = [&](std::int64_t k, float(&s)[kTcKeys / 8][4], float(&resc)[2]) {
    bool in_state;
    std::int64_t base;
    int n;
    walk.tile_of(k, in_state, base, n);
    const float ls = in_state ? ls_state : ls_window;
    if (n < kTcKeys || (!in_state && base + kTcKeys - 1 > warp_row0)) {
      int lim[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const std::int64_t t_row = warp_row0 + e * 8 + r;
        const std::int64_t l = in_state ? n : ((t_row - base + 1) < n ? (t_row - base + 1) : n);
        lim[e] = l < 0 ? 0 : static_cast<int>(l);
      }
      tile_softmax<true>(s, sm, ls, lim, resc);
    } else {
      tile_softmax<false>(s, sm, ls, {kTcKeys, kTcKeys}, resc);
    }
  };

  if (walk.tiles > 0) {
    walk.issue(0);  // commits Q's copies (if in flight) with the first tile's
  } else if (q_in_flight) {
    cp_async_commit();  // no key to read (never planned): let Q's copies land before the block exits
    cp_async_wait<0>();
  }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // Warpgroup g multiplies its 64 query rows (Q rows 64 g .. 64 g + 63, K-major) by the key tile
  // (K-major: S = Q K^T needs no transpose) k16 slice by slice: slice kk is 32 bytes into the rows of
  // column block kk / 4. O += P V: V is MN-major ([key][dv] rows), k16 slice j its key rows 16 j ..
  // 16 j + 15, 16 rows of 128 bytes on from the tile's start; P comes from registers.
  const int wg = threadIdx.x / 128;
  const unsigned q_wg = smem0 + static_cast<unsigned>(wg * 64 * 128);
  const auto issue_scores = [&](std::int64_t k, float(&s)[kTcKeys / 8][4]) {
    const unsigned ks = walk.key_buffer(k);
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk)
      wgmma_m64n64k16_ss(s, wgmma_desc_sw128(q_wg + sw128_k16_offset(kTcRows, kk), 16, 1024),
                         wgmma_desc_sw128(ks + sw128_k16_offset(kTcKeys, kk), 16, 1024), kk > 0);
    wgmma_commit();
  };
  const auto issue_values = [&](std::int64_t k, const std::uint32_t(&pa)[kTcKeys / 16][4]) {
    const unsigned vs = walk.value_buffer(k);
#pragma unroll
    for (int kk = 0; kk < kTcKeys / 16; ++kk) {
      const std::uint64_t vdesc = wgmma_desc_sw128(vs + static_cast<unsigned>(kk * 16 * 128), kTcKeys * 128, 1024);
      if constexpr (kDv == 128)
        wgmma_m64n128k16_rs_mn(o, pa[kk], vdesc);
      else
        wgmma_m64n64k16_rs_mn(o, pa[kk], vdesc);
    }
    wgmma_commit();
  };
  // One barrier a tile: it publishes tile k and ends every read of tile k - 1, whose buffer tile k + 1
  // then takes (the copy has the step to land, as with a copy issued before the wait).
  for (std::int64_t k = 0; k < walk.tiles; ++k) {
    cp_async_wait<0>();
    fence_proxy_async_shared();
    __syncthreads();
    if (k + 1 < walk.tiles) walk.issue(k + 1);
    float s[kTcKeys / 8][4];
    wgmma_fence();
    issue_scores(k, s);
    wgmma_wait<0>();
    wgmma_fence_operands(s);
    float resc[2];
    softmax(k, s, resc);
    rescale_rows<kDv>(o, resc);
    std::uint32_t pa[kTcKeys / 16][4];
#pragma unroll
    for (int kk = 0; kk < kTcKeys / 16; ++kk) probabilities(s, sm, kk, pa[kk]);
    wgmma_fence();
    issue_values(k, pa);
    wgmma_wait<0>();
    wgmma_fence_operands(o);
    wgmma_fence_operands(pa);
  }
#else
  // mma.sync: A fragments of Q: lane l points at row l % 16 of the warp's rows, dims (l / 16) * 8 of
  // the k-step. B fragments of K (k = dim, n = key) from ldmatrix: lane l points at key row l % 8 of
  // 8x8 matrix l / 8, the matrices being dims +0, +8, +16, +24 of the key rows, which gives the (b0, b1)
  // pairs of two consecutive k-steps. V fragments from ldmatrix.trans: lane l points at key row
  // kk*16 + 8*((l/8) % 2) + l % 8, dims (nd + l/16)*8, which gives the (b0, b1) pairs of dim tiles nd
  // and nd + 1.
  const unsigned q_lane = smem0 + L::q_offset(warp * 16 + lane % 16, lane / 16);
  for (std::int64_t k = 0; k < walk.tiles; ++k) {
    issue_next_and_wait(k, walk.tiles, [&](std::int64_t next) { walk.issue(next); });
    __syncthreads();
    const unsigned ks = walk.key_buffer(k), vs = walk.value_buffer(k);
    float s[kTcKeys / 8][4];
#pragma unroll
    for (int nt = 0; nt < kTcKeys / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; kk += 2) {
      std::uint32_t qa[2][4];
      ldmatrix_x4(qa[0], q_lane + static_cast<unsigned>(kk * 16 * 2));
      ldmatrix_x4(qa[1], q_lane + static_cast<unsigned>((kk * 16 + 16) * 2));
#pragma unroll
      for (int nt = 0; nt < kTcKeys / 8; ++nt) {
        std::uint32_t bk[4];
        ldmatrix_x4(bk, ks + L::k_offset(nt * 8 + lane % 8, lane / 8 + kk * 2));
        mma_bf16_16816(s[nt], qa[0], bk[0], bk[1]);
        mma_bf16_16816(s[nt], qa[1], bk[2], bk[3]);
      }
    }
    float resc[2];
    softmax(k, s, resc);
    rescale_rows<kDv>(o, resc);
#pragma unroll
    for (int kk = 0; kk < kTcKeys / 16; ++kk) {
      std::uint32_t pa[4];
      probabilities(s, sm, kk, pa);
      const unsigned vrow = vs + L::v_offset(kk * 16 + ((lane / 8) % 2) * 8 + lane % 8, lane / 16);
#pragma unroll
      for (int nd = 0; nd < kDv / 8; nd += 2) {
        std::uint32_t bv[4];
        ldmatrix_x4_trans(bv, vrow + nd * 8 * 2);
        mma_bf16_16816(o[nd], pa, bv[0], bv[1]);
        mma_bf16_16816(o[nd + 1], pa, bv[2], bv[3]);
      }
    }
    __syncthreads();  // this buffer is refilled by the issue two tiles on
  }
#endif
  // l = the quad's partial sums (every lane was rescaled by the same maxima)
  float inv[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float sum = sm[e].sum;
    sum += warp_shfl_xor(sum, 1);
    sum += warp_shfl_xor(sum, 2);
    inv[e] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
  // bf16 / fp16 outputs leave through shared memory. Stored from the registers, each warp store wrote
  // two-byte pieces of eight rows (a thread holds two adjacent columns of every eight-column tile, 128
  // stores); staged in the warp's own 16 Q rows they leave as whole 16-byte row segments, eight vector
  // stores a thread. Nothing reads those Q rows any more: on
  // the wgmma path every warp of the warpgroup issued the last P V, so had passed its wait for the last
  // S, before the wait that ended the loop. Float outputs (twice the bytes of the warp's Q rows) and a
  // misaligned output keep the direct stores.
  static_assert(kDv <= kD, "a warp's output rows fit in its Q rows");
  if constexpr (std::is_same_v<Out, bf16> || std::is_same_v<Out, fp16>) {
    if (reinterpret_cast<std::uintptr_t>(out) % 16 == 0) {
#pragma unroll
      for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int nd = 0; nd < kDv / 8; ++nd) {
          const std::uint32_t pair = std::uint32_t(store_as<Out>(o[nd][2 * e] * inv[e]).bits) |
                                     std::uint32_t(store_as<Out>(o[nd][2 * e + 1] * inv[e]).bits) << 16;
          *reinterpret_cast<std::uint32_t*>(smem + L::q_offset(warp * 16 + e * 8 + r, nd) + 4 * quad) = pair;
        }
      warp_sync();
      constexpr int kVecs = kDv / 8;
#pragma unroll
      for (int i = 0; i < 16 * kVecs / 32; ++i) {
        const int v = lane + 32 * i, row = v / kVecs, c = v % kVecs;
        const std::int64_t t = warp_row0 + row;
        if (t < t1)
          *reinterpret_cast<uint4*>(out + (((b * T + (t - n0)) * Hq) + h) * kDv + c * 8) =
              *reinterpret_cast<const uint4*>(smem + L::q_offset(warp * 16 + row, c));
      }
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const std::int64_t t = warp_row0 + e * 8 + r;
    if (t >= t1) continue;
    Out* orow = out + (((b * T + (t - n0)) * Hq) + h) * kDv;
#pragma unroll
    for (int nd = 0; nd < kDv / 8; ++nd) {
      const int c = nd * 8 + 2 * quad;
      orow[c] = store_as<Out>(o[nd][2 * e] * inv[e]);
      orow[c + 1] = store_as<Out>(o[nd][2 * e + 1] * inv[e]);
    }
  }
}

}  // namespace kvmem::cuda::kvm_detail
