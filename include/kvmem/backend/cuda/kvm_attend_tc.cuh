// SPDX-License-Identifier: Apache-2.0
#pragma once
// Tensor-core KVM prefill readout for bf16 storage (spec 4.4): the same joint online softmax over
// [state slots | causal window] as attend_rows_kernel, with q.k and p.v on the tensor cores
// (mma.sync m16n8k16, bf16 operands, fp32 accumulation, accumulators in registers). Like
// FlashAttention, the probabilities are rounded to bf16 before the p.v product; logits, the running
// max/sum and the output accumulator stay fp32. Four warps own 32 query rows each (128 rows of one
// head per block); keys arrive in tiles of 64 rows, double-buffered in shared memory with cp.async.
// The update's novelty and routing passes are in kvm_route_tc.cuh.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kvmem/backend/cuda/kvm_kernels.cuh"
#include "kvmem/backend/cuda/ptx.cuh"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"

namespace kvmem::cuda::kvm_detail {

inline constexpr int kTcWarps = 4;
// 16-row mma atoms per warp. Two (FlashAttention-2's 32 rows a warp, 255 registers, two blocks per SM)
// against one (Q fragments in registers, 168 registers, three blocks per SM): 132.0 vs 140.2 us per
// 4K fixed-256 chunk readout, 32K prefill 35.98 vs 37.66 ms (fixed-256) and 107.8 vs 116.0 ms (16 sqrt
// N) on the H200 (results kvm_cuda_2026-11-30_h200_v4_readout.md).
inline constexpr int kTcAtoms = 2;
inline constexpr int kTcRows = 16 * kTcAtoms * kTcWarps;  // query rows per block
inline constexpr int kTcKeys = 64;                        // keys per tile

// Shared memory: the block's query rows (bf16, loaded once), then two K/V tile buffers (cp.async double
// buffering); rows padded by 16 bytes so the 8 rows of an ldmatrix hit 32 different banks.
template <int kD, int kDv>
struct TcLayout {
  static constexpr int kQPitch = kD + 8;  // bf16 elements
  static constexpr int kKPitch = kD + 8;
  static constexpr int kVPitch = kDv + 8;
  static constexpr std::size_t kQTile = std::size_t(kTcRows) * kQPitch * 2;  // bytes
  static constexpr std::size_t kKTile = std::size_t(kTcKeys) * kKPitch * 2;
  static constexpr std::size_t kVTile = std::size_t(kTcKeys) * kVPitch * 2;
  static constexpr std::size_t kBuffer = kKTile + kVTile;
  static constexpr std::size_t kBytes = kQTile + 2 * kBuffer;
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

// Where a readout finds its keys. The slots: the live state's readout copies, or a snapshot of them
// taken when the chunk's update was done (the readout then runs beside later updates). The window:
// the ring (position p at row p mod W), or the call's own k/v inputs (position p at row p - n0),
// which hold every window position of a chunk whose window starts inside the call.
struct TcSources {
  const bf16* khat;    // [I, cap, D]
  const bf16* vhat;    // [I, cap, Dv]
  const bf16* wk;      // ring [I, W, D] or inputs [I, T, D]
  const bf16* wv;      // ring [I, W, Dv] or inputs [I, T, Dv]
  std::int64_t rows;   // rows per item of wk, wv: W or T
  std::int64_t first;  // inputs: the position of row 0 (n0)
  bool ring;
};

// Readout of rows [t0, t1) on the tensor cores. Block: rows t0 + rb*kTcRows + [0, kTcRows) of head
// bh = b*Hq + h; the row blocks of one head are adjacent in the grid, so they run together and read
// the head's key/value tiles from L2 instead of each from DRAM. Each warp owns kTcAtoms x 16 query
// rows; S = Q K^T and O += P V run as m16n8k16 mma.sync with the accumulators (S tile and the whole O
// row block) in registers, the FlashAttention-2 layout. Q sits in shared memory (bf16, loaded once)
// and reaches the tensor cores through ldmatrix one k-step pair at a time: with two atoms per warp,
// every K and V fragment a warp loads feeds two mma instead of one (half the ldmatrix traffic per mma,
// and a block's L2 -> shared copies serve twice the rows), and the registers Q would take hold the
// second atom's accumulators. Thread (lane) holds rows r = lane/4 and r + 8 of each atom, columns
// 2*(lane%4) + {0,1} of every 8-wide tile; the four lanes of a quad share a row's maxima (shuffles)
// and add their partial sums at the end. Key tiles are [state slots...][window...] in steps of
// kTcKeys, the next one loading (cp.async) while the current one is used.
// grid B*Hq*ceil((t1 - t0) / kTcRows) (row block fastest), block 32 * kTcWarps, dynamic smem TcLayout::kBytes.
// q: [B,Hq,T,kD], out: [B,T,Hq,kDv]
template <class In, class Out, int kD, int kDv>
__global__ void __launch_bounds__(32 * kTcWarps, kTcAtoms == 1 ? 3 : 2)
    attend_tc_kernel(DeviceState<bf16, float> st, TcSources src, const In* q, Out* out, std::int64_t T, std::int64_t n0,
                     std::int64_t t0, std::int64_t t1, std::int64_t w, std::int64_t slots) {
  using L = TcLayout<kD, kDv>;
  using namespace ptx;
  constexpr int kM = kTcAtoms;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, quad = lane % 4, r = lane / 4;
  const std::int64_t row_blocks = (t1 - t0 + kTcRows - 1) / kTcRows;
  const std::int64_t bh = blockIdx.x / row_blocks, rb = blockIdx.x % row_blocks;
  const std::int64_t Hq = st.Hq, b = bh / Hq, h = bh % Hq, item = b * st.Hk + h / st.rep();
  const std::int64_t row0 = t0 + rb * kTcRows;  // the block's first row
  const std::int64_t last_t = (row0 + kTcRows - 1) < (t1 - 1) ? (row0 + kTcRows - 1) : (t1 - 1);
  const std::int64_t warp_row0 = row0 + warp * 16 * kM;
  // this thread's row of atom m, half e (rows r and r + 8 of the atom)
  const auto row_of_thread = [&](int m, int e) { return warp_row0 + m * 16 + e * 8 + r; };
  const unsigned smem0 = shared_address(smem_raw);
  const unsigned kv0 = smem0 + static_cast<unsigned>(L::kQTile);  // the K/V buffers follow Q

  // Q rows of the block -> shared memory as bf16 (rows past t1: zeros); the loop's first wait and
  // barrier publish them. bf16 inputs in 16-byte rows travel as they are, by cp.async in the first
  // tile's group: the copies of a thread are all in flight at once, and the first key tile's with them.
  // (Loaded and converted one vector after another, they cost a global round trip per vector before
  // the first tile was even issued: long-scoreboard stalls were 23 % of a fixed-256 readout's, v6.)
  bool q_in_flight = false;
  if constexpr (std::is_same_v<In, bf16>) {
    if (reinterpret_cast<std::uintptr_t>(q) % 16 == 0) {  // kD % 8 == 0: then every row is 16-byte aligned
      constexpr int kVecs = kD / 8, kPerThread = kTcRows * kVecs / (32 * kTcWarps);
      static_assert(kTcRows * kVecs % (32 * kTcWarps) == 0, "whole vectors per thread");
      const In* q_head = q + (b * Hq + h) * T * kD;
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int e = threadIdx.x + i * 32 * kTcWarps, row = e / kVecs, c = (e % kVecs) * 8;
        const std::int64_t t = row0 + row;
        cp_async16(smem0 + static_cast<unsigned>((row * L::kQPitch + c) * 2),
                   t < t1 ? q_head + (t - n0) * kD + c : q_head, t < t1 ? 16 : 0);
      }
      q_in_flight = true;
    }
  }
  if (!q_in_flight) {
    bf16* qs = reinterpret_cast<bf16*>(smem_raw);
    constexpr int kVecs = kD / 8;
    for (int e = threadIdx.x; e < kTcRows * kVecs; e += blockDim.x) {
      const int s = e / kVecs, c = (e % kVecs) * 8;
      const std::int64_t t = row0 + s;
      std::uint32_t packed[4] = {0u, 0u, 0u, 0u};
      if (t < t1) {
        const In* qr = q + ((b * Hq + h) * T + (t - n0)) * kD + c;
#pragma unroll
        for (int j = 0; j < 4; ++j) packed[j] = pack_bf16(load_as<float>(qr[2 * j]), load_as<float>(qr[2 * j + 1]));
      }
      *reinterpret_cast<uint4*>(qs + s * L::kQPitch + c) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    }
  }
  float o[kM][kDv / 8][4];
#pragma unroll
  for (int m = 0; m < kM; ++m)
#pragma unroll
    for (int nd = 0; nd < kDv / 8; ++nd) o[m][nd][0] = o[m][nd][1] = o[m][nd][2] = o[m][nd][3] = 0.0f;
  TcSoftmax sm[kM][2];  // this lane's columns of each of its rows (a quad sees the same maxima)
  // base-2 logits (TcSoftmax): the scale, the head's temperature and log2(e) in one factor
  const float ls_state = st.scale * (st.head_temps ? st.tau_s[h] : 1.0f) * kLog2eFloat;
  const float ls_window = st.scale * (st.head_temps ? st.tau_w[h] : 1.0f) * kLog2eFloat;

  const std::int64_t n_state = w > 0 ? slots : 0;
  const std::int64_t state_tiles = (n_state + kTcKeys - 1) / kTcKeys;
  const std::int64_t tiles = state_tiles + (last_t + 1 - w + kTcKeys - 1) / kTcKeys;
  // tile k -> its first key (slot index or window position) and key count
  const auto tile_of = [&](std::int64_t k, bool& in_state, std::int64_t& base, int& n) {
    in_state = k < state_tiles;
    base = in_state ? k * kTcKeys : w + (k - state_tiles) * kTcKeys;
    const std::int64_t end = in_state ? n_state : last_t + 1;
    n = static_cast<int>((end - base) < kTcKeys ? (end - base) : kTcKeys);
  };
  // Each thread copies the same 16-byte column c of tile rows s0, s0 + kStep, ...: the column, the
  // first row and the shared-memory offsets are fixed per thread, so a full tile of contiguous rows
  // (every slot tile but the last, every window tile from the inputs, ring tiles that do not wrap) is
  // a pointer stride per copy; only a partial or wrapping tile works out each row.
  constexpr int kKVecs = kD / 8, kVVecs = kDv / 8;
  static_assert((32 * kTcWarps) % kKVecs == 0 && (32 * kTcWarps) % kVVecs == 0, "whole rows per pass");
  constexpr int kKStep = 32 * kTcWarps / kKVecs, kVStep = 32 * kTcWarps / kVVecs;
  const int kc = threadIdx.x % kKVecs, ks0 = threadIdx.x / kKVecs;
  const int vc = threadIdx.x % kVVecs, vs0 = threadIdx.x / kVVecs;
  const unsigned k_dst0 = kv0 + static_cast<unsigned>((ks0 * L::kKPitch + kc * 8) * 2);
  const unsigned v_dst0 = kv0 + static_cast<unsigned>(L::kKTile + (vs0 * L::kVPitch + vc * 8) * 2);
  const int ring_len = static_cast<int>(st.W);
  const auto issue = [&](std::int64_t k) {
    bool in_state;
    std::int64_t base;
    int n;
    tile_of(k, in_state, base, n);
    const unsigned buf = static_cast<unsigned>((k % 2) * L::kBuffer);
    // Tile row s is slot base + s, or window position base + s at ring row (base + s) mod W or input
    // row base + s - n0 (32-bit arithmetic per row, no 64-bit modulo).
    const bf16* kbase = in_state ? src.khat + (item * st.cap + base) * kD : src.wk + item * src.rows * kD;
    const bf16* vbase = in_state ? src.vhat + (item * st.cap + base) * kDv : src.wv + item * src.rows * kDv;
    const bool wraps = !in_state && src.ring;
    const int first_row = in_state ? 0 : static_cast<int>(src.ring ? base % st.W : base - src.first);
    if (n == kTcKeys && (!wraps || first_row + kTcKeys <= ring_len)) {
      const bf16* kp = kbase + std::int64_t(first_row + ks0) * kD + kc * 8;
      const bf16* vp = vbase + std::int64_t(first_row + vs0) * kDv + vc * 8;
#pragma unroll
      for (int i = 0; i < kTcKeys / kKStep; ++i)
        cp_async16(k_dst0 + buf + i * kKStep * L::kKPitch * 2, kp + i * kKStep * kD, 16);
#pragma unroll
      for (int i = 0; i < kTcKeys / kVStep; ++i)
        cp_async16(v_dst0 + buf + i * kVStep * L::kVPitch * 2, vp + i * kVStep * kDv, 16);
    } else {
      const auto row_of = [&](int s) {  // rows past n read row 0 (a valid address; zero-filled)
        if (s >= n) s = 0;
        int r = first_row + s;
        if (wraps)
          while (r >= ring_len) r -= ring_len;
        return r;
      };
#pragma unroll
      for (int i = 0; i < kTcKeys / kKStep; ++i) {
        const int s = ks0 + i * kKStep;
        cp_async16(k_dst0 + buf + i * kKStep * L::kKPitch * 2, kbase + std::int64_t(row_of(s)) * kD + kc * 8,
                   s < n ? 16 : 0);
      }
#pragma unroll
      for (int i = 0; i < kTcKeys / kVStep; ++i) {
        const int s = vs0 + i * kVStep;
        cp_async16(v_dst0 + buf + i * kVStep * L::kVPitch * 2, vbase + std::int64_t(row_of(s)) * kDv + vc * 8,
                   s < n ? 16 : 0);
      }
    }
    cp_async_commit();
  };

  // One key tile: S = Q K^T, the online softmax, O += P V. kMasked: some key of the tile is hidden from
  // some row of the warp (spec 4.4: state keys see every slot, window keys are causal; key col is
  // visible to a row iff col < that row's limit). Only a partial tile or a window tile that reaches
  // past the warp's first row needs the masks: one or two tiles of a row block's walk.
  // A fragments of Q: lane l points at row l % 16 of the atom, dims (l / 16) * 8 of the k-step.
  const unsigned q_lane = smem0 + static_cast<unsigned>(((warp * 16 * kM + lane % 16) * L::kQPitch + (lane / 16) * 8) * 2);
  const auto tile_step = [&](std::int64_t k, auto masked_tag) {
    constexpr bool kMasked = decltype(masked_tag)::value;
    bool in_state;
    std::int64_t base;
    int n;
    tile_of(k, in_state, base, n);
    const unsigned ks = kv0 + static_cast<unsigned>((k % 2) * L::kBuffer);
    const unsigned vs = ks + static_cast<unsigned>(L::kKTile);
    // S = Q K^T: 8 tiles of 8 keys. B fragments (k = dim, n = key) come from ldmatrix: lane l points
    // at key row l % 8 of 8x8 matrix l / 8, the matrices being dims +0, +8, +16, +24 of the key
    // rows, which gives the (b0, b1) pairs of two consecutive k-steps.
    float s[kM][kTcKeys / 8][4];
#pragma unroll
    for (int m = 0; m < kM; ++m)
#pragma unroll
      for (int nt = 0; nt < kTcKeys / 8; ++nt) s[m][nt][0] = s[m][nt][1] = s[m][nt][2] = s[m][nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; kk += 2) {
      std::uint32_t qa[kM][2][4];
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        ldmatrix_x4(qa[m][0], q_lane + static_cast<unsigned>((m * 16 * L::kQPitch + kk * 16) * 2));
        ldmatrix_x4(qa[m][1], q_lane + static_cast<unsigned>((m * 16 * L::kQPitch + kk * 16 + 16) * 2));
      }
#pragma unroll
      for (int nt = 0; nt < kTcKeys / 8; ++nt) {
        std::uint32_t bk[4];
        ldmatrix_x4(bk, ks + static_cast<unsigned>(((nt * 8 + lane % 8) * L::kKPitch + (lane / 8) * 8 + kk * 16) * 2));
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          mma_bf16_16816(s[m][nt], qa[m][0], bk[0], bk[1]);
          mma_bf16_16816(s[m][nt], qa[m][1], bk[2], bk[3]);
        }
      }
    }
    // scale (base 2), mask, row maxima over the quad, online softmax
    const float ls = in_state ? ls_state : ls_window;
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      int lim[2] = {kTcKeys, kTcKeys};
      if constexpr (kMasked) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const std::int64_t t_row = row_of_thread(m, e);
          const std::int64_t l = in_state ? n : ((t_row - base + 1) < n ? (t_row - base + 1) : n);
          lim[e] = l < 0 ? 0 : static_cast<int>(l);
        }
      }
      float mx[2] = {negative_infinity<float>(), negative_infinity<float>()};
#pragma unroll
      for (int nt = 0; nt < kTcKeys / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[m][nt][e] *= ls;
          if constexpr (kMasked) {
            if (nt * 8 + 2 * quad + (e & 1) >= lim[e / 2]) s[m][nt][e] = negative_infinity<float>();
          }
          mx[e / 2] = fmaxf(mx[e / 2], s[m][nt][e]);
        }
      }
      float resc[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 1));
        mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 2));
        resc[e] = sm[m][e].raise_max(mx[e]);
      }
      if (resc[0] != 1.0f || resc[1] != 1.0f) {
#pragma unroll
        for (int nd = 0; nd < kDv / 8; ++nd) {
          o[m][nd][0] *= resc[0];
          o[m][nd][1] *= resc[0];
          o[m][nd][2] *= resc[1];
          o[m][nd][3] *= resc[1];
        }
      }
    }
    // O += P V: P (rounded to bf16, as FlashAttention does) comes straight from the S registers; the
    // V fragments from ldmatrix.trans: lane l points at key row kk*16 + 8*((l/8) % 2) + l % 8, dims
    // (nd + l/16)*8, which gives the (b0, b1) pairs of dim tiles nd and nd + 1.
#pragma unroll
    for (int kk = 0; kk < kTcKeys / 16; ++kk) {
      std::uint32_t pa[kM][4];
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        pa[m][0] = pack_bf16(sm[m][0].accumulate(s[m][2 * kk][0]), sm[m][0].accumulate(s[m][2 * kk][1]));
        pa[m][1] = pack_bf16(sm[m][1].accumulate(s[m][2 * kk][2]), sm[m][1].accumulate(s[m][2 * kk][3]));
        pa[m][2] = pack_bf16(sm[m][0].accumulate(s[m][2 * kk + 1][0]), sm[m][0].accumulate(s[m][2 * kk + 1][1]));
        pa[m][3] = pack_bf16(sm[m][1].accumulate(s[m][2 * kk + 1][2]), sm[m][1].accumulate(s[m][2 * kk + 1][3]));
      }
      const unsigned vrow =
          vs + static_cast<unsigned>(((kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * L::kVPitch + (lane / 16) * 8) * 2);
#pragma unroll
      for (int nd = 0; nd < kDv / 8; nd += 2) {
        std::uint32_t bv[4];
        ldmatrix_x4_trans(bv, vrow + nd * 8 * 2);
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          mma_bf16_16816(o[m][nd], pa[m], bv[0], bv[1]);
          mma_bf16_16816(o[m][nd + 1], pa[m], bv[2], bv[3]);
        }
      }
    }
  };

  if (tiles > 0) {
    issue(0);  // commits Q's copies (if in flight) with the first tile's
  } else if (q_in_flight) {
    cp_async_commit();  // no key to read (never planned): let Q's copies land before the block exits
    cp_async_wait<0>();
  }
  for (std::int64_t k = 0; k < tiles; ++k) {
    issue_next_and_wait(k, tiles, issue);
    __syncthreads();
    bool in_state;
    std::int64_t base;
    int n;
    tile_of(k, in_state, base, n);
    if (n < kTcKeys || (!in_state && base + kTcKeys - 1 > warp_row0))  // warp-uniform
      tile_step(k, std::true_type{});
    else
      tile_step(k, std::false_type{});
    __syncthreads();  // this buffer is refilled by the issue two tiles on
  }
  // l = the quad's partial sums (every lane was rescaled by the same maxima)
#pragma unroll
  for (int m = 0; m < kM; ++m)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const std::int64_t t = row_of_thread(m, e);
      float sum = sm[m][e].sum;
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (t >= t1) continue;
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      Out* orow = out + (((b * T + (t - n0)) * Hq) + h) * kDv;
#pragma unroll
      for (int nd = 0; nd < kDv / 8; ++nd) {
        const int c = nd * 8 + 2 * quad;
        orow[c] = store_as<Out>(o[m][nd][2 * e] * inv);
        orow[c + 1] = store_as<Out>(o[m][nd][2 * e + 1] * inv);
      }
    }
}

// Copies the readout keys and values of slots [0, slots) of every item (khat, vhat; same layout, cap
// rows per item) into a snapshot that a readout reads while later updates change the state. 16-byte
// vectors: D and Dv are multiples of 8 (64 or 128 here). grid (I, any), block any.
__global__ void snapshot_readout_kernel(const bf16* __restrict__ khat, const bf16* __restrict__ vhat,
                                        bf16* __restrict__ snap_k, bf16* __restrict__ snap_v, std::int64_t cap,
                                        std::int64_t D, std::int64_t Dv, std::int64_t slots) {
  const std::int64_t i = blockIdx.x, k_vecs = slots * D / 8, v_vecs = slots * Dv / 8;
  const uint4* ks = reinterpret_cast<const uint4*>(khat + i * cap * D);
  const uint4* vs = reinterpret_cast<const uint4*>(vhat + i * cap * Dv);
  uint4* kd = reinterpret_cast<uint4*>(snap_k + i * cap * D);
  uint4* vd = reinterpret_cast<uint4*>(snap_v + i * cap * Dv);
  const std::int64_t stride = std::int64_t(gridDim.y) * blockDim.x;
  for (std::int64_t e = std::int64_t(blockIdx.y) * blockDim.x + threadIdx.x; e < k_vecs + v_vecs; e += stride) {
    if (e < k_vecs)
      kd[e] = ks[e];
    else
      vd[e - k_vecs] = vs[e - k_vecs];
  }
}

}  // namespace kvmem::cuda::kvm_detail
