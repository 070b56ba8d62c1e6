// SPDX-License-Identifier: Apache-2.0
#pragma once
// Dense Universal Attention prefill on the tensor cores (bf16 storage; spec UA.md 4.1-4.3): every row of
// the call in one launch, with no split partials and no merge.
//
// Why a separate path: with p = 0 nothing is evicted, so the chunk boundaries of 4.5 do not change the
// result and the prompt need not be walked chunk by chunk. With p > 0 (a threshold), query i of the chunk
// [t0, t0 + P) sees entry j iff j >= t0 or Λ_{t0-1, j} >= ln p, with the dense Λ_ij as its decay (every A
// <= 0, so an entry below ln p at a chunk end stays below it): the dense prefill with a mask. Row tile k
// receives Λ_{r0-1, j} of every earlier entry anyway (below); where r0 starts a chunk it sets those below
// ln p to -inf (DeviceCall::prune_tiles), and a launch over whole chunks ends with the survivors' λ and -inf
// for the rest, dead rows that prune_compact_kernel counts and drops once they are a sixteenth of the item's rows
// (ua_run runs a long pruned prompt as several such launches). Each block owns
// one row tile (kDnPairs (head, row) pairs = r heads x kDnPairs / r rows) of one (sequence, kv head) item and walks
// *every* entry up to its last row, so it finishes its own softmax and writes the output directly (FlashAttention's
// query-stationary order). The one dependency is λ: row tile k needs Λ_{r0-1, j} of every entry j
// before its first row r0, which row tile k-1 hands over as it passes each entry tile. The row tiles of an
// item therefore run as a pipeline: tile k carries λ of an entry after tile k-1 has handed it over (one
// 64-bit word per entry, λ and a tag, stored and read whole through L2: dense_sync_bytes). Blocks take their
// row tile from an integer ticket in launch order, so the tile a block waits for belongs to a block that
// is already running: no deadlock, whatever order the hardware starts blocks in.
// λ is carried one entry per thread in increasing row (spec 4.2, the rounding order of every backend);
// every output is produced by one block in a fixed order: deterministic, no float atomics.
// Memory: the cache rows the prompt is appended to, 8 bytes of hand-off per row (UaCache) and no L x L matrix.
//
// Entry tiles are walked newest first (the order of the softmax sum is free; λ is carried per entry, along
// the rows, so the entry order does not touch it). The newest entries carry the least decay, so the
// running maximum is usually settled by the first tile: later tiles skip the rescale of O (its factor is
// exactly 1 when no maximum of the warp moved), the exps and P V of a tile whose weights all underflow for
// the warp, and a 16-entry step of P V whose weights are all 0 (they would add exact zeros). The skips
// leave every result bit unchanged; how often they fire depends on how fast Λ decays.
//
// Inside a block: 4 warps, each 16 (head, row) pairs of the tile, at <= 168 registers so that three blocks
// share an SM (12 warps to hide the latencies of each step's dependent phases); entries arrive 64 at a
// time, keys through a cp.async double buffer, values through one buffer loaded while the decay runs. Per
// entry tile, two block barriers: each warp folds the decay of 16 entries for all rows of the tile (their
// key/key similarity with mma.sync, A(e, m) into shared memory) and 16 of its lanes carry λ down those
// columns at once (no barrier between fold and carry) into a Λ tile -> barrier -> per half tile of 32
// entries: logits = Λ + Q K^T with mma.sync (fp32 accumulators in registers that start from Λ), online
// softmax in registers, O += P V with the probabilities rounded to bf16 (as FlashAttention does). The key
// gate and the log1p of the fold run on lg2 / ex2, and the fold and the carry of the usual tile (every
// entry before the tile's rows) take no mask selects.
// Built for sm_90a with D a multiple of 64 (the compute_90 PTX and D = 80 keep the mma.sync path above),
// the block's 4 warps are one warpgroup and the two products of step 3 run as warpgroup MMA (wgmma) from
// 128-byte-swizzled key and value tiles: Q K^T of the whole entry tile is issued right after barrier 1 and
// runs on the tensor cores during the decay and the carry, Λ is added to it after barrier 2, then the
// online softmax and P V (P from registers). Q lives in shared memory and the key tiles in one buffer, so
// that three blocks share an SM as on mma.sync. P V stays in flight up to the next barrier 1, and a warp
// past the decay's reach sets P = 0 without sums.
//
// The decay of a set made of the built-in gates (any of QueryGate, KeyGate, SimilarityGate) is evaluated in
// base 2 with the per-key and per-position terms scaled once per entry / row: log2 x = q_m + k_j +
// (2 n_sim / |set|) log2 c_jm, x = 2^(log2 x), A = log1p(-min(x, 1 - 1e-6)): the spec's x and A (4.1) to
// within a few ulp of x (as the natural-log fold), A within 1.4e-7 absolute (dense_log1m), one fused
// multiply-add per pair instead of a division by |set|, and no branches, so the compiler interleaves the
// pairs. Any other set goes through the shared fold (kernel/ua_decay.hpp) pair by pair.

#if KVMEM_GPU_VENDOR_PATHS
#include <cuda_bf16.h>
#endif
#include "kvmem/backend/cuda/vendor.cuh"

#include <cstdint>
#include <type_traits>

#include "kvmem/backend/cuda/ptx.cuh"
#include "kvmem/backend/cuda/ua_kernels.cuh"
#include "kvmem/core/numeric.hpp"
#include "kvmem/kernel/ua_decay.hpp"
#include "kvmem/policy/decay.hpp"

namespace kvmem::cuda::ua_detail {

// Warps per block: 4 (64 pairs), three blocks per SM (<= 168 registers), so that 12 warps an SM hide the
// latencies of a step's dependent phases. The per-warp λ carry (step 2 of the kernel) needs each warp to
// fold all rows of its entries, which holds for 4 warps. The wgmma path (sm_90a) fits three blocks too,
// with Q in shared memory (its fragments would take 32 registers) and one key buffer: 168 registers and no
// spill (sm_90a, D = 128).
inline constexpr int kDnWarps = 4;
inline constexpr int kDnThreads = 32 * kDnWarps;
inline constexpr int kDnPairs = 16 * kDnWarps;    // (head, row) pairs per row tile
inline constexpr int kDnEntries = 16 * kDnWarps;  // entries per entry tile: 16 per warp
inline constexpr int kDnMaxRows = kDnPairs / 4;   // rows per row tile at most (r >= 4)
inline constexpr int kDnBlocksPerSM = 3;

// Rows of a row tile for group size r (r in {4, 8}), and the row tiles of a T-row call.
__host__ __device__ constexpr int dense_row_tile(std::int64_t r) {
  return int(kDnPairs / r);
}
__host__ __device__ inline std::int64_t dense_row_tiles(std::int64_t T, std::int64_t r) {
  return (T + dense_row_tile(r) - 1) / dense_row_tile(r);
}
// The row tile and item of a block's ticket. Tickets go out in launch order, item group by item group
// (`group` items, the last group may be smaller); inside a group, row tile k of every item before row tile
// k + 1 of any. Row tile k - 1 of an item always has the smaller ticket, so the tile a block waits for
// belongs to a block that started before it (no deadlock for any group size).
struct DenseTicketTile {
  std::int64_t k, item;
};
// In 32 bits: the tickets number the blocks of one launch (grid.x < 2^31), so every value here is below 2^31.
__host__ __device__ inline DenseTicketTile dense_ticket_tile(std::int64_t ticket, std::int64_t items,
                                                             std::int64_t tiles, std::int64_t group) {
  const unsigned t = unsigned(ticket), n = unsigned(items), g = unsigned(group);
  const unsigned first = t / (g * unsigned(tiles)) * g;  // the group's first item
  const unsigned size = g < n - first ? g : n - first;
  const unsigned within = t - first * unsigned(tiles);
  return {std::int64_t(within / size), std::int64_t(first + within % size)};
}
// Pipeline state of the dense prefill (UaCache's dense sync memory): the ticket (an int, in 8 bytes), then per
// (item, cache row) the λ hand-off from a row tile to the next, one 64-bit word: the entry's λ (float bits,
// low half) and a tag (high half), the number of the row tile that may take it (row tile k writes k + 1).
// The word is stored and read whole (single-copy atomic), so the value comes with its own proof of
// freshness: no counter, no fence. Zeroed for the rows of a call before its launch (no row tile 0 waits).
__host__ __device__ inline std::int64_t dense_sync_bytes(std::int64_t items, std::int64_t capacity) {
  return 8 + items * capacity * 8;
}
__device__ inline std::uint64_t dense_lambda_word(float lambda, std::int64_t tag) {
  return (std::uint64_t(std::uint32_t(tag)) << 32) | __float_as_uint(lambda);
}

// Shared memory of a block. kSwizzled (the wgmma path: sm_90a and kD a multiple of 64): the key, value and
// query tiles in the 128-byte swizzle layout the tensor cores read through descriptors (ptx::sw128_offset:
// Q [pair][dim] and a key tile, both K-major, are the A and B operands of S = Q K^T, the value tile read
// MN-major the B operand of O += P V; the swizzle also spreads the 8 rows of an ldmatrix over all banks, so
// the rows need no padding), starting on a 1024-byte boundary (ptx::align_shared_1024, hence 1024 spare
// bytes), and one key buffer (see the kernel). Otherwise rows padded by 16 bytes and two key buffers.
template <int kD, bool kSwizzled = false>
struct UaDenseLayout {
  static_assert(kD % 16 == 0, "the dense tensor-core UA kernel takes head dims that are multiples of 16");
  static_assert(!kSwizzled || kD % 64 == 0, "the swizzled tiles of the dense UA kernel take whole 128-byte rows");
  static constexpr int kKPitch = kD + 8;  // bf16: rows 16 bytes apart modulo 128, ldmatrix without conflicts
  // bytes from a tile row to the next one (of the same 64-column block when swizzled)
  static constexpr unsigned kRowBytes = kSwizzled ? 128u : unsigned(kKPitch * 2);
  // float: decay tile A [entry][row], an entry's rows contiguous: its carrier loads them in 16-byte
  // vectors. Pitch kDnMaxRows + 4: the 16-byte accesses of 8 consecutive entries fall in distinct banks
  static constexpr int kAPitch = kDnMaxRows + 4;
  // float: Λ tile [row][entry] for step 3, where a lane reads the two entries of its accumulator pair as one
  // 8-byte vector; pitch kDnEntries + 8 puts the 4 rows of a half warp 8 banks apart (no conflicts)
  static constexpr int kLPitch = kDnEntries + 8;
  static constexpr std::size_t kTile = std::size_t(kDnEntries) * (kSwizzled ? kD : kKPitch) * 2;
  static constexpr int kKBufs = kSwizzled ? 1 : 2;
  static constexpr std::size_t kK = 0;               // [kKBufs][kDnEntries][kD] keys of the entry tiles
  static constexpr std::size_t kV = kKBufs * kTile;  // [kDnEntries][kD] values (one buffer, see the kernel)
  static constexpr std::size_t kQ = kV + kTile;      // [kDnPairs][kD] queries (swizzled only)
  static constexpr std::size_t kNK =
      kQ + (kSwizzled ? std::size_t(kDnPairs) * kD * 2 : 0);  // [kDnMaxRows][kKPitch]
                                                              // keys of the row tile (always padded)
  static constexpr std::size_t kA = kNK + std::size_t(kDnMaxRows) * kKPitch * 2;  // [kDnEntries][kAPitch]
  static constexpr std::size_t kL = kA + std::size_t(kDnEntries) * kAPitch * 4;   // [kDnMaxRows][kLPitch]
  static constexpr std::size_t kBytes = kL + std::size_t(kDnMaxRows) * kLPitch * 4 + (kSwizzled ? 1024 : 0);
  // kDnBlocksPerSM blocks in an SM's 228 KB, with their static arrays and the 1 KB the driver reserves
  static_assert(kDnBlocksPerSM * (kBytes + 4096) <= 228 * 1024, "the dense UA blocks do not fit an SM");
  // byte offset of 16-byte vector `vec` of row `row` in a key or value tile
  __device__ static unsigned tile_offset(int row, int vec) {
    if constexpr (kSwizzled)
      return ptx::sw128_offset(kDnEntries, row, vec);
    else
      return unsigned((row * kKPitch + vec * 8) * 2);
  }
};
// The dynamic shared memory a launch of dense_prefill_tc_kernel<Set, kD> takes (head dims that are not a
// multiple of 64 have only the mma.sync path).
template <int kD>
constexpr std::size_t dense_shared_bytes() {
  if constexpr (kD % 64 == 0)
    return ptx::shared_bytes_of_either_path(UaDenseLayout<kD, true>::kBytes, UaDenseLayout<kD>::kBytes);
  else
    return UaDenseLayout<kD>::kBytes;
}

// log1p(-m) for m in [0, 1 - 1e-6]: u = 1 - m and c = (1 - u) - m, the rounding of u (exact, Fast2Sum: 1 - u
// is exact for u in [1/2, 1], and u itself below 1/2, where c = 0), then log1p(-m) = log(u) + log(1 + c / u)
// with log(u) = ln 2 lg2.approx(u) and log(1 + c / u) as c (off by c (1 - u) / u + O(c^2), below 2^-25:
// |c| <= 2^-25 where it is not 0). lg2.approx's error is absolute, 2^-22.6: the result is within 1.4e-7 of
// log1p(-m) (absolute; relative only where |A| is above about 0.1) and at most 0; a tiny m (u = 1) gives
// -m exactly. What it feeds is the λ carry, a sum of A whose own rounding is ulp(λ) / 2 per row, 1.2e-7
// once |λ| reaches 2: an absolute error of 1.4e-7 per A is of that order, and moves a softmax weight by
// 1.4e-7 relative per row of decay, far below the rounding of the probabilities to bf16 (2^-9) before P V.
// 5 instructions a pair (three adds, lg2, one fused multiply-add, and the clamp) instead of 25 (the range
// reduction and the atanh series of a relatively accurate log1p): the decay fold is the largest part of a
// step's arithmetic.
inline constexpr double kDnDecayAbsError = 1.4e-7;  // |dense_log1m(m) - log1p(-m)| at most (absolute)
__device__ inline float dense_log1m(float m) {
  const float u = 1.0f - m;
  const float c = (1.0f - u) - m;
  return fminf(fmaf(0.693147180559945309f, ptx::lg2_approx_ftz(u), c), 0.0f);
}

// log2 sigmoid(z) = -log2(1 + 2^t), t = -z log2 e, as -(max(t, 0) + log2(1 + 2^-|t|)) (no overflow) with
// ex2 and lg2.approx: lg2's error is absolute, 2^-22.6 (its argument is in [1, 2]), the size of the error of
// log2 c in the fold below, so x moves by at most 1.1e-7 relative, as there; ex2's 2 ulp of 2^-|t| add
// below 2^-22 to the result. A few instructions per entry of a tile instead of expf and log1pf (the key
// gate of every entry, every entry tile, in every row tile). z = +inf gives 0, z = -inf gives -inf.
__device__ inline float dense_log2_sigmoid(float z) {
  const float t = -kLog2eFloat * z;
  return -(fmaxf(t, 0.0f) + ptx::lg2_approx_ftz(1.0f + ptx::ex2_approx_ftz(-fabsf(t))));
}

// The base-2 fold of a set whose gates are all built in (see the top of the file). kLog2 is false for a
// set with any other gate: the kernel then calls the shared fold per pair.
template <class G>
inline constexpr bool kDnBuiltinGate = std::is_same_v<G, decay::QueryGate> || std::is_same_v<G, decay::KeyGate> ||
                                       std::is_same_v<G, decay::SimilarityGate>;
template <class Set>
struct DenseFold {
  static constexpr bool kLog2 = false;
};
template <class... G>
struct DenseFold<decay::Set<G...>> {
  static constexpr bool kLog2 = (kDnBuiltinGate<G> && ...);
  static constexpr int kSize = int(sizeof...(G));
  static constexpr int kSim = (int(std::is_same_v<G, decay::SimilarityGate>) + ...);
  // log2 of the geometric mean's factors: ln g_q of each QueryGate (scaled by log2 e), log2 g_k of each
  // KeyGate (dense_log2_sigmoid), 2 log2 c of each SimilarityGate, over |set|
  static constexpr float kQueryScale = float((int(std::is_same_v<G, decay::QueryGate>) + ...) * kLog2e / kSize);
  static constexpr float kKeyShare = float((int(std::is_same_v<G, decay::KeyGate>) + ...)) / kSize;
  static constexpr float kSimScale = float(2.0 * kSim / kSize);

  // A_jm from the pair's similarity and its scaled gate terms query_log2 + key_log2 (spec 4.1). log2 c
  // comes from lg2.approx, whose error is absolute (2^-22.6, the hardware reduces the range): log2 c only
  // enters x through 2^(log2 x), so that is a relative error of at most 1.1e-7 in x, the size of the
  // rounding of log2 x itself and below ex2.approx's own 2 ulp. ex2 flushes results below 2^-126 to 0
  // (exp2f differs only there, by three more instructions a pair): A then moves by less than 2^-126.
  // lg2 flushes similarities below 2^-126 to 0 (log2 -> -inf, x -> 0, A -> 0): such a similarity has x
  // below 2^-84 (2^(-126 * 2 n_sim / |set|)), so A moves by less than 2^-84.
  // relu(c)^2 = 0 -> x = 0 -> A = 0 exactly: the similarity is clamped at 0 before lg2 (log2 0 = -inf, so
  // x = 2^-inf = 0, u = 1, c = 0, lg2 1 = 0: A = 0 exactly, also for a NaN similarity, as fmaxf drops it);
  // one max a pair instead of a compare and a select after the log1p.
  // log1p to within 1.4e-7 absolute (dense_log1m).
  __device__ static float decay(float similarity, float gate_log2) {
    float log2_x = gate_log2;
    if constexpr (kSim > 0) {
      log2_x = fmaf(kSimScale, ptx::lg2_approx_ftz(fmaxf(similarity, 0.0f)), log2_x);
    }
    return dense_log1m(fminf(ptx::ex2_approx_ftz(log2_x), 1.0f - float(decay::kClampEps)));
  }
};

// The softmax weights are 2^x by ptx::ex2_approx_ftz, results below 2^-126 flushed to 0: next to the row
// maximum's weight 1 such a weight is below fp32's resolution (and a warp's half tile below it is skipped, see
// step 3). Logits this far (in log2 units) below the row maximum have weight exactly 0.
inline constexpr float kDnUnderflowLog2 = -127.0f;

// sm_90a: a call whose longest row tile sees more than this many entry tiles (rows past 8K) runs the kernel
// with the skip body by default (UaCacheLimits::dense_skip_past_after_tiles). The skip's code costs time on
// every step, where it fires or not, and pays back only where most of a row tile's steps are past the
// decay's reach, which on the benchmark's inputs holds from rows past 8K on.
inline constexpr int kDnSkipPastAfterTiles = 128;

// Row tiles of each item in flight when UaCacheLimits::dense_item_group is 0 (automatic): the items of a
// group share the resident blocks, kDnBlocksPerSM an SM. Consecutive row tiles of an item then start about
// 1 / kDnRowTilesInFlight of a row tile's walk apart, a few entry tiles at 8K, so the keys and values one
// reads are still in L2 for the next, rather than read again from DRAM. With all items in one group (on an
// H200 at B8 G4: 396 resident blocks, 32 items, 12 row tiles of an item in flight) most of those reads miss
// L2; about 32 row tiles of an item in flight keep most of them in it.
inline constexpr int kDnRowTilesInFlight = 32;

// The item group of a launch over `items` items: `limit` items (UaCacheLimits::dense_item_group) or, for 0,
// the resident blocks of `sm_count` multiprocessors over kDnRowTilesInFlight.
inline std::int64_t dense_item_group_for(int limit, int sm_count, std::int64_t items) {
  const std::int64_t automatic = std::int64_t(kDnBlocksPerSM) * sm_count / kDnRowTilesInFlight;
  const std::int64_t group = limit > 0 ? limit : automatic;
  return group < 1 ? 1 : group > items ? items : group;
}

#if KVMEM_GPU_VENDOR_PATHS  // mma.sync / wgmma tiles: NVIDIA only
// The work of one block of dense_prefill_tc_kernel (below): row tile *s_ticket / items of item
// *s_ticket % items, kRows = dense_row_tile(r) rows, a compile-time constant so that the decay tile's
// shape, the pair -> (head, row) map and the λ carry unroll. kSkipPast (sm_90a, wgmma path only): the body
// that skips the value tile and P V of the steps predicted past the decay's reach, a separate instantiation
// so that the calls without it run none of its code (the host picks the kernel per call by its longest row
// tile).
template <class Set, int kD, int kRows, bool kSkipPast>
__device__ __forceinline__ void dense_prefill_row_tile(const DeviceCache<bf16>& c, const DeviceCall<bf16>& a,
                                                       std::int64_t T, std::int64_t items, std::int64_t tiles,
                                                       int* sync, const long long* s_ticket,
                                                       unsigned char* dense_smem) {
  using namespace ptx;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kWg = kD % 64 == 0;  // step 3 on warpgroup MMA (the block's 4 warps are one warpgroup)
#else
  constexpr bool kWg = false;
#endif
  static_assert(kWg || !kSkipPast, "the skip past the decay's reach is a path of the wgmma body only");
  using L = UaDenseLayout<kD, kWg>;
  using Fold = DenseFold<Set>;
  using nv_bf16 = __nv_bfloat16;
  constexpr int kVec = kD / 8;  // 16-byte vectors per row
  constexpr int rt = kRows;
  static_assert(rt % 8 == 0 && rt <= kDnMaxRows, "a row tile splits into 8-row mma tiles");
  unsigned char* const smem = kWg ? align_shared_1024(dense_smem) : dense_smem;
  unsigned char* const ks_base = smem + L::kK;  // key and value tiles: bytes, rows at L::tile_offset
  unsigned char* const vs_base = smem + L::kV;
  nv_bf16* nk = reinterpret_cast<nv_bf16*>(smem + L::kNK);
  float* at = reinterpret_cast<float*>(smem + L::kA);  // [entry][row]: A
  float* lt = reinterpret_cast<float*>(smem + L::kL);  // [row][entry]: Λ
  // row tile: query-side gate (the scaled log2 term of the base-2 fold; else the logit and its log part)
  __shared__ float s_rgate[kDnMaxRows], s_rpart[kDnMaxRows];
  // entry tile: key-side gate (as for rows), positions, and the first row after each entry's position
  __shared__ float s_egate[kDnEntries], s_epart[kDnEntries];
  __shared__ long long s_epos[kDnEntries];
  __shared__ int s_efirst[kDnEntries];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, qr = lane / 4, t4 = lane % 4;
  const std::int64_t k = *s_ticket / items, item = *s_ticket % items;
  const std::int64_t r = c.r, b = item / c.G, g = item % c.G, D = kD;
  // the dense prefill runs on caches whose items own their pages (pool_pages = 0: contiguous rows)
  const std::int64_t n = c.length[item], first = c.counter[item], row0 = item * c.stride;
  const std::int64_t r0 = k * rt;
  const int nr = T - r0 < rt ? int(T - r0) : rt;  // rows of this tile
  const std::int64_t row_pos0 = first + r0;       // position of the tile's first row
  // entry indices of the item as int (fewer registers live through the loop): an item's rows fit in
  // device memory, so fewer than 2^31 of them
  const int e_total = int(n + r0 + nr);  // entries the tile's rows see: the cache, then call rows < r0 + nr
  const int e_prev = int(n + r0);        // entries before the tile's own rows (λ from row tile k - 1)
  float* const lambda = c.lambda + row0;
  // λ hand-off words of the item's entries (dense_sync_bytes); this row tile reads the tag k, writes k + 1
  std::uint64_t* const handoff = reinterpret_cast<std::uint64_t*>(sync + 2) + row0;
  const bool has_prev = k > 0, has_next = k + 1 < tiles;
  const nv_bf16* in_k = reinterpret_cast<const nv_bf16*>(a.k + b * a.k_b + g * a.k_g);
  const nv_bf16* in_v = reinterpret_cast<const nv_bf16*>(a.v + b * a.v_b + g * a.v_g);
  const nv_bf16* cache_k = reinterpret_cast<const nv_bf16*>(c.keys + row0 * D);
  const nv_bf16* cache_v = reinterpret_cast<const nv_bf16*>(c.values + row0 * D);

  // the row tile's keys (decay similarity) and query-side gates; its rows are appended to the cache at
  // rows n + t (nothing is evicted), which no block of this call reads (call keys come from the input)
  for (int x = tid; x < kDnMaxRows * kVec; x += kDnThreads) {
    const int i = x / kVec, cv = x % kVec;
    uint4 kv = make_uint4(0, 0, 0, 0);
    if (i < nr) {
      const std::int64_t t = r0 + i;
      kv = reinterpret_cast<const uint4*>(in_k + t * a.k_t)[cv];
      const uint4 vv = reinterpret_cast<const uint4*>(in_v + t * a.v_t)[cv];
      reinterpret_cast<uint4*>(c.keys + (row0 + n + t) * D)[cv] = kv;
      reinterpret_cast<uint4*>(c.values + (row0 + n + t) * D)[cv] = vv;
    }
    *reinterpret_cast<uint4*>(nk + i * L::kKPitch + cv * 8) = kv;
  }
  for (int i = tid; i < kDnMaxRows; i += kDnThreads) {
    float zq = 0.0f;
    if (i < nr) {
      const std::int64_t t = r0 + i;
      zq = a.z_q[b * a.zq_b + g * a.zq_g + t * a.zq_t];
      c.key_logit[row0 + n + t] = a.z_k[b * a.zk_b + g * a.zk_g + t * a.zk_t];
      c.pos[row0 + n + t] = first + t;
    }
    const float part = kernel::ua::query_gate_part(zq);
    if constexpr (Fold::kLog2) {
      s_rgate[i] = Fold::kQueryScale * part;
    } else {
      s_rgate[i] = zq;
      s_rpart[i] = part;
    }
  }

  // this warp's 16 (head, row) pairs: pair p -> head p / rt, row p % rt; the lane holds pairs qr, qr + 8
  const int p_lo = 16 * warp + qr, p_hi = p_lo + 8;
  const int h_lo = p_lo / rt, i_lo = p_lo % rt, h_hi = p_hi / rt, i_hi = p_hi % rt;
  const bool live_lo = i_lo < nr, live_hi = i_hi < nr;
  std::uint32_t qf[kD / 16][4];  // Q as mma A fragments, for the whole block (mma.sync; wgmma reads Q from smem)
  if constexpr (!kWg) {
    const nv_bf16* q_lo = reinterpret_cast<const nv_bf16*>(a.q + b * a.q_b + (g * r + h_lo) * a.q_h +
                                                           (r0 + (live_lo ? i_lo : 0)) * a.q_t);
    const nv_bf16* q_hi = reinterpret_cast<const nv_bf16*>(a.q + b * a.q_b + (g * r + h_hi) * a.q_h +
                                                           (r0 + (live_hi ? i_hi : 0)) * a.q_t);
#pragma unroll
    for (int kb = 0; kb < kD / 16; ++kb) {
      const int col = 16 * kb + 2 * t4;
      qf[kb][0] = live_lo ? *reinterpret_cast<const std::uint32_t*>(q_lo + col) : 0u;
      qf[kb][1] = live_hi ? *reinterpret_cast<const std::uint32_t*>(q_hi + col) : 0u;
      qf[kb][2] = live_lo ? *reinterpret_cast<const std::uint32_t*>(q_lo + col + 8) : 0u;
      qf[kb][3] = live_hi ? *reinterpret_cast<const std::uint32_t*>(q_hi + col + 8) : 0u;
    }
  }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // wgmma reads Q (the A operand of the logits) from shared memory: the block's 64 pairs as rows, zeros
  // past the call (published to the tensor cores by the first step's proxy fence and barrier)
  if constexpr (kWg) {
    for (int x = tid; x < kDnPairs * kVec; x += kDnThreads) {
      const int p = x / kVec, cv = x % kVec, hp = p / rt, ip = p % rt;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (ip < nr)
        v = *reinterpret_cast<const uint4*>(a.q + b * a.q_b + (g * r + hp) * a.q_h + (r0 + ip) * a.q_t + 8 * cv);
      *reinterpret_cast<uint4*>(smem + L::kQ + sw128_offset(kDnPairs, p, cv)) = v;
    }
  }
#endif
  float o[kD / 8][4];
#pragma unroll
  for (int j = 0; j < kD / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m_lo = negative_infinity<float>(), m_hi = negative_infinity<float>(), l_lo = 0.0f, l_hi = 0.0f;

  // rows [e0, e0 + kDnEntries) of the keys or the values -> tile dst (cached rows below n, then the call's
  // input rows; zeros past e_total), one cp.async group
  const auto load_rows = [&](int e0, unsigned char* dst, const nv_bf16* cache, const nv_bf16* input,
                             std::int64_t in_stride) {
    const bool all_cached = e0 + kDnEntries <= n, all_input = e0 >= n && e0 + kDnEntries <= e_total;
    if (all_cached || all_input) {  // the usual tile: every row valid, in one array with one row stride
      const std::int64_t stride = all_cached ? D : in_stride;
      if constexpr (kDnThreads % kVec == 0) {
        // a fixed row and 16-byte column per thread and pass: the addresses step by a constant, a few
        // instructions per copy instead of a division and a 64-bit product
        constexpr int kPassRows = kDnThreads / kVec;
        static_assert(kPassRows % 8 == 0, "a pass of rows keeps the swizzle phase (row % 8)");
        const int e = tid / kVec, cv = tid % kVec;
        const nv_bf16* src = (all_cached ? cache + e0 * D : input + (e0 - n) * in_stride) + e * stride + cv * 8;
        unsigned char* to = dst + L::tile_offset(e, cv);
#pragma unroll
        for (int pass = 0; pass < kDnEntries / kPassRows; ++pass)
          cp_async16(to + pass * kPassRows * L::kRowBytes, src + pass * kPassRows * stride, 16);
      } else {
        const nv_bf16* p = all_cached ? cache + e0 * D : input + (e0 - n) * in_stride;
#pragma unroll 1
        for (int x = tid; x < kDnEntries * kVec; x += kDnThreads) {
          const int e = x / kVec, cv = x % kVec;
          cp_async16(dst + L::tile_offset(e, cv), p + e * stride + cv * 8, 16);
        }
      }
    } else {
      // a tile across the cache / input boundary or past the rows, a few per row tile: kept a loop (unrolled,
      // its copies for the value and the key tile would make the step's code larger than the instruction
      // cache serves well)
#pragma unroll 1
      for (int x = tid; x < kDnEntries * kVec; x += kDnThreads) {
        const int e = x / kVec, cv = x % kVec;
        const int idx = e0 + e;
        const bool valid = idx < e_total;
        const nv_bf16* p = input;  // any valid address when nothing is copied
        if (valid) p = idx < n ? cache + idx * D : input + (idx - n) * in_stride;
        cp_async16(dst + L::tile_offset(e, cv), p + cv * 8, valid ? 16 : 0);
      }
    }
    cp_async_commit();
  };

  // this warp's piece of the decay tile: entries eb + {qr, qr + 8}, rows 8 * nt + 2 * t4 + {0, 1}, nt < nts;
  // lane eb + l (l < 16) then carries λ of entry eb + l down all rt rows
  constexpr int nts = rt / 8;
  const int eb = 16 * warp;
  const bool carrier = lane < 16;
  const int ce = eb + lane;  // the carrier's entry in the tile
  // key-gate logit and position of entry e0 + tid (positions past e_total: INT64_MAX, masked). Threads
  // tid < kDnEntries load them one entry tile ahead (the latency hides behind a whole step) and publish
  // them, with the key-gate term, in shared memory for the decay and the carry of the tile: computed once
  // per entry, by one thread each (a second thread per entry for the positions would add registers).
  const float* const key_logit = c.key_logit + row0;
  const std::int64_t* const key_pos = c.pos + row0;
  const float* const in_zk = a.z_k + b * a.zk_b + g * a.zk_g;
  const auto load_meta = [&](int e0, float& logit, std::int64_t& pos) {
    const int idx = e0 + tid;
    logit = 0.0f;
    pos = INT64_MAX;
    if (idx < e_total) {
      logit = idx < n ? key_logit[idx] : in_zk[(idx - n) * a.zk_t];
      pos = idx < n ? key_pos[idx] : first + (idx - n);
    }
  };
  // logits Λ + Q K^T for the warp's 16 pairs and the 32 entries c0.. of key tile ks, in fp32 accumulators
  // that start from Λ: the tensor cores add it (inside their fp32 accumulation, where S + Λ rounded S
  // first), so no add per logit waits on the end of the mma chain.
  constexpr int kJ = 32 / 8;                                    // 8-entry accumulator tiles per half tile
  const float* const lam_lo = lt + i_lo * L::kLPitch + 2 * t4;  // Λ of the lane's rows, entries 2 t4 + {0, 1}
  const float* const lam_hi = lt + i_hi * L::kLPitch + 2 * t4;
  const auto logits = [&](float(&s)[kJ][4], const unsigned char* ks, int c0) {
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      const float2 lo = *reinterpret_cast<const float2*>(lam_lo + c0 + 8 * j);
      const float2 hi = *reinterpret_cast<const float2*>(lam_hi + c0 + 8 * j);
      s[j][0] = lo.x;
      s[j][1] = lo.y;
      s[j][2] = hi.x;
      s[j][3] = hi.y;
    }
#pragma unroll
    for (int kb = 0; kb < kD / 16; ++kb) {
#pragma unroll
      for (int jp = 0; jp < kJ / 2; ++jp) {
        std::uint32_t fb[4];
        ldmatrix_x4(fb, ks + L::tile_offset(c0 + 16 * jp + 8 * (lane / 16) + lane % 8, 2 * kb + (lane / 8) % 2));
        mma_bf16_16816(s[2 * jp], qf[kb], fb[0], fb[1]);
        mma_bf16_16816(s[2 * jp + 1], qf[kb], fb[2], fb[3]);
      }
    }
  };
  // The online softmax of logits s (kN 8-entry tiles, rows p_lo and p_hi): raises the running maxima and
  // turns s into the weights 2^(x log2 e - max log2 e), rescaling l and O only when a maximum of the warp
  // moved (otherwise every factor is exp2(rounding error of m log2e) = 1 exactly, or 0 on a row whose O and
  // l are still 0). Returns false, touching nothing, when every weight of the warp would be 0 (its largest
  // logit per row far below the row's maximum, which then did not move): s adds exact zeros to l and O.
  const auto online_softmax = [&]<int kN>(float(&s)[kN][4]) -> bool {
    float mx_lo = negative_infinity<float>(), mx_hi = negative_infinity<float>();
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      mx_lo = fmaxf(mx_lo, fmaxf(s[j][0], s[j][1]));
      mx_hi = fmaxf(mx_hi, fmaxf(s[j][2], s[j][3]));
    }
    mx_lo = fmaxf(mx_lo, warp_shfl_xor(mx_lo, 1));
    mx_lo = fmaxf(mx_lo, warp_shfl_xor(mx_lo, 2));
    mx_hi = fmaxf(mx_hi, warp_shfl_xor(mx_hi, 1));
    mx_hi = fmaxf(mx_hi, warp_shfl_xor(mx_hi, 2));
    const float new_lo = fmaxf(m_lo, mx_lo), new_hi = fmaxf(m_hi, mx_hi);
    // a row with every logit masked so far keeps max -inf: subtract 0 instead (every weight is 0)
    const float base_lo = new_lo == negative_infinity<float>() ? 0.0f : new_lo * kLog2eFloat;
    const float base_hi = new_hi == negative_infinity<float>() ? 0.0f : new_hi * kLog2eFloat;
    if (!warp_any(fmaf(mx_lo, kLog2eFloat, -base_lo) >= kDnUnderflowLog2 ||
                  fmaf(mx_hi, kLog2eFloat, -base_hi) >= kDnUnderflowLog2))
      return false;
    if (warp_any(new_lo != m_lo || new_hi != m_hi)) {
      const float scale_lo = ptx::ex2_approx_ftz(fmaf(m_lo, kLog2eFloat, -base_lo));
      const float scale_hi = ptx::ex2_approx_ftz(fmaf(m_hi, kLog2eFloat, -base_hi));
      l_lo *= scale_lo;
      l_hi *= scale_hi;
#pragma unroll
      for (int j = 0; j < kD / 8; ++j) {
        o[j][0] *= scale_lo;
        o[j][1] *= scale_lo;
        o[j][2] *= scale_hi;
        o[j][3] *= scale_hi;
      }
    }
    m_lo = new_lo;
    m_hi = new_hi;
#pragma unroll
    for (int j = 0; j < kN; ++j) {
      s[j][0] = ptx::ex2_approx_ftz(fmaf(s[j][0], kLog2eFloat, -base_lo));
      s[j][1] = ptx::ex2_approx_ftz(fmaf(s[j][1], kLog2eFloat, -base_lo));
      s[j][2] = ptx::ex2_approx_ftz(fmaf(s[j][2], kLog2eFloat, -base_hi));
      s[j][3] = ptx::ex2_approx_ftz(fmaf(s[j][3], kLog2eFloat, -base_hi));
    }
    return true;
  };
  // k-step kk of P V takes the weights of entries 16 kk.. (accumulator tiles 2 kk and 2 kk + 1 of s): their
  // sums per row, in the order both paths add them to l, and their bf16 A fragment
  const auto kstep_sums = []<int kN>(const float(&s)[kN][4], int kk) {
    return float2{(s[2 * kk][0] + s[2 * kk][1]) + (s[2 * kk + 1][0] + s[2 * kk + 1][1]),
                  (s[2 * kk][2] + s[2 * kk][3]) + (s[2 * kk + 1][2] + s[2 * kk + 1][3])};
  };
  const auto kstep_fragment = []<int kN>(const float(&s)[kN][4], int kk, std::uint32_t(&pa)[4]) {
    pa[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
    pa[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
    pa[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pa[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  };
  // the tiles this thread copied with cp.async (generic proxy) -> visible to wgmma's reads of them (async
  // proxy) once the next barrier has passed
  const auto copies_to_tensor_cores = [] {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (kWg) fence_proxy_async_shared();
#endif
  };
  // sm_90a: P V of a step (wgmma, P from these registers) stays in flight into the next step, through its
  // gates, metadata and λ acquire, up to barrier 1, after which the value tile is overwritten; its
  // accumulators O are next touched after barrier 2. finish_pv waits for it (a no-op with none in flight)
  // and keeps P's registers untouched until then.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  std::uint32_t pv_a[kDnEntries / 16][4] = {};
#endif
  const auto finish_pv = [&] {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (kWg) {
      wgmma_wait<0>();
      wgmma_fence_operands(o);
      wgmma_fence_operands(pv_a);
    }
#endif
  };
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // O += P V of the value tile in vs_base, P from pv_a (every warp of the warpgroup issues it): m64nDk16 with
  // P from registers and the value tile read MN-major (k16 slice kk: rows 16 kk.., column blocks of 64
  // values kDnEntries rows apart). Waited for by finish_pv.
  [[maybe_unused]] const auto issue_pv = [&] {
    if constexpr (kWg) {
      wgmma_fence();
      const unsigned vs_addr = shared_address(vs_base);
#pragma unroll
      for (int kk = 0; kk < kDnEntries / 16; ++kk) {
        const std::uint64_t vdesc = wgmma_desc_sw128(vs_addr + unsigned(16 * kk) * 128, kDnEntries * 128, 1024);
        if constexpr (kD == 128)
          wgmma_m64n128k16_rs_mn(o, pv_a[kk], vdesc);
        else
          wgmma_m64n64k16_rs_mn(o, pv_a[kk], vdesc);
      }
      wgmma_commit();
    }
  };
  // sm_90a, the skip body (kSkipPast): the steps past the decay's reach skip their value tile and P V. With
  // the newest entries first,
  // once every weight of the block has underflowed at a step, the next (older) entries are almost always past
  // the reach too: a step after such a step does not load its value tile and issues no P V (predicted at
  // barrier 1 from the warps' outcomes of the previous step). Kept in registers to the next step, a
  // mispredicting warp's P would be live through the decay fold and spill; so such a warp parks
  // its P fragment in the value buffer, which a skipped step leaves unused (slot p_slot, 16 bytes a lane and
  // k-step: 8 KB for the block), and at the next barrier 1 the block takes it back, loads the skipped value
  // tile and runs that P V before the step goes on: before any later rescale of O, so every result bit is
  // the one of the unskipped order (the same wgmma sequence on O).
  // s_past[t % kPastRing][w]: warp w's weights all underflowed at step t (written by its lane 0 after barrier 2
  // of step t, read after barrier 1 of the two steps that follow, and after the loop): the flags live in
  // shared memory, not in registers, which the decay fold uses up. The prediction looks at the last step
  // alone: waiting for two all-past steps would skip less.
  constexpr int kPastRing = 4;
  [[maybe_unused]] __shared__ __align__(16) int s_past[kPastRing][kDnWarps];
  if constexpr (kSkipPast) {
    // steps before the first: not past
    if (tid < kPastRing * kDnWarps) s_past[tid / kDnWarps][tid % kDnWarps] = 0;  // before step 0's barrier 1
  }
  // every warp's weights underflowed at step t
  [[maybe_unused]] const auto block_past_at = [&](int t) {
    const int4 f = *reinterpret_cast<const int4*>(s_past[t & (kPastRing - 1)]);
    return (f.x & f.y & f.z & f.w) != 0;
  };
  // step t skips its value tile and P V: the block was past at the step before it
  [[maybe_unused]] const auto skips_pv = [&](int t) { return block_past_at(t - 1); };
  static_assert(kDnWarps * (kDnEntries / 16) * 32 * sizeof(uint4) <= L::kTile, "a block's P fits the value buffer");
  [[maybe_unused]] uint4* const p_slot = reinterpret_cast<uint4*>(vs_base) + warp * (kDnEntries / 16) * 32 + lane;
  // P V of step t, skipped though a warp had weights there (called after a barrier that follows step t's
  // softmax), in two parts around the load of its value tile: take_back_p puts every warp's P of step t
  // back in pv_a (0 for a warp past the reach), run_deferred_pv issues P V once the tile has landed and
  // waits for it. The loop has one load of a value tile for both (a second call site would spill).
  [[maybe_unused]] const auto take_back_p = [&](int t) {
    if constexpr (kWg) {
      const bool warp_past = s_past[t & (kPastRing - 1)][warp] != 0;
#pragma unroll
      for (int kk = 0; kk < kDnEntries / 16; ++kk) {
        const uint4 parked = warp_past ? make_uint4(0u, 0u, 0u, 0u) : p_slot[32 * kk];
        pv_a[kk][0] = parked.x;
        pv_a[kk][1] = parked.y;
        pv_a[kk][2] = parked.z;
        pv_a[kk][3] = parked.w;
      }
      __syncthreads();  // every warp holds its P again: the value tile may take the buffer
    }
  };
  [[maybe_unused]] const auto run_deferred_pv = [&] {
    if constexpr (kWg) {
      cp_async_wait<0>();
      copies_to_tensor_cores();
      __syncthreads();  // the value tile in shared memory
      issue_pv();
      finish_pv();
      __syncthreads();  // every warp's P V has read the value tile, which the step's own value tile replaces
    }
  };
#endif
  // entry tiles newest first: step s handles entry tile n_etiles - 1 - s, keys in buffer s & 1
  const int n_etiles = (e_total + kDnEntries - 1) / kDnEntries;
  float nx_logit = 0.0f;
  std::int64_t nx_pos = INT64_MAX;
  load_rows((n_etiles - 1) * kDnEntries, ks_base, cache_k, in_k, a.k_t);
  if (tid < kDnEntries) load_meta((n_etiles - 1) * kDnEntries, nx_logit, nx_pos);
  for (int step = 0; step < n_etiles; ++step) {
    const int et = n_etiles - 1 - step, e0 = et * kDnEntries;
    const int buf = int(step & 1);
    cp_async_wait<0>();  // this thread's part of key tile et (and of the last value tile) has landed
    copies_to_tensor_cores();
    if (tid < kDnEntries) {
      if constexpr (Fold::kLog2) {
        s_egate[tid] = Fold::kKeyShare * dense_log2_sigmoid(nx_logit);
      } else {
        s_egate[tid] = nx_logit;
        s_epart[tid] = kernel::ua::key_gate_part(nx_logit);
      }
      s_epos[tid] = nx_pos;
      // first row m > pos_e of the tile (every row for cached entries, none for entries past the range)
      const std::int64_t first_after = nx_pos == INT64_MAX ? rt : nx_pos - row_pos0 + 1;
      s_efirst[tid] = first_after < 0 ? 0 : (first_after > rt ? rt : int(first_after));
      if (et > 0) load_meta(e0 - kDnEntries, nx_logit, nx_pos);
    }
    std::uint64_t c_word = 0;  // the carrier's incoming λ (loaded after barrier 1, below)
    finish_pv();
    // key tile et and its gates are in shared memory (the first time, nk and the row gates too); every
    // warp is past step - 1, so the value tile, the other key buffer and the Λ tile are free
    __syncthreads();
    // value tile et: lands during the decay and the carry. sm_90a: none on a step predicted past the reach;
    // first, the previous step's tile and P V when that step skipped them but a warp had weights there
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (kSkipPast) {
      const bool skip_pv = skips_pv(step);
      bool pv_deferred = !skip_pv && skips_pv(step - 1);  // (then a warp had weights at step - 1)
      if (pv_deferred) take_back_p(step - 1);
      for (int v_e0 = pv_deferred ? e0 + kDnEntries : e0;; v_e0 = e0) {
        if (!skip_pv) load_rows(v_e0, vs_base, cache_v, in_v, a.v_t);
        if (!pv_deferred) break;
        run_deferred_pv();
        pv_deferred = false;
      }
    } else
#endif
    {
      load_rows(e0, vs_base, cache_v, in_v, a.v_t);
    }
    if constexpr (!kWg) {  // the next key tile into the other buffer (sm_90a: one buffer, after barrier 2)
      if (et > 0) {
        load_rows(e0 - kDnEntries, ks_base + (buf ^ 1) * L::kTile, cache_k, in_k, a.k_t);
      } else {
        cp_async_commit();  // an empty group: the wait for the value tile below counts one group behind it
      }
    }
    const unsigned char* ks = ks_base + (kWg ? 0 : buf * L::kTile);
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    // sm_90a: Q K^T of the whole key tile as warpgroup MMA (m64n64k16, the block's 4 warps together), issued
    // now so that the tensor cores run it during the decay and the carry (it needs only the key tile; Λ is
    // added once the carry is done, step 3). Q and the key tile from swizzled shared memory, both K-major:
    // k16 slice kb is 32 bytes into the rows of column block kb / 4.
    float s_tile[kDnEntries / 8][4] = {};
    if constexpr (kWg) {
      wgmma_fence();
#pragma unroll
      for (int kb = 0; kb < kD / 16; ++kb)
        wgmma_m64n64k16_ss(s_tile,
                           wgmma_desc_sw128(shared_address(smem + L::kQ) + sw128_k16_offset(kDnPairs, kb), 16, 1024),
                           wgmma_desc_sw128(shared_address(ks) + sw128_k16_offset(kDnEntries, kb), 16, 1024), 1);
      wgmma_commit();
    }
#endif
    // the carrier's incoming λ, loaded now so that the L2 latency overlaps the decay below (its tag is
    // checked at the carry). λ of an entry before row r0: row tile 0 reads the cache's λ (from the calls
    // before), a later row tile the hand-off word of the previous one (tag k), rarely not yet there: the
    // predecessor started earlier and walks the same tiles in the same order, the newest first. An entry
    // of this tile's own rows starts at λ = 0 (the word then stays 0, tag 0). Loaded here rather than before
    // barrier 1 (the word is fresher, so fewer reloads at the carry) or at the carry (its latency exposed).
    // The mma.sync path loads it at the carry: held through its fold, the word's two registers would make
    // ptxas spill at D 80.
    if (kWg && carrier && e0 + ce < e_prev)
      c_word =
          has_prev ? load_relaxed_gpu(handoff + e0 + ce) : std::uint64_t(__float_as_uint(__ldcg(lambda + e0 + ce)));

    // 1. this warp's 16 columns of the decay tile A(e, m) (spec 4.1): similarity K NK^T on the tensor
    //    cores, then the set's gate fold; A = 0 where m <= pos_e and on rows past the call (the carry then
    //    leaves λ unchanged there)
    {
      float e_gate[2], e_part[2];
      std::int64_t e_pos[2];
      int e_first[2];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        e_gate[hf] = s_egate[eb + qr + 8 * hf];
        e_first[hf] = s_efirst[eb + qr + 8 * hf];
        if constexpr (!Fold::kLog2) {
          e_part[hf] = s_epart[eb + qr + 8 * hf];
          e_pos[hf] = s_epos[eb + qr + 8 * hf];
        }
      }
      float sim[nts][4] = {};
      if constexpr (Set::kNeedsSimilarity) {
#pragma unroll
        for (int kb = 0; kb < kD / 16; ++kb) {
          std::uint32_t fa[4];
          ldmatrix_x4(fa, ks + L::tile_offset(eb + lane % 16, 2 * kb + lane / 16));
          // the row tile's keys as B fragments: two 8-row tiles per ldmatrix_x4 (lanes 16-31 address the
          // second), one x2 for an odd last one
#pragma unroll
          for (int nt = 0; nt + 1 < nts; nt += 2) {
            std::uint32_t fb[4];
            ldmatrix_x4(fb, nk + (8 * (nt + lane / 16) + lane % 8) * L::kKPitch + 16 * kb + 8 * ((lane / 8) % 2));
            mma_bf16_16816(sim[nt], fa, fb[0], fb[1]);
            mma_bf16_16816(sim[nt + 1], fa, fb[2], fb[3]);
          }
          if constexpr (nts % 2) {
            std::uint32_t b0, b1;
            ldmatrix_x2(b0, b1, nk + (8 * (nts - 1) + lane % 8) * L::kKPitch + 16 * kb + 8 * ((lane / 8) % 2));
            mma_bf16_16816(sim[nts - 1], fa, b0, b1);
          }
        }
      }
      // the fold, one body for every tile, the usual one (every entry before the tile's rows, no rows past
      // the call) included, where the select keeps every value: a second body without the select would make
      // the step's code larger.
      // The lane's two rows of an accumulator tile are adjacent in the entry's row of A: one 8-byte store.
#pragma unroll
      for (int nt = 0; nt < nts; ++nt) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int i0 = 8 * nt + 2 * t4, e = eb + qr + 8 * hf;
          float a_em[2];
#pragma unroll
          for (int x = 0; x < 2; ++x) {
            const int i = i0 + x;
            if constexpr (Fold::kLog2) {
              a_em[x] = Fold::decay(sim[nt][2 * hf + x], s_rgate[i] + e_gate[hf]);
            } else {
              a_em[x] = kernel::ua::decay_from_similarity<Set, float>(sim[nt][2 * hf + x], e_gate[hf], e_part[hf],
                                                                      e_pos[hf], s_rgate[i], s_rpart[i], row_pos0 + i);
            }
            // evaluated for every element and then selected (entries past the range have no rows after
            // them: A = 0); rows past the call get A = 0 too
            a_em[x] = (i >= e_first[hf] && i < nr) ? a_em[x] : 0.0f;
          }
          *reinterpret_cast<float2*>(at + e * L::kAPitch + i0) = make_float2(a_em[0], a_em[1]);
        }
      }
    }
    warp_sync();  // the warp's columns of the A tile are complete

    // 2. carry λ down the rows (spec 4.2: increasing m, one rounding per step): lane l < 16 of the warp
    //    that folded the column, entry eb + l, so no block barrier stands between the fold and the carry.
    //    lt[] receives Λ_{m, e} (-inf before the entry's position); λ goes to the next row tile in the
    //    entry's hand-off word, from the last row tile to the cache row of the entry (a call key's row n + t
    //    is its row after this call).
    if (carrier) {
      const int idx = e0 + ce;
      if (!kWg && idx < e_prev)
        c_word = has_prev ? load_relaxed_gpu(handoff + idx) : std::uint64_t(__float_as_uint(__ldcg(lambda + idx)));
      if (has_prev && idx < e_prev) {  // the predecessor's word: wait for its tag
        while (std::int64_t(c_word >> 32) != k) {
          __nanosleep(32);
          c_word = load_relaxed_gpu(handoff + idx);
        }
      }
      float c_lam = __uint_as_float(std::uint32_t(c_word));
      // a pruned prefill's chunk start (spec 4.5, DeviceCall::prune_tiles): an entry before the tile whose λ
      // at the previous chunk's end is below ln p is evicted. Its Λ is -inf from here on (-inf plus any A
      // stays -inf: weight 0, and every row still sees its own key, so no row's maximum is -inf once its
      // walk is done); the last row tile stores -inf as its λ, a dead row, which the compaction after the
      // launch drops. The test is the one of every backend (kernel::ua::evicts, in double).
      if (has_prev && idx < e_prev && a.prune_tiles > 0 && int(k) % a.prune_tiles == 0 &&
          kernel::ua::evicts(c_lam, a.log_p))
        c_lam = negative_infinity<float>();
      const float4* col = reinterpret_cast<const float4*>(at + ce * L::kAPitch);
      float* lam_col = lt + ce;  // the entry's column of the Λ tile, rows kLPitch apart
      // rows i < masked get Λ = -inf (they precede the entry), the others the running λ
      const auto carry = [&](int masked) {
        float av[rt];  // the column's rt values, loaded together before the dependent adds
#pragma unroll
        for (int v = 0; v < rt / 4; ++v) *reinterpret_cast<float4*>(av + 4 * v) = col[v];
        float lam = c_lam;
#pragma unroll
        for (int i = 0; i < rt; ++i) {
          lam += av[i];
          lam_col[i * L::kLPitch] = i < masked ? negative_infinity<float>() : lam;
        }
        if (has_next)
          store_relaxed_gpu(handoff + idx, dense_lambda_word(lam, k + 1));
        else
          lambda[idx] = lam;
      };
      if (e0 + kDnEntries <= e_prev) {
        // the usual tile: every entry precedes the tile's rows, so no row is masked; the constant 0 lets
        // the compiler drop the per-row select
        carry(0);
      } else if (idx < e_total) {
        // rows i < masked precede the entry (an entry of the range lies at row s_efirst - 1 of the tile or
        // before it); A = 0 up to its own row, so λ stays 0 there
        carry(s_efirst[ce] > 0 ? s_efirst[ce] - 1 : 0);
      } else {
#pragma unroll
        for (int i = 0; i < rt; ++i) lam_col[i * L::kLPitch] = negative_infinity<float>();
      }
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (kWg) {
      // the logits are done: they were the last reads of the key buffer, which the next key tile takes after
      // the barrier (it lands during step 3; the other two blocks of the SM cover what it does not). The
      // value tile is waited for just before P V, at the end of step 3.
      wgmma_wait<0>();
      wgmma_fence_operands(s_tile);
    } else {
      cp_async_wait<1>();
    }
#else
    cp_async_wait<1>();  // this thread's part of value tile et has landed (the next key tile may not)
#endif
    __syncthreads();      // Λ tile complete (mma.sync: and value tile et in shared memory)
    if constexpr (kWg) {  // the next key tile, into the one key buffer (the last step: an empty group, so that
                          // the value tile's group is always the one before the newest)
      if (et > 0)
        load_rows(e0 - kDnEntries, ks_base, cache_k, in_k, a.k_t);
      else
        cp_async_commit();
    }

    // 3. per half of the tile (32 entries: 16 S registers instead of 32 keep the block at <= 168
    //    registers, three blocks per SM; one half at a time keeps the compiler from holding both): logits
    //    = Λ + S (scale 1), online softmax in registers (rows p_lo, p_hi; the quad holds a row), O += P V.
    //    No skip of a half's logits where Λ + |q| |k| (Cauchy-Schwarz) bounds them below the underflow: it
    //    would cost every step and rarely fire before the test after the logits below, as the bound takes
    //    the slowest-decaying of 32 entries and |q| |k|, far above the largest q.k.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (kWg) {
      // sm_90a: the whole tile at once. logits = fl(Q K^T) + Λ: the products' accumulation is done before
      // Λ is known, so Λ is added after it (one more fp32 rounding per logit than on mma.sync, where the
      // accumulators start from Λ; the probabilities are rounded to bf16 after it anyway). O += P V as
      // m64nDk16 with P from registers and the value tile read MN-major (k16 slice kk: rows 16 kk..,
      // column blocks of 64 values kDnEntries rows apart). No ldmatrix -> mma chains: a warp issues 8 + 4
      // instructions per tile for the two products instead of 128 mma and 64 ldmatrix.
      float(&s)[kDnEntries / 8][4] = s_tile;
#pragma unroll
      for (int j = 0; j < kDnEntries / 8; ++j) {
        const float2 lo = *reinterpret_cast<const float2*>(lam_lo + 8 * j);
        const float2 hi = *reinterpret_cast<const float2*>(lam_hi + 8 * j);
        s[j][0] += lo.x;
        s[j][1] += lo.y;
        s[j][2] += hi.x;
        s[j][3] += hi.y;
      }
      // every warp takes part in P V (one instruction of the warpgroup): a warp whose weights all
      // underflow gives P = 0, which adds exact zeros to l and O as the skip on mma.sync leaves them
      // (P = 0 is set directly, without the sums of l, which would add exact zeros, and the packs: with the
      // newest entries first, most steps of a long row tile are past the decay's reach, 64 instructions a
      // warp fewer on each)
      std::uint32_t(&pa)[kDnEntries / 16][4] = pv_a;
      const bool warp_past = !online_softmax(s);
      bool skipped = false;  // this step's value tile and P V (the skip body only)
      if constexpr (kSkipPast) {
        if (lane == 0) s_past[step & (kPastRing - 1)][warp] = int(warp_past);
        skipped = skips_pv(step);
      }
      if (!warp_past) {
#pragma unroll
        for (int kk = 0; kk < kDnEntries / 16; ++kk) {
          const float2 part = kstep_sums(s, kk);
          l_lo += part.x;
          l_hi += part.y;
          kstep_fragment(s, kk, pa[kk]);
          // mispredicted: P parked for the deferred P V in the value buffer, unused on a skipped step
          if (kSkipPast && skipped) p_slot[32 * kk] = make_uint4(pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3]);
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < kDnEntries / 16; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
      }
      if (!skipped) {
        // value tile et, loaded after barrier 1, waited for only now: the softmax gave it time to land (at
        // barrier 2 its wait would be exposed). wgmma is issued by the whole warpgroup together, so the
        // barrier costs little more than the issue.
        cp_async_wait<1>();  // this thread's part of it (the next key tile, one group newer, may not have)
        copies_to_tensor_cores();
        __syncthreads();  // every thread's part, visible to the tensor cores
        issue_pv();       // waited for before the next step's barrier 1 (finish_pv)
      }
    } else
#endif
#pragma unroll 1
      for (int hv = 0; hv < kDnEntries / 32; ++hv) {
        const int c0 = 32 * hv;  // the half's first entry in the tile
        float s[kJ][4];
        logits(s, ks, c0);
        if (!online_softmax(s)) continue;
          // O += P V: the S accumulators of entries 16 kk.. are the A fragment of k-step kk. A step whose
          // probabilities are all 0 for the warp adds exact zeros: skipped.
#pragma unroll
        for (int kk = 0; kk < kJ / 2; ++kk) {
          const float2 part = kstep_sums(s, kk);
          l_lo += part.x;
          l_hi += part.y;
          if (!warp_any(part.x + part.y > 0.0f)) continue;
          std::uint32_t pa[4];
          kstep_fragment(s, kk, pa);
#pragma unroll
          for (int dp = 0; dp < kD / 16; ++dp) {
            std::uint32_t fb[4];
            ldmatrix_x4_trans(
                fb, vs_base + L::tile_offset(c0 + 16 * kk + 8 * ((lane / 8) % 2) + lane % 8, 2 * dp + lane / 16));
            mma_bf16_16816(o[2 * dp], pa, fb[0], fb[1]);
            mma_bf16_16816(o[2 * dp + 1], pa, fb[2], fb[3]);
          }
        }
      }
  }

  finish_pv();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kSkipPast) {
    __syncthreads();  // every warp's flag of the last step
    if (skips_pv(n_etiles - 1) && !block_past_at(n_etiles - 1)) {
      take_back_p(n_etiles - 1);
      load_rows(0, vs_base, cache_v, in_v, a.v_t);
      run_deferred_pv();
    }
  }
#endif

  // 4. normalise, output gate, write y and lse (the quad's partial sums in a fixed order). The row's
  //    indices come again from the ticket in shared memory (a volatile load, so the compiler does not
  //    hold them in registers through the loop, where O leaves few to spare)
  l_lo += warp_shfl_xor(l_lo, 1);
  l_lo += warp_shfl_xor(l_lo, 2);
  l_hi += warp_shfl_xor(l_hi, 1);
  l_hi += warp_shfl_xor(l_hi, 2);
  const std::int64_t ticket = *static_cast<const volatile long long*>(s_ticket);
  const std::int64_t out_item = ticket % items, out_r0 = ticket / items * rt;
  const std::int64_t out_b = out_item / c.G, out_g = out_item % c.G;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int p = 16 * warp + qr + 8 * hf;  // the pair p_lo or p_hi
    const std::int64_t hq = out_g * c.r + p / rt, t = out_r0 + p % rt;
    if (t >= T) continue;  // a row past the call
    const float l = hf ? l_hi : l_lo, mx = hf ? m_hi : m_lo;
    float* out = a.out + out_b * a.o_b + t * a.o_t + hq * a.o_h;
    const bf16* zo = a.z_o ? a.z_o + out_b * a.zo_b + t * a.zo_t + hq * a.zo_h : nullptr;
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        const int d = 8 * j + 2 * t4 + x;
        float y = l > 0.0f ? o[j][2 * hf + x] / l : 0.0f;
        if (zo) y *= sigmoid(ld(zo + d));
        out[d] = y;
      }
    }
    if (a.lse && t4 == 0)
      a.lse[out_b * a.l_b + hq * a.l_h + t * a.l_t] = l > 0.0f ? mx + logf(l) : negative_infinity<float>();
  }
}

// grid (row tiles * I), block kDnThreads, dynamic smem dense_shared_bytes<kD>(). T rows of the call (all
// of them: input rows 0..T-1, positions counter + 0 ...). sync: dense_sync_bytes(I, cap), zero on entry in
// the ticket and in the hand-off words of every item's rows below n + T; group: the item group
// (dense_item_group_for). Appends the call's rows to the cache (rows n + t) and leaves λ_j = Λ_{T-1, j} for
// every entry (a pruned launch: -inf for the entries masked at its chunk starts, dead rows that the
// compaction after it drops with those below ln p at its end); the lengths and counters advance afterwards
// (dense_advance_kernel). kSkipPast (sm_90a, D a multiple of 64; ignored elsewhere): every row tile runs the body with
// the skip past the decay's reach. Both bodies give the same result bits. Chosen per launch, not per block: with both
// bodies in one kernel and each block picking one by its row tile's entry tiles, ptxas spills (D = 128; each
// body alone does not); the row tiles of an item must share one
// launch (the λ pipeline and the tickets).
template <class Set, int kD, bool kSkipPast>
__global__ void __launch_bounds__(kDnThreads, kDnBlocksPerSM)
    dense_prefill_tc_kernel(DeviceCache<bf16> c, DeviceCall<bf16> a, std::int64_t T, std::int64_t items,
                            std::int64_t tiles, std::int64_t group, int* sync) {
  extern __shared__ __align__(128) unsigned char dense_smem[];
  // the block's row tile k of item i as the ticket k * items + i, which the row tile splits again (computing
  // the tile there made ptxas spill)
  __shared__ long long s_ticket;
  if (threadIdx.x == 0) {
    const DenseTicketTile t = dense_ticket_tile(atomicAdd(sync, 1), items, tiles, group);
    s_ticket = t.k * items + t.item;
  }
  __syncthreads();
  // a sequence that found its slot flagged (batch_reserve_kernel) runs no row tile: nothing waits on it
  if (a.slot_go != nullptr && a.slot_go[(s_ticket % items) / c.G] == 0) return;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kSkip = kSkipPast && kD % 64 == 0;  // the wgmma body (kWg of dense_prefill_row_tile)
#else
  constexpr bool kSkip = false;
#endif
  if (c.r == 4)
    dense_prefill_row_tile<Set, kD, dense_row_tile(4), kSkip>(c, a, T, items, tiles, sync, &s_ticket, dense_smem);
  else  // r == 8 (tc_group_ok)
    dense_prefill_row_tile<Set, kD, dense_row_tile(8), kSkip>(c, a, T, items, tiles, sync, &s_ticket, dense_smem);
}
#endif  // KVMEM_GPU_VENDOR_PATHS

// grid 1, after dense_prefill_tc_kernel: every item that ran (go) holds its T new rows, its counter
// advances by T (own pages: publishing counts the pages).
template <class S>
__global__ void dense_advance_kernel(DeviceCache<S> c, std::int64_t items, std::int64_t T, const int* go) {
  for (std::int64_t i = threadIdx.x; i < items; i += blockDim.x) {
    if (go != nullptr && go[i / c.G] == 0) continue;
    c.length[i] += T;
    c.counter[i] += T;
  }
}

}  // namespace kvmem::cuda::ua_detail
