// SPDX-License-Identifier: Apache-2.0
#pragma once
// Universal Attention CUDA kernels (spec UA.md 4). Included by backend/cuda/ua.cuh; not a public API.
//
// One operation is a few launches per chunk of query rows (prefill) or per token (decode):
//   chunk_attend_kernel (chunk_attend_tc_kernel for bf16 on the tensor cores, ua_attend_tc.cuh) /
//   decode_attend_kernel   grid (splits, B*G): each block takes a contiguous,
//       ascending range of the entries of one (sequence, kv head) item -- its cached keys followed by
//       the call's own keys -- builds the decay on the fly (A from the similarity of the entry's key
//       and each row's key, through the decay::Set body of kernel/ua_decay.hpp), carries λ along the
//       rows in increasing position (spec 4.2: one rounding per step, the order of every backend),
//       writes each entry's λ back, and leaves one online-softmax partial (max, sum, accumulator) per
//       (query head, row) of its range;
//   merge_kernel    grid (rows, B*G): merges the partials of the splits in split order (deterministic:
//       no float atomics), applies the output gate, writes the output and lse;
//   finish_kernel   grid (B*G): evicts every entry its item's cut removes (λ < ln p, or a prune rule's cut
//       computed before it, ua_prune.cuh) and compacts the survivors stably in place, appends the
//       surviving new keys, and advances the item's position counter.
// A decode step is one launch. An item with at most kOneBlockMaxKept rows in use (the device reads the
// true length) is decoded by one block that updates λ, evicts, compacts, appends and attends in one
// pass; a longer one splits its rows over the blocks (decode_split_rows, decode_split), which mark the rows
// they evict dead in place, or, when the step's first kernel gave the item fresh pages (a shared pool, a
// page's worth of dead rows), write every live row to its place there; the last split of the item to
// finish (an integer ticket) merges the partials and appends the new row, after swapping the pages
// (finish_move) or compacting the item in place when compacts_in_place says so. All three decode paths
// take a row's λ update and eviction from update_row.
// No L x L matrix exists anywhere: λ is one float per entry, the decay lives in a tile of shared
// memory for the duration of one (entry tile, row tile) step.
// A slot step (ua::step, DeviceCall::row_slot set) runs the same kernels over rows instead of
// sequences: step_begin_kernel checks the rows and decides which run; decode_attend_kernel over
// (row, kv head) runs the 1-token rows and zeroes the output of rows that do not run; the chunk, merge
// and finish kernels run the listed prefill rows, each on its own slot's cache item and tokens.

#include "kvmem/backend/cuda/vendor.cuh"

#include <climits>
#include <cstdint>
#include <type_traits>

#include "kvmem/backend/cuda/ptx.cuh"
#include "kvmem/backend/cuda/slot_lists.cuh"
#include "kvmem/core/math.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/softmax.hpp"
#include "kvmem/kernel/ua_decay.hpp"
#include "kvmem/kernel/ua_evict.hpp"
#include "kvmem/kernel/ua_rows.hpp"

namespace kvmem::cuda::ua_detail {

// The page pool's bookkeeping in device memory (ua/cache.hpp's layout, DESIGN.md 3). The free list is
// a stack of page numbers below a free count; kernels take pages (pop) and return them (push) with
// atomics on that count, never both in the same phase of the same launch: the first kernel of a step
// takes every page the step needs (reserve_slot; after a barrier it returns the pages of slots that found
// the pool dry), the later kernels only return pages. A pop takes a whole range [free - k, free) with one
// compare-and-swap, all or nothing, so a failed request changes nothing; a push claims its range
// [free, free + k) with one atomic add and then writes the page numbers, which only a later launch
// reads. The counters (free, taken, returned) are copied into a small host-mapped block at the end of
// every operation but a fixed-batch decode over items that own their pages (publish_kernel, or the last
// block of a step's last kernel: UaCache's occupancy reads).
struct DevicePool {
  std::int32_t* table = nullptr;         // [I, pages_per_item] logical page -> pool page; nullptr: own pages
  std::int64_t* held = nullptr;          // [I] pages each item holds
  std::int32_t* free_list = nullptr;     // [pages] a stack: free pages at [0, free count)
  std::int64_t* stats = nullptr;         // free count, pages taken, pages returned
  std::int64_t* mirror = nullptr;        // host-mapped copy of stats (device pointer), or nullptr
  const std::int64_t* length = nullptr;  // [items] rows in use (DeviceCache::length): publishing of own pages
  const std::int64_t* dead = nullptr;    // [items] dead rows among them (DeviceCache::dead)
  // Shared pools: the pages a decode step takes to move an item's live rows into (reserve_slot): their
  // numbers, in logical order, in the item's spare table (shaped like `table`), and their count, which
  // is nonzero only between the step's first kernel and the end of its decode (finish_move).
  std::int32_t* spare = nullptr;  // [I, pages_per_item]
  std::int64_t* fresh = nullptr;  // [I]
  std::int64_t items = 0;
  std::int64_t pages_per_item = 0;
  int shift = 0;  // log2(page_rows)

  __device__ std::int64_t pages_for(std::int64_t rows) const {
    return (rows + (std::int64_t(1) << shift) - 1) >> shift;
  }
};

__device__ inline unsigned long long* pool_word(const DevicePool& p, int i) {
  return reinterpret_cast<unsigned long long*>(p.stats + i);
}
// Takes k free pages, all or none: true with the range [first, first + k) of the free list, false (the
// pool unchanged) when fewer than k are free. `count`: the free count to take from, the pool's word
// (nullptr) or a block's shared-memory copy of it (hold_free_count).
__device__ inline bool pop_pages(const DevicePool& p, std::int64_t k, std::int64_t& first,
                                 unsigned long long* count = nullptr) {
  if (k <= 0) {
    first = 0;
    return true;
  }
  if (count == nullptr) count = pool_word(p, 0);
  unsigned long long old = *static_cast<volatile unsigned long long*>(count);
  for (;;) {
    if (old < static_cast<unsigned long long>(k)) return false;
    const unsigned long long seen = atomicCAS(count, old, old - static_cast<unsigned long long>(k));
    if (seen == old) break;
    old = seen;
  }
  atomicAdd(pool_word(p, 1), static_cast<unsigned long long>(k));
  first = std::int64_t(old) - k;
  return true;
}
// A kernel of one block that alone takes pages from the pool while it runs (step_begin_kernel,
// batch_reserve_kernel) takes them from a shared-memory copy of the free count (pop_pages' `count`), so
// that its threads' compare-and-swap retries cost a shared-memory round trip, not an L2 one:
// hold_free_count on every thread before the takers, release_free_count after them and before any page
// goes back.
__device__ inline void hold_free_count(const DevicePool& p, unsigned long long& held) {
  if (threadIdx.x == 0) held = *static_cast<volatile unsigned long long*>(pool_word(p, 0));
  __syncthreads();
}
__device__ inline void release_free_count(const DevicePool& p, const unsigned long long& held) {
  __syncthreads();
  if (threadIdx.x == 0) *static_cast<volatile unsigned long long*>(pool_word(p, 0)) = held;
  __syncthreads();
}
// Gives `item` the logical pages [held, need) from a popped range, taking its entries from the top
// (`next` counts down from first + k, the host's order). Counts only when items own their pages.
__device__ inline void assign_pages(const DevicePool& p, std::int64_t item, std::int64_t need, std::int64_t& next) {
  std::int64_t held = p.held[item];
  if (held >= need) return;
  if (p.table != nullptr)
    for (std::int64_t j = held; j < need; ++j) p.table[item * p.pages_per_item + j] = p.free_list[--next];
  p.held[item] = need;
}
// Returns the pages of `item` past its first `rows` rows to the free list (eviction, reset, overflow).
// Only in a phase that takes no pages (see DevicePool).
__device__ inline void return_pages(const DevicePool& p, std::int64_t item, std::int64_t rows) {
  const std::int64_t keep = p.pages_for(rows), held = p.held[item];
  if (held <= keep) return;
  const std::int64_t k = held - keep;
  const std::int64_t at = std::int64_t(atomicAdd(pool_word(p, 0), static_cast<unsigned long long>(k)));
  if (p.table != nullptr)
    for (std::int64_t j = 0; j < k; ++j) p.free_list[at + j] = p.table[item * p.pages_per_item + held - 1 - j];
  atomicAdd(pool_word(p, 2), static_cast<unsigned long long>(k));
  p.held[item] = keep;
}
// One thread: the pages of `rows` rows for `item` (pops and assigns); false (nothing taken) when dry.
__device__ inline bool take_pages(const DevicePool& p, std::int64_t item, std::int64_t rows) {
  const std::int64_t need = p.pages_for(rows), held = p.held[item];
  std::int64_t first = 0;
  if (held >= need) return true;
  if (!pop_pages(p, need - held, first)) return false;
  std::int64_t next = first + (need - held);
  assign_pages(p, item, need, next);
  return true;
}
// The pool counters into the host-mapped block (one thread, after every page move of the operation).
__device__ inline void publish_counts(const DevicePool& p) {
  if (p.mirror == nullptr) return;
  volatile std::int64_t* m = p.mirror;
  const volatile std::int64_t* st = p.stats;
  m[0] = st[0];
  m[1] = st[1];
  m[2] = st[2];
}
// Items that own their pages (pool_pages = 0) cannot run dry and no page number ever moves, so no kernel
// of a fixed-batch call or a step keeps their page counts: publishing does, from the kept counts. Every
// item's held count becomes the pages of its kept rows (length - dead), and the net growth and shrink
// since the last publishing point go into the taken and returned counts (free = pages - Σ held stays
// exact). Runs on the calling block's threads (whole warps), after every kernel of the operation that
// changes a length; then thread 0 copies the counters into the host-mapped block. Shared pools only
// copy.
__device__ inline void publish_block(const DevicePool& p) {
  __shared__ unsigned long long grew, shrank;
  if (p.table == nullptr && p.length != nullptr) {
    if (threadIdx.x == 0) grew = shrank = 0;
    __syncthreads();
    unsigned long long up = 0, down = 0;
    for (std::int64_t i = threadIdx.x; i < p.items; i += blockDim.x) {
      // ld.global.cg: other blocks of the launch may have written them (publish_if_last)
      const std::int64_t kept = load_cg(p.length + i) - load_cg(p.dead + i), need = p.pages_for(kept);
      const std::int64_t held = p.held[i];
      if (need > held) up += static_cast<unsigned long long>(need - held);
      if (need < held) down += static_cast<unsigned long long>(held - need);
      p.held[i] = need;
    }
    if (up != 0) atomicAdd(&grew, up);
    if (down != 0) atomicAdd(&shrank, down);
    __syncthreads();
    if (threadIdx.x == 0) {  // reductions at the L2, as every other page move (the free count wraps)
      atomicAdd(pool_word(p, 0), shrank - grew);
      atomicAdd(pool_word(p, 1), grew);
      atomicAdd(pool_word(p, 2), shrank);
      __threadfence();
    }
  }
  if (threadIdx.x == 0) publish_counts(p);
}
inline constexpr int kPublishThreads = 256;
// grid 1, block kPublishThreads, after an operation's kernels. (A template, so that translation units
// that all include this header link.)
template <class = void>
__global__ void __launch_bounds__(kPublishThreads) publish_kernel(DevicePool p) {
  publish_block(p);
}
// The last of `expected` callers of a launch (an integer ticket, reset for the next launch) publishes: a
// step's last kernel does it instead of a launch of publish_kernel. Each caller is a whole block that
// calls it once, after every page move it answers for (finish_kernel: every block; decode_attend_kernel:
// one block per grid item); the ticket is release/acquire ordered.
__device__ inline void publish_if_last(const DevicePool& p, int* ticket, unsigned expected) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(ticket, 1) == int(expected) - 1 ? 1 : 0;
    if (last) __threadfence();
  }
  __syncthreads();
  if (!last) return;
  publish_block(p);
  if (threadIdx.x == 0) *ticket = 0;
}

// The cache in device memory (one item = one (sequence, kv head); rows ascending in position). Rows
// live in the pool: with a shared pool (pool_pages > 0) logical row e of an item sits in pool page
// table[item][e / page_rows] at row e % page_rows (kernel/ua_rows.hpp's map); with pool_pages = 0 item
// i owns the consecutive pages from i * pages_per_item, so its rows are contiguous from i * stride.
template <class S>
struct DeviceCache {
  S* keys = nullptr;                    // pool rows [pages * page_rows, D]
  S* values = nullptr;                  // pool rows [pages * page_rows, D]
  float* lambda = nullptr;              // pool rows: λ_e = Λ_{n-1, pos_e} (log space)
  float* key_logit = nullptr;           // pool rows: z_k of each entry
  std::int64_t* pos = nullptr;          // pool rows: absolute positions
  float* key_scale = nullptr;           // pool rows: a key row's scale (fp8 storage: row = scale * e4m3 row)
  float* value_scale = nullptr;         // pool rows: a value row's scale (fp8); nullptr for other storage
  std::int64_t* length = nullptr;       // [I] rows in use: kept rows, then dead ones awaiting compaction
  std::int64_t* dead = nullptr;         // [I] rows among them marked dead (λ = -inf, see is_dead)
  std::int64_t* counter = nullptr;      // [I] next absolute position (tokens seen by the sequence)
  int* done = nullptr;                  // [I] decode blocks finished this step (the last one resets it to 0)
  std::int64_t* next_length = nullptr;  // [I] a one-block decode step's new length, published by the last block
  std::int64_t* marks = nullptr;        // [I] rows the decode blocks of this step marked dead (0 between steps)
  DevicePool pool;
  std::int64_t stride = 0;    // rows between consecutive items' first rows when the pool is not shared
  std::int64_t capacity = 0;  // most rows one item may hold (CacheShape::capacity)
  std::int64_t D = 0, G = 0, r = 0;

  // Pool row of logical entry e of `item`.
  __device__ std::int64_t row(std::int64_t item, std::int64_t e) const {
    if (pool.table == nullptr) return item * stride + e;
    const std::int64_t page = pool.table[item * pool.pages_per_item + (e >> pool.shift)];
    return (page << pool.shift) | (e & ((std::int64_t(1) << pool.shift) - 1));
  }
};

// A dead row: evicted by a decode step that left it in place (λ = -inf, a value no live λ takes: every
// A is finite, spec 4.1), so later steps skip its key and value and every compaction drops it, at any p.
__device__ inline bool is_dead(float lambda) {
  return lambda == negative_infinity<float>();
}
// The eviction test of every kernel below (spec 4.5, policy/prune.hpp): entry (λ, position) goes under the
// step's cut of its item (item_cut: the threshold ln p, or the prune rule's cut of that item).
// kEvict is the launch's compile-time eviction switch: false for a call whose prune policy never evicts
// (prune::None, ua::detail::NoEvictor), and then the test is not compiled into the kernel at all.
template <bool kEvict>
__device__ inline bool evict_test(const prune::Cut& cut, float lambda, std::int64_t pos) {
  if constexpr (kEvict)
    return kernel::ua::evicts(lambda, pos, cut);
  else
    return (void)cut, (void)lambda, (void)pos, false;
}
// The row leaves the cache at the next compaction: dead, or evicted by the cut.
template <bool kEvict>
__device__ inline bool gone(float lambda, std::int64_t pos, const prune::Cut& cut) {
  return is_dead(lambda) || evict_test<kEvict>(cut, lambda, pos);
}

// One call's inputs (device memory, innermost stride 1) and the scratch of its partials. The inputs
// are in the storage type S, or bf16 for an fp8 cache (input_type_t).
template <class S>
struct DeviceCall {
  using In = input_type_t<S>;
  const In* q = nullptr;  // [B,H,T,D]
  std::int64_t q_b = 0, q_h = 0, q_t = 0;
  const In* k = nullptr;  // [B,G,T,D]
  std::int64_t k_b = 0, k_g = 0, k_t = 0;
  const In* v = nullptr;  // [B,G,T,D]
  std::int64_t v_b = 0, v_g = 0, v_t = 0;
  bool kv_rows16 = false;      // every k and v row starts on a 16-byte boundary (rows_16byte_aligned)
  const float* z_k = nullptr;  // [B,G,T]
  std::int64_t zk_b = 0, zk_g = 0, zk_t = 0;
  const float* z_q = nullptr;  // [B,G,T]
  std::int64_t zq_b = 0, zq_g = 0, zq_t = 0;
  const In* z_o = nullptr;  // [B,T,H,D] or nullptr (no output gate)
  std::int64_t zo_b = 0, zo_t = 0, zo_h = 0;
  float* out = nullptr;  // [B,T,H,D]
  std::int64_t o_b = 0, o_t = 0, o_h = 0;
  float* lse = nullptr;  // [B,H,T] or nullptr
  std::int64_t l_b = 0, l_h = 0, l_t = 0;
  // scratch
  float* part_ml = nullptr;       // [I, splits, r, P, 2] running max and sum of each partial
  float* part_acc = nullptr;      // [I, splits, r, P, D] unnormalised accumulators
  float* lambda_new = nullptr;    // [I, P] λ of the call's own keys at the end of the chunk
  std::int64_t P = 0;             // rows per chunk the scratch is laid out for
  int splits = 1;                 // grid.x of the attend kernel
  std::int64_t tokens = 0;        // fixed batch: the call's tokens per sequence (its last chunk returns spare pages)
  int* publish_ticket = nullptr;  // set on a step's last kernel: its last block publishes (publish_if_last)
  double log_p = 0.0;             // ln p; -inf = never evict
  // The dense tensor-core prefill with a threshold (ua_dense_tc.cuh): row tiles per pruning chunk of the
  // launch (spec 4.5); row tile k > 0 with k % prune_tiles == 0 starts a chunk and masks every entry whose
  // λ it receives below ln p. 0: no masks (p = 0).
  int prune_tiles = 0;
  bool evict_before_attention = true;
  // A prune rule whose cut depends on the item's entries (ua_prune.cuh): cuts[item] replaces log_p, and a
  // decode step's λ already holds A(., t) (decode_cut_kernel added it), so the decode kernels only read it.
  const prune::Cut* cuts = nullptr;  // [I] or nullptr: every item's cut is the threshold log_p
  bool lambda_updated = false;
  // A slot step (ragged rows over packed token-major inputs, DESIGN.md 3): row_slot != nullptr. The
  // grid then runs over (row, kv head) pairs instead of (sequence, kv head) items; the cache item of a
  // row is slot * G + g, and the inputs and outputs are addressed with b = the row's first token and
  // every *_b stride equal to the token stride (so b * x_b + t * x_t is token b + t). Scratch indexed by
  // cache item (partials, lambda_new, tickets) stays valid: a slot appears in at most one row.
  const std::int32_t* row_slot = nullptr;   // [rows] slot of each row, -1 = padding
  const std::int32_t* row_start = nullptr;  // [rows + 1] query_start
  const int* slot_go = nullptr;             // [max_slots] 1: the slot's row runs this step (step_begin_kernel,
                                            // batch_reserve_kernel for a fixed batch)
  const int* step_error = nullptr;          // nonzero: the step's rows were refused, no kernel touches anything
  const int* prefill_rows = nullptr;        // [max_slots] the step's running rows of >= 2 tokens, any order
  const int* prefill_count = nullptr;       // how many prefill_rows hold
};
// Whether the call's new key and value rows copy into cache rows in 16-byte pieces: a cache row (D elements
// of S) is a whole number of pieces and every input row starts on a 16-byte boundary.
template <class S>
__host__ __device__ inline bool new_rows_vec16(const DeviceCall<S>& a, std::int64_t D) {
  return (D * std::int64_t(sizeof(S))) % 16 == 0 && a.kv_rows16;
}

// The cut that evicts from `item` in this step (evict_test); without eviction (kEvict = false) a cut that
// evicts nothing, read from no memory.
template <bool kEvict, class S>
__device__ inline prune::Cut item_cut(const DeviceCall<S>& a, std::int64_t item) {
  prune::Cut cut;
  if constexpr (kEvict) {
    if (a.cuts != nullptr) return a.cuts[item];
    cut.log_p = a.log_p;
  }
  return cut;
}

// What one block of a chunk launch works on: cache item, input base b (see DeviceCall), the chunk's
// first input row t0 within the row, and its row count.
struct ChunkWork {
  std::int64_t item, b, t0, rows;
  bool last;  // the chunk ends the row (or the fixed-batch call): the item's spare pages go back after it
};
// Fixed batch: grid item gi is cache item gi, sequence gi / G, every item has the call's rows. Slot
// step: grid item gi is (prefill_rows[gi / G], kv head gi % G): the rows of at least 2 tokens whose slot
// runs this step (a 1-token row is a decode step, run by decode_attend_kernel), listed by
// step_begin_kernel; a row works while it has tokens at t0, on at most `rows` of them. Every block of a
// (row, kv head) decides alike.
template <class S>
__device__ inline bool chunk_work(const DeviceCache<S>& c, const DeviceCall<S>& a, std::int64_t gi, std::int64_t t0,
                                  std::int64_t rows, ChunkWork& w) {
  if (a.row_slot == nullptr) {
    if (a.slot_go != nullptr && a.slot_go[gi / c.G] == 0) return false;  // its slot found the pool dry
    w = {gi, gi / c.G, t0, rows, t0 + rows >= a.tokens};
    return true;
  }
  if (*a.step_error != 0 || gi / c.G >= *a.prefill_count) return false;
  const std::int64_t row = a.prefill_rows[gi / c.G], g = gi % c.G;
  const int s = a.row_slot[row];
  const std::int64_t x0 = a.row_start[row], n = a.row_start[row + 1] - x0;
  if (t0 >= n) return false;
  w = {s * c.G + g, x0, t0, n - t0 < rows ? n - t0 : rows, t0 + rows >= n};
  return true;
}

inline constexpr int kEntryTile = 64;  // entries staged per step of the chunk kernel
inline constexpr int kChunkThreads = 256;
inline constexpr int kLanesPerPair = 4;  // threads sharing one (query head, row) in the chunk kernel
inline constexpr int kPairs = kChunkThreads / kLanesPerPair;
inline constexpr int kDecodeThreads = 256;

// Entries [begin, end) of split s when `total` entries are split `splits` ways in aligned pieces of at
// least `min_piece` (the merge recomputes the same ranges to know how many partials exist).
struct Range {
  std::int64_t begin, end;
};
__host__ __device__ inline std::int64_t split_piece(std::int64_t total, int splits, std::int64_t min_piece) {
  std::int64_t piece = (total + splits - 1) / splits;
  piece = (piece + min_piece - 1) / min_piece * min_piece;
  return piece > min_piece ? piece : min_piece;
}
__host__ __device__ inline int active_splits(std::int64_t total, int splits, std::int64_t min_piece) {
  const std::int64_t piece = split_piece(total, splits, min_piece);
  return int((total + piece - 1) / piece);
}

// Rows of query heads per chunk-kernel row tile: all r heads of a group share one decay tile.
__host__ __device__ inline int chunk_row_tile(std::int64_t r) {
  return int(r >= kPairs ? 1 : kPairs / r);
}

template <class S>
__device__ inline float ld(const S* p) {
  if constexpr (std::is_same_v<S, e4m3>)
    return ptx::e4m3_to_float(*p);
  else
    return load_as<float>(*p);
}

// The 16 / sizeof(S) elements of a 16-byte vector of S, as floats (fp8: the e4m3 values, unscaled).
template <class S>
__device__ inline void unpack(const uint4& raw, float* out) {
  if constexpr (std::is_same_v<S, e4m3>) {
    ptx::e4m3x4_to_float(raw.x, out);
    ptx::e4m3x4_to_float(raw.y, out + 4);
    ptx::e4m3x4_to_float(raw.z, out + 8);
    ptx::e4m3x4_to_float(raw.w, out + 12);
  } else {
    const S* parts = reinterpret_cast<const S*>(&raw);
#pragma unroll
    for (int k = 0; k < int(16 / sizeof(S)); ++k) out[k] = load_as<float>(parts[k]);
  }
}

// ---- row-scaled storage (fp8 e4m3, core/numeric.hpp): a stored row is scale * e4m3 row ----------
// Stores input row x [D] in S at `out` with the lanes of one warp (all of them call it) and returns the
// row's scale in every lane: the row's largest |x| (a warp reduction), then quantize_row's rounding, so
// a row stored here holds the bits the host's append_entry stores for the same input.
template <class S, class In>
__device__ inline float store_row_warp(const In* x, S* out, std::int64_t D) {
  static_assert(is_row_scaled_v<S>, "store_row_warp stores row-scaled (fp8) rows");
  const int lane = int(threadIdx.x) % kWarpSize;
  float amax = 0.0f;
  for (std::int64_t d = lane; d < D; d += kWarpSize) amax = fmaxf(amax, fabsf(ld(x + d)));
  for (int o = kWarpSize / 2; o > 0; o /= 2) amax = fmaxf(amax, warp_shfl_xor(amax, o));
  const float scale = fp8_row_scale(amax), inverse = fp8_inverse_scale(scale);
  for (std::int64_t d = lane; d < D; d += kWarpSize) out[d] = ptx::to_e4m3(ld(x + d) * inverse);
  return scale;
}
// The scale store_row_warp gives input row x [D], in every lane of the calling warp.
template <class S, class In>
__device__ inline float row_scale_warp(const In* x, std::int64_t D) {
  const int lane = int(threadIdx.x) % kWarpSize;
  float amax = 0.0f;
  for (std::int64_t d = lane; d < D; d += kWarpSize) amax = fmaxf(amax, fabsf(ld(x + d)));
  for (int o = kWarpSize / 2; o > 0; o /= 2) amax = fmaxf(amax, warp_shfl_xor(amax, o));
  return fp8_row_scale(amax);
}
// An input element as an fp8 row of scale `scale` stores it, in units of the scale (the e4m3 value).
__device__ inline float fp8_stored_element(float x, float scale) {
  return ptx::e4m3_to_float(ptx::to_e4m3(x * fp8_inverse_scale(scale)));
}

// ---- pieces both chunk kernels share (this one and chunk_attend_tc_kernel) ---------------------
// The row tile's query-side gate logits and their log-gate parts (the decay's later tokens).
template <class S>
__device__ inline void load_row_gates(const DeviceCall<S>& a, std::int64_t b, std::int64_t g, std::int64_t first_row,
                                      std::int64_t nr, float* r_logit, float* r_part) {
  for (std::int64_t i = threadIdx.x; i < nr; i += blockDim.x) {
    r_logit[i] = a.z_q[b * a.zq_b + g * a.zq_g + (first_row + i) * a.zq_t];
    r_part[i] = kernel::ua::query_gate_part(r_logit[i]);
  }
}

// Key-gate logits, their log parts and positions of entries [e0, e0 + ne) of an item: cached entries
// below n, then the call's own keys (input row t0 + idx - n, position first + idx - n).
template <class S>
__device__ inline void load_entry_meta(const DeviceCache<S>& c, const DeviceCall<S>& a, std::int64_t item,
                                       std::int64_t b, std::int64_t n, std::int64_t t0, std::int64_t first,
                                       std::int64_t e0, std::int64_t ne, float* e_logit, float* e_part,
                                       std::int64_t* e_pos) {
  const std::int64_t g = item % c.G;
  for (std::int64_t e = threadIdx.x; e < ne; e += blockDim.x) {
    const std::int64_t idx = e0 + e;
    e_logit[e] = idx < n ? c.key_logit[c.row(item, idx)] : a.z_k[b * a.zk_b + g * a.zk_g + (t0 + idx - n) * a.zk_t];
    e_part[e] = kernel::ua::key_gate_part(e_logit[e]);
    e_pos[e] = idx < n ? c.pos[c.row(item, idx)] : first + (idx - n);
  }
}

// A(e, m) of an entry tile for a row tile (spec 4.1), the block's threads over (entry, column): the decay
// row m = m0 + i puts on entry e, 0 where m <= pos_e and in the columns i >= nr up to `cols`, written to
// tile[e * pitch + i]. sim(e, i): the similarity of entry e and row i, read only by a set with the
// similarity gate (a tensor-core kernel reads it from the same element, which this thread alone touches).
template <class Set, class Sim>
__device__ inline void decay_tile(float* tile, std::int64_t pitch, std::int64_t ne, std::int64_t cols, std::int64_t nr,
                                  std::int64_t m0, const std::int64_t* e_pos, const float* e_logit, const float* e_part,
                                  const float* r_logit, const float* r_part, Sim sim) {
  for (std::int64_t x = threadIdx.x; x < ne * cols; x += blockDim.x) {
    const std::int64_t e = x / cols, i = x % cols, m = m0 + i;
    float a_em = 0.0f;
    if (i < nr && m > e_pos[e]) {
      float s = 0.0f;
      if constexpr (Set::kNeedsSimilarity) s = sim(e, i);
      a_em =
          kernel::ua::decay_from_similarity<Set, float>(s, e_logit[e], e_part[e], e_pos[e], r_logit[i], r_part[i], m);
    }
    tile[e * pitch + i] = a_em;
  }
}

// Λ along the rows in increasing m (spec 4.2), one thread per entry: tile[e * pitch + i] holds A(e, m_i)
// on entry and Λ_{m_i, pos_e} (-inf before the entry's position) on exit, for rows m_i = first + r0 + i,
// i < nr. λ persists in global memory between row tiles: the cache's λ for cached entries, the call's
// lambda_new for its own keys (this block is the only one that touches these entries).
template <class S>
__device__ inline void carry_lambda(const DeviceCache<S>& c, const DeviceCall<S>& a, std::int64_t item, std::int64_t n,
                                    std::int64_t first, std::int64_t r0, std::int64_t nr, std::int64_t e0,
                                    std::int64_t ne, const std::int64_t* e_pos, float* tile, std::int64_t pitch) {
  for (std::int64_t e = threadIdx.x; e < ne; e += blockDim.x) {
    const std::int64_t idx = e0 + e, p = e_pos[e];
    float* lam_at = idx < n ? c.lambda + c.row(item, idx) : a.lambda_new + item * a.P + (idx - n);
    // a call key at or after this row tile's first row has no decay yet (Λ_pp = 0); its entry tile
    // may have been skipped entirely by earlier row tiles, so its slot is not read
    float lam = (idx >= n && idx - n >= r0) ? 0.0f : *lam_at;
    for (std::int64_t i = 0; i < nr; ++i) {
      const std::int64_t m = first + r0 + i;
      if (m < p) {
        tile[e * pitch + i] = negative_infinity<float>();
        continue;
      }
      if (m > p) lam += tile[e * pitch + i];
      tile[e * pitch + i] = lam;
    }
    *lam_at = lam;
  }
}

// ---- prefill / forward: one chunk of `rows` query rows (calls positions counter + t0 ...) --------
// grid (splits, I), block kChunkThreads, dynamic smem chunk_smem_bytes(D, r, is_row_scaled_v<S>).
// kDpt: dims per lane (>= ceil(D / kLanesPerPair)); lane l owns dims l, l + 4, l + 8, ...
__host__ __device__ inline std::size_t chunk_smem_bytes(std::int64_t D, std::int64_t r, bool row_scales = false) {
  const std::int64_t rt = chunk_row_tile(r);
  return sizeof(float) * std::size_t(2 * kEntryTile * (D + 1)    // keys, values of the entry tile
                                     + rt * (D + 1)              // the row tile's keys (decay similarity)
                                     + kEntryTile * rt           // decay, then bias tile
                                     + kPairs * kEntryTile       // logits of every (head, row)
                                     + 2 * kEntryTile + 2 * rt)  // entry key logits/parts, row gate logits/parts
         + sizeof(std::int64_t) * kEntryTile                     // entry positions
         + (row_scales ? sizeof(float) * 2 * kEntryTile : 0);    // entry key and value scales (fp8 storage)
}

// The entry tile of the chunk kernel for an fp8 cache, as float rows: a cached row's stored values (its
// e4m3 elements times its scale), and a call key's or value's as finish_item will store its row at the
// chunk end, so the chunk attends to what the cache holds, as the host's chunk does (it appends the
// chunk's rows before attending). scale: [2 * kEntryTile] (key scales, then value scales).
template <class S>
__device__ inline void stage_fp8_entries(const DeviceCache<S>& c, const DeviceCall<S>& a, std::int64_t item,
                                         std::int64_t b, std::int64_t n, std::int64_t t0, std::int64_t e0,
                                         std::int64_t ne, float* ks, float* vs, std::int64_t pitch, float* scale) {
  const std::int64_t D = c.D, g = item % c.G;
  const int lane = int(threadIdx.x) % kWarpSize, warps = int(blockDim.x) / kWarpSize;
  for (std::int64_t e = threadIdx.x / kWarpSize; e < ne; e += warps) {  // a warp per entry
    const std::int64_t idx = e0 + e;
    float sk, sv;
    if (idx < n) {
      const std::int64_t row = c.row(item, idx);
      sk = c.key_scale[row];
      sv = c.value_scale[row];
    } else {
      sk = row_scale_warp<S>(a.k + b * a.k_b + g * a.k_g + (t0 + idx - n) * a.k_t, D);
      sv = row_scale_warp<S>(a.v + b * a.v_b + g * a.v_g + (t0 + idx - n) * a.v_t, D);
    }
    if (lane == 0) {
      scale[e] = sk;
      scale[kEntryTile + e] = sv;
    }
  }
  __syncthreads();
  for (std::int64_t x = threadIdx.x; x < ne * D; x += blockDim.x) {
    const std::int64_t e = x / D, d = x % D, idx = e0 + e;
    const float sk = scale[e], sv = scale[kEntryTile + e];
    if (idx < n) {
      const std::int64_t row = c.row(item, idx);
      ks[e * pitch + d] = ld(c.keys + row * D + d) * sk;
      vs[e * pitch + d] = ld(c.values + row * D + d) * sv;
    } else {
      const float k = ld(a.k + b * a.k_b + g * a.k_g + (t0 + idx - n) * a.k_t + d);
      const float v = ld(a.v + b * a.v_b + g * a.v_g + (t0 + idx - n) * a.v_t + d);
      ks[e * pitch + d] = fp8_stored_element(k, sk) * sk;
      vs[e * pitch + d] = fp8_stored_element(v, sv) * sv;
    }
  }
}

template <class Set, class S, int kDpt>
__global__ void __launch_bounds__(kChunkThreads)
    chunk_attend_kernel(DeviceCache<S> c, DeviceCall<S> a, std::int64_t call_t0, std::int64_t call_rows) {
  extern __shared__ __align__(128) unsigned char smem_raw[];  // one symbol in ua_detail: as ua_attend_tc.cuh
  ChunkWork w;
  if (!chunk_work(c, a, blockIdx.y, call_t0, call_rows, w)) return;
  const std::int64_t D = c.D, r = c.r, item = w.item, b = w.b, g = item % c.G, t0 = w.t0, rows = w.rows;
  const int rt = chunk_row_tile(r);
  const std::int64_t pitch = D + 1;  // odd pitch: entry rows read by different lanes fall in different banks
  float* ks = reinterpret_cast<float*>(smem_raw);
  float* vs = ks + kEntryTile * pitch;
  float* nk = vs + kEntryTile * pitch;
  float* tile = nk + rt * pitch;           // [kEntryTile][rt]: A, then Λ
  float* logits = tile + kEntryTile * rt;  // [kPairs][kEntryTile]
  float* e_logit = logits + kPairs * kEntryTile;
  float* e_part = e_logit + kEntryTile;
  float* r_logit = e_part + kEntryTile;
  float* r_part = r_logit + rt;
  std::int64_t* e_pos = reinterpret_cast<std::int64_t*>(r_part + rt);
  float* e_scale = reinterpret_cast<float*>(e_pos + kEntryTile);  // fp8 storage: the tile's row scales

  const std::int64_t n = c.length[item], total = n + rows;
  const std::int64_t piece = split_piece(total, a.splits, kEntryTile);
  const std::int64_t e_begin = blockIdx.x * piece;
  if (e_begin >= total) return;
  const std::int64_t e_end = e_begin + piece < total ? e_begin + piece : total;
  const std::int64_t first = c.counter[item];  // absolute position of the chunk's row 0 (input row t0)

  const int tid = threadIdx.x, pair = tid / kLanesPerPair, lane = tid % kLanesPerPair;
  const int head = pair / rt, prow = pair % rt;
  const bool pair_live = head < r;

  for (std::int64_t r0 = 0; r0 < rows; r0 += rt) {
    const std::int64_t nr = rows - r0 < rt ? rows - r0 : rt;
    const std::int64_t m_last = first + r0 + nr - 1;
    const bool row_live = pair_live && prow < nr;
    // the row tile's keys and query-side gates (the decay's later tokens)
    for (std::int64_t x = tid; x < nr * D; x += blockDim.x) {
      const std::int64_t i = x / D, d = x % D;
      nk[i * pitch + d] = ld(a.k + b * a.k_b + g * a.k_g + (t0 + r0 + i) * a.k_t + d);
    }
    load_row_gates(a, b, g, t0 + r0, nr, r_logit, r_part);
    float q[kDpt], acc[kDpt];
    OnlineSoftmax<float> sm;
    const std::int64_t h_abs = g * r + head;
    for (int x = 0; x < kDpt; ++x) {
      const std::int64_t d = lane + std::int64_t(x) * kLanesPerPair;
      q[x] = (row_live && d < D) ? ld(a.q + b * a.q_b + h_abs * a.q_h + (t0 + r0 + prow) * a.q_t + d) : 0.0f;
      acc[x] = 0.0f;
    }

    for (std::int64_t e0 = e_begin; e0 < e_end; e0 += kEntryTile) {
      if (e0 >= n && first + (e0 - n) > m_last) break;  // the call's keys beyond this row tile: masked
      const std::int64_t ne = e_end - e0 < kEntryTile ? e_end - e0 : kEntryTile;
      __syncthreads();  // the previous step's readers of ks/vs/tile are done (and nk is written)
      if constexpr (is_row_scaled_v<S>) {
        stage_fp8_entries(c, a, item, b, n, t0, e0, ne, ks, vs, pitch, e_scale);
      } else {
        for (std::int64_t x = tid; x < ne * D; x += blockDim.x) {
          const std::int64_t e = x / D, d = x % D, idx = e0 + e;
          const S* kp = idx < n ? c.keys + c.row(item, idx) * D : a.k + b * a.k_b + g * a.k_g + (t0 + idx - n) * a.k_t;
          const S* vp =
              idx < n ? c.values + c.row(item, idx) * D : a.v + b * a.v_b + g * a.v_g + (t0 + idx - n) * a.v_t;
          ks[e * pitch + d] = ld(kp + d);
          vs[e * pitch + d] = ld(vp + d);
        }
      }
      load_entry_meta(c, a, item, b, n, t0, first, e0, ne, e_logit, e_part, e_pos);
      __syncthreads();
      // decay tile A(e, m) for the tile's rows m (spec 4.1); 0 where m <= pos_e
      decay_tile<Set>(tile, rt, ne, nr, nr, first + r0, e_pos, e_logit, e_part, r_logit, r_part,
                      [&](std::int64_t e, std::int64_t i) {
                        float sim = 0.0f;
                        for (std::int64_t d = 0; d < D; ++d) sim += ks[e * pitch + d] * nk[i * pitch + d];
                        return sim;
                      });
      __syncthreads();
      carry_lambda(c, a, item, n, first, r0, nr, e0, ne, e_pos, tile, rt);
      __syncthreads();
      // logits of every (head, row) pair, then one online-softmax step over the tile
      float tile_max = negative_infinity<float>();
      for (std::int64_t e = 0; e < ne; ++e) {
        float part = 0.0f;
        for (int x = 0; x < kDpt; ++x) {
          const std::int64_t d = lane + std::int64_t(x) * kLanesPerPair;
          if (d < D) part += q[x] * ks[e * pitch + d];
        }
        part += warp_shfl_xor(part, 1);
        part += warp_shfl_xor(part, 2);
        const float bias = row_live ? tile[e * rt + prow] : negative_infinity<float>();
        const float logit = bias == negative_infinity<float>() ? bias : part + bias;  // scale 1
        if (lane == 0) logits[pair * kEntryTile + e] = logit;
        tile_max = logit > tile_max ? logit : tile_max;
      }
      warp_sync();
      if (row_live && tile_max != negative_infinity<float>()) {
        const float rescale = sm.raise_max(tile_max);
        if (rescale != 1.0f)
          for (int x = 0; x < kDpt; ++x) acc[x] *= rescale;
        for (std::int64_t e = 0; e < ne; ++e) {
          const float w = sm.accumulate(logits[pair * kEntryTile + e]);
          if (w == 0.0f) continue;
          for (int x = 0; x < kDpt; ++x) {
            const std::int64_t d = lane + std::int64_t(x) * kLanesPerPair;
            if (d < D) acc[x] += w * vs[e * pitch + d];
          }
        }
      }
    }
    // this split's partial for every live (head, row)
    if (row_live) {
      const std::int64_t slot = ((item * a.splits + blockIdx.x) * r + head) * a.P + (r0 + prow);
      if (lane == 0) {
        a.part_ml[slot * 2] = sm.max;
        a.part_ml[slot * 2 + 1] = sm.sum;
      }
      for (int x = 0; x < kDpt; ++x) {
        const std::int64_t d = lane + std::int64_t(x) * kLanesPerPair;
        if (d < D) a.part_acc[slot * D + d] = acc[x];
      }
    }
    __syncthreads();  // nk / r_logit are rewritten by the next row tile
  }
}

// ---- decode: one row per item (the kernels are after the finish) ---------------------------------
__host__ __device__ inline std::size_t decode_smem_bytes(std::int64_t D, std::int64_t r) {
  return sizeof(float) * std::size_t((r + 1) * D           // queries of the group, the new key
                                     + r * D               // accumulators
                                     + r * kDecodeThreads  // logits, then weights, of the tile's entries per head
                                     + 2 * r + 32);        // running max / sum per head, reduction scratch
}

__device__ inline float block_reduce_max(float x, float* scratch) {
  for (int o = kWarpSize / 2; o > 0; o /= 2) x = fmaxf(x, warp_shfl_xor(x, o));
  __syncthreads();
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = x;
  __syncthreads();
  float m = scratch[0];
  for (int w = 1; w < int(blockDim.x / kWarpSize); ++w) m = fmaxf(m, scratch[w]);
  return m;
}
__device__ inline float block_reduce_sum(float x, float* scratch) {
  for (int o = kWarpSize / 2; o > 0; o /= 2) x += warp_shfl_xor(x, o);
  __syncthreads();
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = x;
  __syncthreads();
  float s = scratch[0];
  for (int w = 1; w < int(blockDim.x / kWarpSize); ++w) s += scratch[w];  // fixed order: deterministic
  return s;
}
// Sum over the kDecodeGroup lanes of a group (xor offsets below the group size stay inside it).
inline constexpr int kDecodeGroup = 8;
inline constexpr int kGroupsPerWarp = kWarpSize / kDecodeGroup;
__device__ inline float group_sum(float x) {
  for (int o = kDecodeGroup / 2; o > 0; o /= 2) x += warp_shfl_xor(x, o);
  return x;
}

// ---- merge: the splits' partials of one row, in split order -------------------------------------
// Every head of the group for row i (input row t0 + i): normalise, output gate, lse. Runs on the
// calling block's threads (merge_kernel for prefill rows, the last split of a decode step). Partials
// are read with ld.global.cg: other blocks wrote them. They are read kMergeBatch splits at a time into
// registers, after the column's output gate, so the loads of a batch are in flight together: one round
// trip per batch (a decode step fills one wave with at most kMergeBatch splits per item when the batch
// holds 32 or more items) instead of two dependent loads per split. (Two columns a thread at once would
// double the registers of the decode kernel's last block, which spill at its 128-register bound.)
inline constexpr int kMergeBatch = 8;
template <class S>
__device__ inline void merge_row(const DeviceCache<S>& c, const DeviceCall<S>& a, std::int64_t item, std::int64_t b,
                                 std::int64_t t0, std::int64_t i, int used) {
  const std::int64_t D = c.D, r = c.r, g = item % c.G;
  const int dim = int(D);
  for (int x = int(threadIdx.x); x < int(r) * dim; x += int(blockDim.x)) {
    const int h = x / dim, d = x % dim;
    const std::int64_t hq = g * r + h;
    const float gate = a.z_o ? ld(a.z_o + b * a.zo_b + (t0 + i) * a.zo_t + hq * a.zo_h + d) : 0.0f;
    float m[kMergeBatch], l[kMergeBatch], v[kMergeBatch];
    auto load_batch = [&](int s0) {
#pragma unroll
      for (int u = 0; u < kMergeBatch; ++u) {
        const int s = s0 + u;
        m[u] = negative_infinity<float>();
        l[u] = v[u] = 0.0f;
        if (s < used) {
          const std::int64_t slot = ((item * a.splits + s) * r + h) * a.P + i;
          m[u] = load_cg(a.part_ml + slot * 2);
          l[u] = load_cg(a.part_ml + slot * 2 + 1);
          v[u] = load_cg(a.part_acc + slot * D + d);
        }
      }
    };
    // the largest partial max first, then the weighted sums in split order
    float hi = negative_infinity<float>();
    for (int s0 = 0; s0 < used; s0 += kMergeBatch) {
      load_batch(s0);
#pragma unroll
      for (int u = 0; u < kMergeBatch; ++u) hi = m[u] > hi ? m[u] : hi;
    }
    float sum = 0.0f, y = 0.0f;
    if (hi != negative_infinity<float>())
      for (int s0 = 0; s0 < used; s0 += kMergeBatch) {
        if (used > kMergeBatch) load_batch(s0);  // one batch: still in the registers
#pragma unroll
        for (int u = 0; u < kMergeBatch; ++u) {
          if (m[u] == negative_infinity<float>()) continue;
          const float w = expf(m[u] - hi);
          sum += w * l[u];
          y += w * v[u];
        }
      }
    y = sum > 0.0f ? y / sum : 0.0f;
    if (a.z_o) y *= sigmoid(gate);
    a.out[b * a.o_b + (t0 + i) * a.o_t + hq * a.o_h + d] = y;
    if (a.lse && d == 0)
      a.lse[b * a.l_b + hq * a.l_h + (t0 + i) * a.l_t] = sum > 0.0f ? hi + logf(sum) : negative_infinity<float>();
  }
}

inline constexpr int kMergeThreads = 128;
// grid (x, I), block kMergeThreads: rows blockIdx.x, blockIdx.x + x, ... (x = rows for a fixed batch).
template <class S>
__global__ void __launch_bounds__(kMergeThreads)
    merge_kernel(DeviceCache<S> c, DeviceCall<S> a, std::int64_t t0, std::int64_t rows, std::int64_t min_piece) {
  ChunkWork w;
  if (!chunk_work(c, a, blockIdx.y, t0, rows, w)) return;
  const int used = active_splits(c.length[w.item] + w.rows, a.splits, min_piece);
  for (std::int64_t i = blockIdx.x; i < w.rows; i += gridDim.x) merge_row(c, a, w.item, w.b, w.t0, i, used);
}

// ---- finish: evict + compact, append, advance ---------------------------------------------------
// One item on the calling block's threads (any whole number of warps), with finish_smem_bytes<S>(D) bytes of
// shared memory at `fsm`; `dead` counts the rows marked dead among its rows in use (dead rows go at any p).
// Runs after everything of the step that reads the item's rows or its length (it changes both):
// finish_kernel after a prefill chunk, the last split of a decode step. λ is read with ld.global.cg: other
// blocks of the step updated it, and this block's L1 may hold old lines.
inline constexpr int kFinishThreads = 256;
// Rows staged per compaction step, turned into destinations by one ballot of warp 0's first kCompactRows
// lanes (a whole warp on NVIDIA; lanes past it sit the ballot out on a 64-lane wavefront, so the stage
// keeps the same shared memory on both vendors).
inline constexpr int kCompactRows = 32;
static_assert(kCompactRows <= kWarpSize, "one ballot turns a compaction step's keep flags into destinations");
inline constexpr int kMaxCallRows = 1024;  // rows of one chunk (UaCacheLimits::max_prefill_chunk <= 1024)
template <class S>
__host__ __device__ inline std::size_t finish_smem_bytes(std::int64_t D) {
  return std::size_t(kCompactRows) * std::size_t(2 * D) * sizeof(S) +
         std::size_t(kCompactRows) * (2 * sizeof(float) + sizeof(std::int64_t)) +
         (is_row_scaled_v<S> ? std::size_t(kCompactRows) * 2 * sizeof(float) : 0) + 64;
}

// Copies rows of D elements of S with the block's threads: row i from src(i) to dst(i) (nullptr: the row
// is skipped); source and destination rows of one call do not overlap. With vec16, every row start is
// 16-byte aligned and D * sizeof(S) is a multiple of 16, so whole 16-byte vectors move (8 bf16 per load
// instead of one), kCopyBatch per thread loaded before any is stored (the loads are in flight together:
// these copies sit on the latency-bound finish and decode paths); otherwise element by element.
// Indices within the copy are 32-bit (rows <= kMaxCallRows, D <= 256): 64-bit division is a long
// emulated sequence.
inline constexpr int kCopyBatch = 4;
template <class S, class Src, class Dst>
__device__ inline void copy_rows(std::int64_t rows, std::int64_t D, bool vec16, Src src, Dst dst) {
  if (vec16) {
    const int per_row = int(D) * int(sizeof(S)) / 16, count = int(rows) * per_row, step = int(blockDim.x);
    for (int x0 = int(threadIdx.x); x0 < count; x0 += kCopyBatch * step) {
      uint4 v[kCopyBatch];
      uint4* to[kCopyBatch];
#pragma unroll
      for (int u = 0; u < kCopyBatch; ++u) {
        const int x = x0 + u * step, i = x / per_row, w = x % per_row;
        S* row = x < count ? dst(i) : nullptr;
        to[u] = row != nullptr ? reinterpret_cast<uint4*>(row) + w : nullptr;
        if (to[u] != nullptr) v[u] = reinterpret_cast<const uint4*>(src(i))[w];
      }
#pragma unroll
      for (int u = 0; u < kCopyBatch; ++u)
        if (to[u] != nullptr) *to[u] = v[u];
    }
  } else {
    const int dim = int(D), count = int(rows) * dim;
    for (int x = int(threadIdx.x); x < count; x += int(blockDim.x)) {
      const int i = x / dim, d = x % dim;
      S* to = dst(i);
      if (to != nullptr) to[d] = src(i)[d];
    }
  }
}
template <bool kEvict, class S>
__device__ inline void finish_item(const DeviceCache<S>& c, const DeviceCall<S>& a, std::int64_t item, std::int64_t b,
                                   std::int64_t t0, std::int64_t rows, bool last, std::int64_t dead,
                                   unsigned char* fsm) {
  const std::int64_t D = c.D, g = item % c.G;
  const std::int64_t n = c.length[item];
  const std::int64_t first = c.counter[item];  // absolute position of the call's row t0
  const int tid = threadIdx.x, lane = tid % kWarpSize;
  // rows of the cache and of the staging buffer start 16 bytes apart when D * sizeof(S) is a multiple of 16
  // (UaCache's arena and the dynamic shared memory are 16-byte aligned)
  const bool vec_cache = (D * std::int64_t(sizeof(S))) % 16 == 0;

  // 1. evict λ < ln p and compact stably in place (survivors keep ascending positions). Warp 0 turns
  //    kCompactRows keep flags into destinations with a ballot; the group's rows are staged in shared memory, so
  //    no row is overwritten before it is read.
  S* kst = reinterpret_cast<S*>(fsm);
  S* vst = kst + kCompactRows * D;
  float* lst = reinterpret_cast<float*>(vst + kCompactRows * D);
  float* zst = lst + kCompactRows;
  std::int64_t* pst = reinterpret_cast<std::int64_t*>(zst + kCompactRows);
  float* kss = reinterpret_cast<float*>(pst + kCompactRows);  // fp8 storage: the group's row scales
  float* vss = kss + kCompactRows;
  __shared__ int dst[kCompactRows];  // destination row, -1 = evicted
  __shared__ int group_kept;
  const prune::Cut cut = item_cut<kEvict>(a, item);
  // dead rows go at any p; without eviction they are all that goes
  const bool prunes = (kEvict && (cut.log_p > -INFINITY || cut.ranked)) || dead > 0;
  std::int64_t kept = n;
  if (prunes) {
    kept = 0;
    for (std::int64_t e0 = 0; e0 < n; e0 += kCompactRows) {
      const std::int64_t ne = n - e0 < kCompactRows ? n - e0 : kCompactRows;
      __syncthreads();  // the previous group is written
      if (tid < kCompactRows) {
        const bool keep =
            lane < ne && !gone<kEvict>(load_cg(c.lambda + c.row(item, e0 + lane)), c.pos[c.row(item, e0 + lane)], cut);
        const LaneMask mask = warp_ballot(keep);
        dst[lane] = keep ? int(kept + mask_popc(mask & lanes_below(lane))) : -1;
        if (lane == 0) group_kept = mask_popc(mask);
      }
      __syncthreads();
      if (kept + group_kept < e0 + ne) {  // an eviction so far: survivors may move down (a copy in place is harmless)
        // only the survivors are staged (copy_rows reads no row whose destination is nullptr)
        copy_rows<S>(
            ne, D, vec_cache, [&](std::int64_t e) { return c.keys + c.row(item, e0 + e) * D; },
            [&](std::int64_t e) { return dst[e] < 0 ? nullptr : kst + e * D; });
        copy_rows<S>(
            ne, D, vec_cache, [&](std::int64_t e) { return c.values + c.row(item, e0 + e) * D; },
            [&](std::int64_t e) { return dst[e] < 0 ? nullptr : vst + e * D; });
        for (std::int64_t e = tid; e < ne; e += blockDim.x) {
          if (dst[e] < 0) continue;
          lst[e] = load_cg(c.lambda + c.row(item, e0 + e));
          zst[e] = c.key_logit[c.row(item, e0 + e)];
          pst[e] = c.pos[c.row(item, e0 + e)];
          if constexpr (is_row_scaled_v<S>) {
            kss[e] = c.key_scale[c.row(item, e0 + e)];
            vss[e] = c.value_scale[c.row(item, e0 + e)];
          }
        }
        __syncthreads();
        copy_rows<S>(
            ne, D, vec_cache, [&](std::int64_t e) { return kst + e * D; },
            [&](std::int64_t e) { return dst[e] < 0 ? nullptr : c.keys + c.row(item, dst[e]) * D; });
        copy_rows<S>(
            ne, D, vec_cache, [&](std::int64_t e) { return vst + e * D; },
            [&](std::int64_t e) { return dst[e] < 0 ? nullptr : c.values + c.row(item, dst[e]) * D; });
        for (std::int64_t e = tid; e < ne; e += blockDim.x) {
          if (dst[e] < 0) continue;
          c.lambda[c.row(item, dst[e])] = lst[e];
          c.key_logit[c.row(item, dst[e])] = zst[e];
          c.pos[c.row(item, dst[e])] = pst[e];
          if constexpr (is_row_scaled_v<S>) {
            c.key_scale[c.row(item, dst[e])] = kss[e];
            c.value_scale[c.row(item, dst[e])] = vss[e];
          }
        }
      }
      kept += group_kept;
    }
  }
  // 2. append the call's keys that survive (a decode step's new token has λ = 0 >= ln p: always kept):
  //    warp 0 turns the keep flags into destinations a warp of rows per ballot, then every thread copies
  __shared__ int new_dst[kMaxCallRows];
  __syncthreads();
  if (tid < kWarpSize) {
    constexpr int kBallots = 4;  // λ of 4 warps of rows loaded before their ballots: one round trip
    for (std::int64_t j0 = 0; j0 < rows; j0 += kWarpSize * kBallots) {
      float lam[kBallots];
#pragma unroll
      for (int u = 0; u < kBallots; ++u) {
        const std::int64_t j = j0 + kWarpSize * u + lane;
        lam[u] = (j < rows && a.lambda_new) ? a.lambda_new[item * a.P + j] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kBallots; ++u) {
        const std::int64_t j = j0 + kWarpSize * u + lane;
        const bool keep = j < rows && !(prunes && evict_test<kEvict>(cut, lam[u], first + j));
        const LaneMask mask = warp_ballot(keep);
        if (j < rows) new_dst[j] = keep ? int(kept + mask_popc(mask & lanes_below(lane))) : -1;
        kept += mask_popc(mask);
      }
    }
    if (lane == 0) group_kept = int(kept);
  }
  __syncthreads();
  kept = group_kept;
  const auto* k_in = a.k + b * a.k_b + g * a.k_g + t0 * a.k_t;
  const auto* v_in = a.v + b * a.v_b + g * a.v_g + t0 * a.v_t;
  if constexpr (is_row_scaled_v<S>) {  // fp8: a warp stores each surviving row with its scale
    for (std::int64_t j = tid / kWarpSize; j < rows; j += blockDim.x / kWarpSize) {
      if (new_dst[j] < 0) continue;
      const std::int64_t row = c.row(item, new_dst[j]);
      const float sk = store_row_warp(k_in + j * a.k_t, c.keys + row * D, D);
      const float sv = store_row_warp(v_in + j * a.v_t, c.values + row * D, D);
      if (lane == 0) {
        c.key_scale[row] = sk;
        c.value_scale[row] = sv;
      }
    }
  } else {
    const bool vec_in = new_rows_vec16(a, D);
    copy_rows<S>(
        rows, D, vec_in, [&](std::int64_t j) { return k_in + j * a.k_t; },
        [&](std::int64_t j) { return new_dst[j] < 0 ? nullptr : c.keys + c.row(item, new_dst[j]) * D; });
    copy_rows<S>(
        rows, D, vec_in, [&](std::int64_t j) { return v_in + j * a.v_t; },
        [&](std::int64_t j) { return new_dst[j] < 0 ? nullptr : c.values + c.row(item, new_dst[j]) * D; });
  }
  for (std::int64_t j = tid; j < rows; j += blockDim.x) {
    if (new_dst[j] < 0) continue;
    c.lambda[c.row(item, new_dst[j])] = a.lambda_new ? a.lambda_new[item * a.P + j] : 0.0f;
    c.key_logit[c.row(item, new_dst[j])] = a.z_k[b * a.zk_b + g * a.zk_g + (t0 + j) * a.zk_t];
    c.pos[c.row(item, new_dst[j])] = first + j;
  }
  __syncthreads();  // every thread has read length / counter (first) above
  if (tid == 0) {
    c.length[item] = kept;
    c.dead[item] = 0;
    c.counter[item] += rows;
    // the pages past the survivors go back once the row's (or call's) last chunk is in: the step took
    // its pages for kept + tokens rows before it ran (own pages: publishing counts them)
    if (last && c.pool.table != nullptr) return_pages(c.pool, item, kept);
  }
}

// grid (I), block kFinishThreads, dynamic smem finish_smem_bytes<S>(D): after a prefill chunk. kEvict:
// evict_test (false: only rows dead before the call leave).
template <bool kEvict, class S>
__global__ void __launch_bounds__(kFinishThreads)
    finish_kernel(DeviceCache<S> c, DeviceCall<S> a, std::int64_t t0, std::int64_t rows) {
  extern __shared__ __align__(16) unsigned char fsm[];
  ChunkWork w;
  if (chunk_work(c, a, blockIdx.x, t0, rows, w))
    finish_item<kEvict>(c, a, w.item, w.b, w.t0, w.rows, w.last, c.dead[w.item], fsm);
  if (a.publish_ticket != nullptr) publish_if_last(c.pool, a.publish_ticket, gridDim.x);
}

// Drops an item's dead rows (λ = -inf) in place, the others kept in position order, where every row is whole
// 16-byte vectors and carries no row scale (moves_in_registers). The block walks the n rows in groups of
// move_group_rows: warp 0 gives each live row its place (ballots), every thread reads its pieces of the
// group's moving rows into registers (kMovePieces of them), and after a barrier writes them to their places.
// A place is never above its row, so a group's writes land on rows that this group or an earlier one has
// read, and the barrier orders every read of the group before any write. Rows before the first dead one
// are not touched. Two round trips per group (λ, then the rows), where finish_item stages kCompactRows rows
// through shared memory in three. Returns the kept count (every thread).
inline constexpr int kMovePieces = 16;    // 16-byte pieces a thread holds
inline constexpr int kMoveRowsMax = 256;  // rows of a group at most (bf16 D 64: 8 pieces a row)
__host__ __device__ inline int move_group_rows(std::int64_t row_bytes) {
  const std::int64_t rows = std::int64_t(kMovePieces) * kFinishThreads / (2 * (row_bytes / 16));
  const std::int64_t whole = (rows < kMoveRowsMax ? rows : kMoveRowsMax) / kWarpSize * kWarpSize;
  return int(whole);
}
template <class S>
__device__ inline bool moves_in_registers(std::int64_t D) {
  const std::int64_t bytes = D * std::int64_t(sizeof(S));
  return !is_row_scaled_v<S> && bytes % 16 == 0 && move_group_rows(bytes) >= kWarpSize;
}
template <class S>
__device__ inline std::int64_t compact_dead_rows(const DeviceCache<S>& c, std::int64_t item, std::int64_t n) {
  static_assert(kMoveRowsMax % kWarpSize == 0 && kMoveRowsMax <= kFinishThreads, "a thread per row of a group");
  constexpr int kBallots = kMoveRowsMax / kWarpSize;
  __shared__ int place[kMoveRowsMax];  // the group's rows: their place, -1 = dead
  __shared__ int kept_s;
  const int tid = int(threadIdx.x), lane = tid % kWarpSize, threads = int(blockDim.x);
  const std::int64_t D = c.D;
  const int per_row = int(D * std::int64_t(sizeof(S)) / 16), group = move_group_rows(D * std::int64_t(sizeof(S)));
  std::int64_t kept = 0;  // live rows before the group
  bool moving = false;    // a dead row came before: every live row from here on moves
  // warp 0: λ of the group's rows, loaded one group ahead (no write of a group touches the next one's rows),
  // so that the loads are in flight during the previous group's copies
  float lam_ahead[kBallots];
  const auto load_ahead = [&](std::int64_t g0) {
#pragma unroll
    for (int u = 0; u < kBallots; ++u) {
      const std::int64_t e = g0 + u * kWarpSize + lane;
      lam_ahead[u] = u * kWarpSize < group && e < n ? load_cg(c.lambda + c.row(item, e)) : negative_infinity<float>();
    }
  };
  if (tid < kWarpSize) load_ahead(0);
  for (std::int64_t e0 = 0; e0 < n; e0 += group) {
    const int ne = int(n - e0 < group ? n - e0 : group);
    __syncthreads();  // the previous group's readers of place and kept_s are done
    if (tid < kWarpSize) {
      bool live[kBallots];
#pragma unroll
      for (int u = 0; u < kBallots; ++u) live[u] = !is_dead(lam_ahead[u]);  // rows past the group: -inf
      if (e0 + group < n) load_ahead(e0 + group);
      int base = int(kept);
#pragma unroll
      for (int u = 0; u < kBallots; ++u) {
        const LaneMask mask = warp_ballot(live[u]);
        if (u * kWarpSize < group)
          place[u * kWarpSize + lane] = live[u] ? base + mask_popc(mask & lanes_below(lane)) : -1;
        base += mask_popc(mask);
      }
      if (lane == 0) kept_s = base;
    }
    __syncthreads();
    const std::int64_t after = kept_s;
    if (!moving && after - kept == ne) {  // no dead row yet: nothing moves
      kept = after;
      continue;
    }
    moving = true;
    const auto moves = [&](int e) { return e < ne && place[e] >= 0 && place[e] != e0 + e; };
    // piece k of this thread: row e = x / (2 per_row) of the group, its key then its value, vector x % per_row;
    // `at` the vector in logical row `to` (the row itself, or its place)
    const auto row_of = [&](int k) { return (tid + k * threads) / (2 * per_row); };
    const auto at = [&](int k, std::int64_t to) {
      const int x = tid + k * threads;
      return reinterpret_cast<uint4*>(((x / per_row) % 2 != 0 ? c.values : c.keys) + c.row(item, to) * D) + x % per_row;
    };
    uint4 v[kMovePieces];
#pragma unroll
    for (int k = 0; k < kMovePieces; ++k)
      if (moves(row_of(k))) v[k] = *at(k, e0 + row_of(k));
    float lam = 0.0f, zk = 0.0f;
    std::int64_t pos = 0;
    if (moves(tid)) {
      const std::int64_t row = c.row(item, e0 + tid);
      lam = load_cg(c.lambda + row);
      zk = c.key_logit[row];
      pos = c.pos[row];
    }
    __syncthreads();  // every read of the group is performed before any write
#pragma unroll
    for (int k = 0; k < kMovePieces; ++k)
      if (moves(row_of(k))) *at(k, place[row_of(k)]) = v[k];
    if (moves(tid)) {
      const std::int64_t to = c.row(item, place[tid]);
      c.lambda[to] = lam;
      c.key_logit[to] = zk;
      c.pos[to] = pos;
    }
    kept = after;
  }
  return kept;
}

// Drops the `dead` rows (λ = -inf) of an item's n rows in use: compact_dead_rows, or finish_item without
// eviction where a group of rows does not fit the registers; then its length is the kept count and no row
// is dead.
template <class S>
__device__ inline void compact_item(const DeviceCache<S>& c, const DeviceCall<S>& a, std::int64_t item, std::int64_t n,
                                    std::int64_t dead, unsigned char* fsm) {
  if (!moves_in_registers<S>(c.D)) {
    finish_item<false>(c, a, item, item / c.G, 0, 0, false, dead, fsm);
    return;
  }
  const std::int64_t kept = compact_dead_rows(c, item, n);
  if (threadIdx.x == 0) {
    c.length[item] = kept;
    c.dead[item] = 0;
  }
}

// grid (I), block kFinishThreads, dynamic smem finish_smem_bytes<S>(D): drops the dead rows of every item
// (compact_item: nothing else goes), appending nothing. Before a call that walks rows by address (the dense tensor-core
// prefill) and before a prune rule's cuts (ua_prune.cuh: they read every row in use as an entry). An item
// without dead rows is left as it is.
template <class S>
__global__ void __launch_bounds__(kFinishThreads) compact_kernel(DeviceCache<S> c, DeviceCall<S> a) {
  extern __shared__ __align__(16) unsigned char fsm[];
  const std::int64_t item = blockIdx.x, dead = c.dead[item];
  if (dead == 0) return;
  compact_item(c, a, item, c.length[item], dead, fsm);
}

// grid (I), block kFinishThreads, dynamic smem finish_smem_bytes<S>(D): after a launch of the dense prefill
// with a threshold (a.log_p), which ends at a chunk end: every row below ln p goes (spec 4.5, the rows the
// launch masked included: λ = -inf already). The kernel marks them dead in place (λ = -inf) and counts them;
// an item compacts once its dead rows are at least 1 / kPruneCompactShare of its rows (compact_item), and
// otherwise keeps them in place, counted in c.dead as a decode step leaves the rows it evicts. A compaction
// moves every row after the first dead one, on one block per item,
// while a dead row costs the next launch a masked entry (weight 0, λ stays -inf) and a decode step one λ
// read: a launch that evicts a few rows of a long item (high kept fractions) moves nothing, and one that
// evicts many leaves none behind. The compaction before the next prefill call drops what is left
// (compact_kernel).
inline constexpr std::int64_t kPruneCompactShare = 16;
template <class S>
__global__ void __launch_bounds__(kFinishThreads) prune_compact_kernel(DeviceCache<S> c, DeviceCall<S> a) {
  extern __shared__ __align__(16) unsigned char fsm[];
  const std::int64_t item = blockIdx.x, n = c.length[item];
  const prune::Cut cut = item_cut<true>(a, item);
  __shared__ int dead_s;
  if (threadIdx.x == 0) dead_s = 0;
  __syncthreads();
  constexpr int kBatch = 4;  // rows per thread whose λ and position are in flight together
  int dead = 0;
  for (std::int64_t e0 = threadIdx.x; e0 < n; e0 += std::int64_t(kBatch) * blockDim.x) {
    std::int64_t row[kBatch], pos[kBatch];
    float lam[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const std::int64_t e = e0 + std::int64_t(u) * blockDim.x;
      row[u] = e < n ? c.row(item, e) : -1;
      lam[u] = row[u] >= 0 ? load_cg(c.lambda + row[u]) : 0.0f;
      pos[u] = row[u] >= 0 ? c.pos[row[u]] : 0;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (row[u] >= 0 && gone<true>(lam[u], pos[u], cut)) {
        ++dead;
        if (!is_dead(lam[u])) c.lambda[row[u]] = negative_infinity<float>();
      }
  }
  for (int o = kWarpSize / 2; o > 0; o /= 2) dead += warp_shfl_xor(dead, o);
  if (threadIdx.x % kWarpSize == 0 && dead != 0) atomicAdd(&dead_s, dead);
  __syncthreads();  // every row is marked and counted
  const std::int64_t total = dead_s;
  if (total == 0 || total * kPruneCompactShare < n) {  // none, or too few to move every row after them
    if (threadIdx.x == 0) c.dead[item] = total;
  } else {
    compact_item(c, a, item, n, total, fsm);  // every row that goes is marked: dead rows are all that go
  }
}

// ---- decode: what every decode path shares -----------------------------------------------------
// One cached row's decode step (spec 4.4 step 1, 4.5): λ gains the decay that the new token at position
// t puts on it, and the row goes when its item's cut evicts it (evict_test). A row dead before the step
// (λ = -inf) stays dead and takes no part. The one-block pass, the entry splits and the vector-row pass all take their
// rows' λ, eviction and attention mask from here.
struct RowUpdate {
  float lambda;  // λ after the step (-inf for a row dead before it)
  bool dead;     // dead before the step
  bool evict;    // goes at this step
  bool attend;   // scored by this step's attention (evict_before_attention masks a row that goes)
  __device__ bool keeps() const { return !dead && !evict; }
  // The λ a pass that leaves rows in place writes back: a row that goes is marked dead.
  __device__ float stored() const { return evict ? negative_infinity<float>() : lambda; }
};
// kEvict = false (prune::None): no row goes, and the decode paths built on it compile no eviction.
template <class Set, bool kEvict, class S>
__device__ inline RowUpdate update_row(const DeviceCall<S>& a, const prune::Cut& cut, float lambda, float sim, float zk,
                                       std::int64_t pos, float zq, float q_part, std::int64_t t) {
  if (is_dead(lambda)) return {lambda, true, false, false};
  if (t > pos && !a.lambda_updated)  // a prune rule's decode_cut_kernel added A(., t) already
    lambda += kernel::ua::decay_from_similarity<Set, float>(sim, zk, kernel::ua::key_gate_part(zk), pos, zq, q_part, t);
  const bool evict = evict_test<kEvict>(cut, lambda, pos);
  return {lambda, false, evict, !(evict && a.evict_before_attention)};
}

// The entries of a long item's decode step are its n rows in use followed by the new token (entry n),
// split over the blocks of the item in pieces of at least kDecodePiece (a whole number of move-plan
// chunks); the last block's merge recomputes the same pieces to know how many partials exist.
inline constexpr std::int64_t kDecodePiece = 64;
__device__ inline Range decode_range(std::int64_t total, int splits, int split) {
  const std::int64_t piece = split_piece(total, splits, kDecodePiece), begin = std::int64_t(split) * piece;
  if (begin >= total) return {total, total};
  return {begin, begin + piece < total ? begin + piece : total};
}

// ---- decode, moving a long item's live rows into fresh pages ------------------------------------
// A decode step of a long item over a shared pool whose dead rows reach a page's worth moves the rows
// live at its start into fresh pages as it reads them (reserve_slot takes the pages in the step's first
// kernel): every block writes the live rows of its range to their stable-compaction places through the
// item's spare table, and the last block returns the old pages and makes the spare table the item's page
// table (finish_move). The old rows are read-only for the whole step (λ updates and dead marks go to the
// new places), so the blocks never wait for one another: each counts, from λ as the step found it, the
// live rows before its range and marks the live ones within it.
inline constexpr int kPlanRows = 64;        // rows per chunk of a plan: one 64-bit mask
inline constexpr int kMaxPlanChunks = 256;  // chunks one block's range may span (plan_fits)
static_assert(kDecodePiece % kPlanRows == 0, "decode ranges start on plan chunk boundaries");
struct MovePlan {
  unsigned long long live[kMaxPlanChunks];  // bit i of chunk j: row (first + j) * kPlanRows + i is live
  int before[kMaxPlanChunks];               // live rows before chunk j
  std::int64_t first;                       // the range's first chunk
  __device__ bool is_live(std::int64_t e) const {
    return ((live[e / kPlanRows - first] >> (e % kPlanRows)) & 1ull) != 0;
  }
  // The logical row live row e moves to: the number of live rows before it.
  __device__ std::int64_t dest(std::int64_t e) const {
    const std::int64_t j = e / kPlanRows - first;
    return before[j] + __popcll(live[j] & ((1ull << (e % kPlanRows)) - 1ull));
  }
};
// Whether every block's range of a decode step over `rows` rows in use (and the new token) fits a plan.
__host__ __device__ inline bool plan_fits(std::int64_t rows, int splits) {
  return split_piece(rows + 1, splits, kDecodePiece) <= std::int64_t(kMaxPlanChunks) * kPlanRows;
}
// Pool row of logical row e of `item` in its fresh pages.
template <class S>
__device__ inline std::int64_t moved_row(const DeviceCache<S>& c, std::int64_t item, std::int64_t e) {
  const std::int64_t page = c.pool.spare[item * c.pool.pages_per_item + (e >> c.pool.shift)];
  return (page << c.pool.shift) | (e & ((std::int64_t(1) << c.pool.shift) - 1));
}
// The plan of the cached rows [begin, end) of `item` (begin a multiple of kPlanRows, end - begin at most
// kMaxPlanChunks chunks), on the calling block's threads.
template <class S>
__device__ inline void plan_moves(const DeviceCache<S>& c, std::int64_t item, std::int64_t begin, std::int64_t end,
                                  MovePlan& p) {
  const int tid = int(threadIdx.x), lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int warps = int(blockDim.x) / kWarpSize;
  const std::int64_t first = begin / kPlanRows, chunks = (end - begin + kPlanRows - 1) / kPlanRows;
  __shared__ int live_before;
  if (tid == 0) live_before = 0;
  __syncthreads();
  int mine = 0;  // live rows before the range: every thread a stride of them
  for (std::int64_t e = tid; e < begin; e += blockDim.x) mine += is_dead(c.lambda[c.row(item, e)]) ? 0 : 1;
  for (int o = kWarpSize / 2; o > 0; o /= 2) mine += warp_shfl_xor(mine, o);
  if (lane == 0 && mine != 0) atomicAdd(&live_before, mine);
  for (std::int64_t j = warp; j < chunks; j += warps) {  // a warp per chunk, a ballot per warp of its rows
    unsigned long long bits = 0;
#pragma unroll
    for (int h = 0; h < kPlanRows; h += kWarpSize) {
      const std::int64_t e = (first + j) * kPlanRows + h + lane;
      const bool live = e < end && !is_dead(c.lambda[c.row(item, e)]);
      bits |= static_cast<unsigned long long>(warp_ballot(live)) << h;
    }
    if (lane == 0) p.live[j] = bits;
  }
  __syncthreads();
  if (warp == 0) {  // exclusive prefix of the chunks' live counts, a warp of chunks at a time
    int carry = live_before;
    for (std::int64_t j0 = 0; j0 < chunks; j0 += kWarpSize) {
      const std::int64_t j = j0 + lane;
      const int count = j < chunks ? __popcll(p.live[j]) : 0;
      int inclusive = count;
      for (int o = 1; o < kWarpSize; o *= 2) {
        const int up = warp_shfl_up(inclusive, unsigned(o));
        if (lane >= o) inclusive += up;
      }
      if (j < chunks) p.before[j] = carry + inclusive - count;
      carry += warp_shfl(inclusive, kWarpSize - 1);
    }
    if (lane == 0) p.first = first;
  }
  __syncthreads();
}
// Copies the keys, values, key-gate logits and positions of the live rows among the cached rows [e0, e0 +
// rows) of `item` to their places in its fresh pages (their λ is the λ update's), on the calling block's
// threads.
template <class S>
__device__ inline void move_rows(const DeviceCache<S>& c, std::int64_t item, std::int64_t e0, std::int64_t rows,
                                 const MovePlan& p) {
  const std::int64_t D = c.D;
  const bool vec = (D * std::int64_t(sizeof(S))) % 16 == 0;
  const auto to = [&](std::int64_t e) {
    return p.is_live(e0 + e) ? moved_row(c, item, p.dest(e0 + e)) : std::int64_t(-1);
  };
  copy_rows<S>(
      rows, D, vec, [&](std::int64_t e) { return c.keys + c.row(item, e0 + e) * D; },
      [&](std::int64_t e) {
        const std::int64_t at = to(e);
        return at < 0 ? nullptr : c.keys + at * D;
      });
  copy_rows<S>(
      rows, D, vec, [&](std::int64_t e) { return c.values + c.row(item, e0 + e) * D; },
      [&](std::int64_t e) {
        const std::int64_t at = to(e);
        return at < 0 ? nullptr : c.values + at * D;
      });
  for (std::int64_t e = threadIdx.x; e < rows; e += blockDim.x) {
    const std::int64_t at = to(e);
    if (at < 0) continue;
    const std::int64_t from = c.row(item, e0 + e);
    c.key_logit[at] = c.key_logit[from];
    c.pos[at] = c.pos[from];
    if constexpr (is_row_scaled_v<S>) {
      c.key_scale[at] = c.key_scale[from];
      c.value_scale[at] = c.value_scale[from];
    }
  }
}

// ---- decode, short caches: the whole step of one item in one block -------------------------------
// An item that keeps at most kOneBlockMaxKept entries is decoded by split 0 of the launch alone: per
// tile of kOneBlockTile entries (ascending position, the new token last) the block stages keys,
// values, λ, z_k and positions in shared memory, updates λ (spec 4.4: λ_j += A_{j,t}, independent per
// entry), decides eviction, takes one online-softmax step per head, and writes the survivors to their
// stable-compaction slots (a ballot prefix sum: ascending position kept); then it appends the new
// token and writes the output. No partials and no merge: one block, one chain of dependent loads per
// tile. Compaction in place is safe tile by tile: a row's destination is never above its source, so
// writes land on rows this tile or an earlier one has already staged.
inline constexpr int kOneBlockTile = 64;  // a multiple of kWarpSize: one ballot per warp of entries
static_assert(kOneBlockTile % kWarpSize == 0, "the one-block decode compacts a tile in whole-warp ballots");
inline constexpr std::int64_t kOneBlockMaxKept = 256;

// Byte offsets of the one-block path's shared memory. Staged rows are D + 16 bytes apart: the four
// 8-lane groups of a warp read the same columns of four rows, which then fall in different banks.
struct OneBlockLayout {
  std::int64_t pitch;  // elements of S per staged row
  std::size_t keys, values, pos, lambda, logit, keep, dst, qs, nk, acc, wts, run_max, run_sum, rescale, kept, key_scale,
      value_scale, pages, bytes;
  __host__ __device__ static std::size_t up16(std::size_t x) { return (x + 15) / 16 * 16; }
  __host__ __device__ OneBlockLayout(std::int64_t D, std::int64_t r, std::size_t elem, bool row_scales = false) {
    pitch = D + std::int64_t(16 / elem);
    const std::size_t tile = std::size_t(kOneBlockTile), row_bytes = std::size_t(pitch) * elem;
    keys = 0;
    values = keys + tile * row_bytes;
    pos = up16(values + tile * row_bytes);
    lambda = pos + tile * sizeof(std::int64_t);
    logit = lambda + tile * sizeof(float);
    keep = logit + tile * sizeof(float);
    dst = keep + tile * sizeof(int);
    qs = up16(dst + tile * sizeof(int));
    nk = up16(qs + std::size_t(r * D) * sizeof(float));
    acc = up16(nk + std::size_t(D) * sizeof(float));
    wts = up16(acc + std::size_t(r * D) * sizeof(float));
    run_max = up16(wts + std::size_t(r) * tile * sizeof(float));
    run_sum = run_max + std::size_t(r) * sizeof(float);
    rescale = run_sum + std::size_t(r) * sizeof(float);
    kept = up16(rescale + std::size_t(r) * sizeof(float));
    key_scale = kept + 16;  // fp8 storage: the tile's row scales (no bytes for other storage)
    value_scale = key_scale + (row_scales ? tile * sizeof(float) : 0);
    pages = up16(value_scale + (row_scales ? tile * sizeof(float) : 0));
    bytes = pages + std::size_t(kOneBlockMaxKept + 1) * sizeof(std::int32_t);
  }
};

// Split 0 of an item with n <= kOneBlockMaxKept cached entries: the whole step except publishing the
// new length (the last block of the item does that, see decode_attend_kernel). Returns the length
// after the step (survivors + the new token) in every thread.
template <class Set, bool kEvict, class S, int kDpl>
__device__ inline std::int64_t decode_one_block(const DeviceCache<S>& c, const DeviceCall<S>& a, std::int64_t item,
                                                std::int64_t b, std::int64_t n, unsigned char* smem) {
  const std::int64_t D = c.D, r = c.r, g = item % c.G;
  const std::int64_t t = c.counter[item];
  const prune::Cut cut = item_cut<kEvict>(a, item);
  const OneBlockLayout L(D, r, sizeof(S), is_row_scaled_v<S>);
  const int pitch = int(L.pitch);
  S* kst = reinterpret_cast<S*>(smem + L.keys);
  S* vst = reinterpret_cast<S*>(smem + L.values);
  std::int64_t* pos_t = reinterpret_cast<std::int64_t*>(smem + L.pos);
  float* lam_t = reinterpret_cast<float*>(smem + L.lambda);
  float* zk_t = reinterpret_cast<float*>(smem + L.logit);
  int* keep_t = reinterpret_cast<int*>(smem + L.keep);
  int* dst_t = reinterpret_cast<int*>(smem + L.dst);    // destination row of a survivor, -1 otherwise
  float* qs = reinterpret_cast<float*>(smem + L.qs);    // [r][D]
  float* nk = reinterpret_cast<float*>(smem + L.nk);    // [D]
  float* acc = reinterpret_cast<float*>(smem + L.acc);  // [r][D]
  float* wts = reinterpret_cast<float*>(smem + L.wts);  // [r][kOneBlockTile] logits, then weights
  float* run_max = reinterpret_cast<float*>(smem + L.run_max);
  float* run_sum = reinterpret_cast<float*>(smem + L.run_sum);
  float* rescale = reinterpret_cast<float*>(smem + L.rescale);
  int* kept_s = reinterpret_cast<int*>(smem + L.kept);           // survivors so far (the last warp keeps it)
  float* ks_t = reinterpret_cast<float*>(smem + L.key_scale);    // fp8 storage only
  float* vs_t = reinterpret_cast<float*>(smem + L.value_scale);  // fp8 storage only

  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize, warps = int(blockDim.x / kWarpSize);
  // The item's page places of rows [0, n], read once: every row address of the step (staging, the
  // survivors' destinations, the new token's row) then comes from shared memory, not a page-table load.
  std::int32_t* pages_s = reinterpret_cast<std::int32_t*>(smem + L.pages);
  const DevicePool& pool = c.pool;
  if (pool.table != nullptr) {
    const std::int64_t used = pool.pages_for(n + 1) < pool.pages_per_item ? pool.pages_for(n + 1) : pool.pages_per_item;
    for (std::int64_t x = tid; x < used; x += blockDim.x) pages_s[x] = pool.table[item * pool.pages_per_item + x];
  }
  // own pages: the item's rows are contiguous from item * stride
  const kernel::ua::RowMap row_map{pool.table != nullptr ? pages_s : nullptr, pool.shift};
  const std::int64_t first_row = pool.table != nullptr ? 0 : item * c.stride;
  const auto place = [&](std::int64_t e) { return first_row + row_map(e); };
  const int grp = lane / kDecodeGroup, sub = lane % kDecodeGroup;
  const auto* new_key = a.k + b * a.k_b + g * a.k_g;
  const auto* new_value = a.v + b * a.v_b + g * a.v_g;
  const int dim = int(D);  // tile-local indices are 32-bit (D <= 256, kOneBlockTile rows)
  for (int x = tid; x < int(r) * dim; x += int(blockDim.x)) {
    qs[x] = ld(a.q + b * a.q_b + (g * r + x / dim) * a.q_h + x % dim);
    acc[x] = 0.0f;
  }
  for (int d = tid; d < dim; d += int(blockDim.x)) nk[d] = ld(new_key + d);
  for (std::int64_t h = tid; h < r; h += blockDim.x) {
    run_max[h] = negative_infinity<float>();
    run_sum[h] = 0.0f;
  }
  if (tid == 0) *kept_s = 0;
  const float zq = a.z_q[b * a.zq_b + g * a.zq_g];
  const float q_part = kernel::ua::query_gate_part(zq);
  // cache rows start 16 bytes apart when D * sizeof(S) is a multiple of 16 (the arena is 256-aligned),
  // and so do the staged rows (pitch D + 16 bytes, dynamic shared memory 16-byte aligned) and the fp32
  // rows of qs (D is then a multiple of 4)
  const bool vec = (D * std::int64_t(sizeof(S))) % 16 == 0;
  const std::int64_t total = n + 1;  // the cached entries, then the new token (entry n, λ = 0)

  for (std::int64_t e0 = 0; e0 < total; e0 += kOneBlockTile) {
    const int ne = int(total - e0 < kOneBlockTile ? total - e0 : kOneBlockTile);
    const int cached = int(n - e0 < ne ? n - e0 : ne);  // entries of the tile that are cache rows
    __syncthreads();  // the previous tile's readers of the staging buffers are done (setup written)
    // 1. stage the tile: rows with cp.async (no registers, every load in flight at once)
    // (rows through the page map: a tile may span pages)
    if (vec) {
      const int per_row = dim * int(sizeof(S)) / 16, per = 16 / int(sizeof(S));
      for (int x = tid; x < cached * per_row; x += int(blockDim.x)) {
        const int e = x / per_row, w = x % per_row;
        const std::int64_t at = place(e0 + e) * D + w * per;
        ptx::cp_async16(kst + e * pitch + w * per, c.keys + at, 16);
        ptx::cp_async16(vst + e * pitch + w * per, c.values + at, 16);
      }
      ptx::cp_async_commit();
    } else {
      for (int x = tid; x < cached * dim; x += int(blockDim.x)) {
        const int e = x / dim, d = x % dim;
        const std::int64_t at = place(e0 + e) * D + d;
        kst[e * pitch + d] = c.keys[at];
        vst[e * pitch + d] = c.values[at];
      }
    }
    if (cached < ne) {                     // the new token is the tile's last entry
      if constexpr (is_row_scaled_v<S>) {  // stored as the cache will hold it, with its scales
        if (warp == 0) {
          const float sk = store_row_warp(new_key, kst + cached * pitch, D);
          const float sv = store_row_warp(new_value, vst + cached * pitch, D);
          if (lane == 0) {
            ks_t[cached] = sk;
            vs_t[cached] = sv;
          }
        }
      } else {
        for (int d = tid; d < dim; d += int(blockDim.x)) {
          kst[cached * pitch + d] = new_key[d];
          vst[cached * pitch + d] = new_value[d];
        }
      }
    }
    for (int e = tid; e < ne; e += int(blockDim.x)) {
      const bool in_cache = e < cached;
      lam_t[e] = in_cache ? c.lambda[place(e0 + e)] : 0.0f;
      zk_t[e] = in_cache ? c.key_logit[place(e0 + e)] : a.z_k[b * a.zk_b + g * a.zk_g];
      pos_t[e] = in_cache ? c.pos[place(e0 + e)] : t;
      if constexpr (is_row_scaled_v<S>)
        if (in_cache) {
          ks_t[e] = c.key_scale[place(e0 + e)];
          vs_t[e] = c.value_scale[place(e0 + e)];
        }
    }
    ptx::cp_async_wait<0>();
    __syncthreads();
    // 2. λ update, eviction test and the r logits: a group of kDecodeGroup lanes per entry, lanes over
    //    the dims (every lane runs every shuffle: the loop bound is warp-uniform)
    for (int eb = warp * kGroupsPerWarp; eb < ne; eb += warps * kGroupsPerWarp) {
      const int e = eb + grp;
      const bool valid = e < ne, in_cache = e < cached;
      // The lane's dims: with 16-byte rows, vectors sub, sub + 8, ... of the row (one shared-memory
      // load per vector of the key, per four floats of q and the new key); else dims sub, sub + 8, ...
      // (fp8: 16 elements a vector, so a row of up to 128 dims is one vector per lane even where kDpl is 8)
      constexpr int kPer = int(16 / sizeof(S)), kVecs = (kDpl + kPer - 1) / kPer;
      float key[kVecs * kPer > kDpl ? kVecs * kPer : kDpl];
      if (vec) {
#pragma unroll
        for (int j = 0; j < kVecs; ++j) {
          const int d0 = (sub + j * kDecodeGroup) * kPer;
          uint4 raw = make_uint4(0, 0, 0, 0);
          if (valid && d0 < dim) raw = *reinterpret_cast<const uint4*>(kst + e * pitch + d0);
          unpack<S>(raw, key + j * kPer);
        }
      } else {
#pragma unroll
        for (int x = 0; x < kDpl; ++x) {
          const int d = sub + x * kDecodeGroup;
          key[x] = (valid && d < dim) ? ld(kst + e * pitch + d) : 0.0f;
        }
      }
      auto dot = [&](const float* row) {  // this lane's part of key . row
        float part = 0.0f;
        if (vec) {
#pragma unroll
          for (int j = 0; j < kVecs; ++j) {
            const int d0 = (sub + j * kDecodeGroup) * kPer;
            if (d0 < dim)
#pragma unroll
              for (int k = 0; k < kPer; k += 4) {
                const float4 f = *reinterpret_cast<const float4*>(row + d0 + k);
                part += key[j * kPer + k] * f.x + key[j * kPer + k + 1] * f.y + key[j * kPer + k + 2] * f.z +
                        key[j * kPer + k + 3] * f.w;
              }
          }
        } else {
#pragma unroll
          for (int x = 0; x < kDpl; ++x) {
            const int d = sub + x * kDecodeGroup;
            if (d < dim) part += key[x] * row[d];
          }
        }
        return part;
      };
      float kscale = 1.0f;  // fp8: the entry's key is kscale * its stored row
      if constexpr (is_row_scaled_v<S>) kscale = valid ? ks_t[e] : 1.0f;
      float sim = 0.0f;  // a set without the similarity gate never reads it
      if constexpr (Set::kNeedsSimilarity) sim = group_sum(dot(nk)) * kscale;  // every lane: shuffles
      float lam = 0.0f;
      bool keep = false, attend = valid;
      if (in_cache) {
        const RowUpdate up = update_row<Set, kEvict>(a, cut, lam_t[e], sim, zk_t[e], pos_t[e], zq, q_part, t);
        lam = up.lambda;
        keep = up.keeps();
        attend = up.attend;
      }
      for (int h = 0; h < int(r); ++h) {
        const float part = group_sum(dot(qs + h * dim)) * kscale;
        if (sub == 0 && valid)
          wts[h * kOneBlockTile + e] = attend ? part + lam : negative_infinity<float>();  // scale 1
      }
      warp_sync();  // the group's lanes have read lam_t[e]
      if (sub == 0 && valid) {
        lam_t[e] = lam;
        keep_t[e] = keep ? 1 : 0;  // the new token is appended after the survivors, never moved
      }
    }
    __syncthreads();
    // 3. the last warp: survivors' destinations, a warp of entries per ballot. Warp w: the online-softmax step
    //    of heads w, w + warps, ... over the tile (warp reductions in a fixed order: deterministic)
    if (warp == warps - 1) {
      int kept = *kept_s;
      for (int e = lane; e < kOneBlockTile; e += kWarpSize) {  // warp-uniform bound
        const bool keep = e < ne && keep_t[e] != 0;
        const LaneMask mask = warp_ballot(keep);
        dst_t[e] = keep ? kept + mask_popc(mask & lanes_below(lane)) : -1;
        kept += mask_popc(mask);
      }
      warp_sync();
      if (lane == 0) *kept_s = kept;
    }
    constexpr int kPerLane = kOneBlockTile / kWarpSize;
    for (std::int64_t h = warp; h < r; h += warps) {
      float l[kPerLane], w[kPerLane];
      float tile_max = negative_infinity<float>();
#pragma unroll
      for (int u = 0; u < kPerLane; ++u) {
        const int e = lane + kWarpSize * u;
        l[u] = e < ne ? wts[h * kOneBlockTile + e] : negative_infinity<float>();
        tile_max = fmaxf(tile_max, l[u]);
      }
      for (int o = kWarpSize / 2; o > 0; o /= 2) tile_max = fmaxf(tile_max, warp_shfl_xor(tile_max, o));
      const float old_max = run_max[h];
      const float new_max = tile_max > old_max ? tile_max : old_max;
      float tile_sum = 0.0f;
#pragma unroll
      for (int u = 0; u < kPerLane; ++u) {
        w[u] = l[u] == negative_infinity<float>() ? 0.0f : expf(l[u] - new_max);
        tile_sum += w[u];
      }
      for (int o = kWarpSize / 2; o > 0; o /= 2) tile_sum += warp_shfl_xor(tile_sum, o);
      const float scale = (old_max == negative_infinity<float>() || new_max == negative_infinity<float>())
                              ? 0.0f
                              : expf(old_max - new_max);
#pragma unroll
      for (int u = 0; u < kPerLane; ++u)
        if (lane + kWarpSize * u < ne) {
          float vscale = 1.0f;  // fp8: p.v reads the stored value rows, the weight takes their scale
          if constexpr (is_row_scaled_v<S>) vscale = vs_t[lane + kWarpSize * u];
          wts[h * kOneBlockTile + lane + kWarpSize * u] = w[u] * vscale;
        }
      warp_sync();
      if (lane == 0) {
        run_max[h] = new_max;
        run_sum[h] = run_sum[h] * scale + tile_sum;
        rescale[h] = scale;
      }
    }
    __syncthreads();
    // 4. p.v: a thread per (dim, pair of heads), each value read once for both heads
    const int head_pairs = (int(r) + 1) / 2;
    for (int x = tid; x < dim * head_pairs; x += int(blockDim.x)) {
      const int d = x % dim, h0 = 2 * (x / dim), nh = int(r) - h0 < 2 ? 1 : 2;
      float s0 = acc[h0 * dim + d] * rescale[h0], s1 = nh == 2 ? acc[(h0 + 1) * dim + d] * rescale[h0 + 1] : 0.0f;
      const float* w0 = wts + h0 * kOneBlockTile;
      const float* w1 = nh == 2 ? w0 + kOneBlockTile : w0;  // a lone last head reads its own weights twice
      int e = 0;
      for (; e + 4 <= ne; e += 4) {  // four entries a step: the value loads independent, weights as float4
        const float4 a0 = *reinterpret_cast<const float4*>(w0 + e), a1 = *reinterpret_cast<const float4*>(w1 + e);
        const float v0 = ld(vst + e * pitch + d), v1 = ld(vst + (e + 1) * pitch + d),
                    v2 = ld(vst + (e + 2) * pitch + d), v3 = ld(vst + (e + 3) * pitch + d);
        s0 += a0.x * v0;
        s0 += a0.y * v1;
        s0 += a0.z * v2;
        s0 += a0.w * v3;
        s1 += a1.x * v0;
        s1 += a1.y * v1;
        s1 += a1.z * v2;
        s1 += a1.w * v3;
      }
      for (; e < ne; ++e) {
        const float v = ld(vst + e * pitch + d);
        s0 += w0[e] * v;
        s1 += w1[e] * v;
      }
      acc[h0 * dim + d] = s0;
      if (nh == 2) acc[(h0 + 1) * dim + d] = s1;
    }
    // 5. survivors to their slots (only rows that move are copied; every survivor's λ changed)
    auto moved = [&](std::int64_t e) { return dst_t[e] >= 0 && dst_t[e] != e0 + e; };
    copy_rows<S>(
        ne, D, vec, [&](std::int64_t e) { return kst + e * pitch; },
        [&](std::int64_t e) { return moved(e) ? c.keys + place(dst_t[e]) * D : nullptr; });
    copy_rows<S>(
        ne, D, vec, [&](std::int64_t e) { return vst + e * pitch; },
        [&](std::int64_t e) { return moved(e) ? c.values + place(dst_t[e]) * D : nullptr; });
    for (int e = tid; e < ne; e += int(blockDim.x)) {
      if (dst_t[e] < 0) continue;
      c.lambda[place(dst_t[e])] = lam_t[e];
      if (moved(e)) {
        c.key_logit[place(dst_t[e])] = zk_t[e];
        c.pos[place(dst_t[e])] = pos_t[e];
        if constexpr (is_row_scaled_v<S>) {
          c.key_scale[place(dst_t[e])] = ks_t[e];
          c.value_scale[place(dst_t[e])] = vs_t[e];
        }
      }
    }
    if (cached < ne) {  // 6. append the new token after the survivors (λ = 0 >= ln p: always kept)
      const std::int64_t slot = place(*kept_s);
      copy_rows<S>(
          1, D, vec, [&](std::int64_t) { return kst + cached * pitch; },
          [&](std::int64_t) { return c.keys + slot * D; });
      copy_rows<S>(
          1, D, vec, [&](std::int64_t) { return vst + cached * pitch; },
          [&](std::int64_t) { return c.values + slot * D; });
      if (tid == 0) {
        c.lambda[slot] = 0.0f;
        c.key_logit[slot] = zk_t[cached];
        c.pos[slot] = t;
        if constexpr (is_row_scaled_v<S>) {
          c.key_scale[slot] = ks_t[cached];
          c.value_scale[slot] = vs_t[cached];
        }
      }
    }
  }
  // 7. output
  __syncthreads();  // every accumulator is final
  for (int d = tid; d < dim; d += int(blockDim.x))
    for (int h = 0; h < int(r); ++h) {
      const float sum = run_sum[h];
      float y = sum > 0.0f ? acc[h * dim + d] / sum : 0.0f;
      const std::int64_t hq = g * r + h;
      if (a.z_o) y *= sigmoid(ld(a.z_o + b * a.zo_b + hq * a.zo_h + d));
      a.out[b * a.o_b + hq * a.o_h + d] = y;
      if (a.lse && d == 0)
        a.lse[b * a.l_b + hq * a.l_h] = sum > 0.0f ? run_max[h] + logf(sum) : negative_infinity<float>();
    }
  return std::int64_t(*kept_s) + 1;
}

// ---- decode, long caches: entry splits ----------------------------------------------------------
// A group of 8 lanes takes one entry at a time, its lanes over the dims: the entry's key is read once
// for the λ update (spec 4.4 step 1) and the r logits. Then the block walks the tile's value rows with
// one thread per dim for all r heads. The new token is entry n (λ = 0). Rows that go are marked dead in
// place, or, with a plan, every live row is written to its place in the item's fresh pages. Leaves the
// partial of `split` over the entries of `range` (not empty) and returns the rows it marked dead.
template <class Set, bool kEvict, class S, int kDpl>
__device__ inline int decode_split(const DeviceCache<S>& c, const DeviceCall<S>& a, std::int64_t item, std::int64_t b,
                                   std::int64_t n, int split, Range range, const MovePlan* plan, float* dsm) {
  const std::int64_t D = c.D, r = c.r, g = item % c.G;
  float* qs = dsm;                            // [r][D]
  float* nk = qs + r * D;                     // [D]
  float* acc = nk + D;                        // [r][D]
  float* wts = acc + r * D;                   // [r][kDecodeThreads]
  float* run_max = wts + r * kDecodeThreads;  // [r]
  float* run_sum = run_max + r;               // [r]
  float* scratch = run_sum + r;               // [32] (one per warp)

  const std::int64_t e_begin = range.begin, e_end = range.end;
  const std::int64_t t = c.counter[item];
  const prune::Cut cut = item_cut<kEvict>(a, item);
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize, warps = kDecodeThreads / kWarpSize;
  __shared__ int marked;
  if (tid == 0) marked = 0;
  const int grp = lane / kDecodeGroup, sub = lane % kDecodeGroup;
  const auto* new_key = a.k + b * a.k_b + g * a.k_g;
  const auto* new_value = a.v + b * a.v_b + g * a.v_g;
  __shared__ float new_scale[2];  // fp8 storage: the scales the new token's rows are stored with
  if constexpr (is_row_scaled_v<S>)
    if (warp == 0) {
      const float sk = row_scale_warp<S>(new_key, D), sv = row_scale_warp<S>(new_value, D);
      if (lane == 0) {
        new_scale[0] = sk;
        new_scale[1] = sv;
      }
    }
  for (std::int64_t x = tid; x < r * D; x += blockDim.x) {
    const std::int64_t h = x / D, d = x % D;
    qs[x] = ld(a.q + b * a.q_b + (g * r + h) * a.q_h + d);
    acc[x] = 0.0f;
  }
  for (std::int64_t d = tid; d < D; d += blockDim.x) nk[d] = ld(new_key + d);
  for (std::int64_t h = tid; h < r; h += blockDim.x) {
    run_max[h] = negative_infinity<float>();
    run_sum[h] = 0.0f;
  }
  const float zq = a.z_q[b * a.zq_b + g * a.zq_g];
  const float q_part = kernel::ua::query_gate_part(zq);
  __syncthreads();

  for (std::int64_t e0 = e_begin; e0 < e_end; e0 += kDecodeThreads) {
    const std::int64_t ne = e_end - e0 < kDecodeThreads ? e_end - e0 : kDecodeThreads;
    // 1. λ update and eviction test, 2. logits of the r heads. A group of kDecodeGroup lanes takes one
    //    entry (lanes over the dims, the key row held in registers for the r + 1 dot products); every
    //    lane runs every shuffle, so groups without an entry just contribute zeros.
    for (std::int64_t x = tid; x < r * kDecodeThreads; x += blockDim.x)
      if (x % kDecodeThreads >= ne) wts[x] = negative_infinity<float>();                    // slots without an entry
    for (std::int64_t eb = warp * kGroupsPerWarp; eb < ne; eb += warps * kGroupsPerWarp) {  // warp-uniform bound
      const std::int64_t e = eb + grp, idx = e0 + e;
      const bool valid = e < ne, cached = valid && idx < n;
      const std::int64_t at = cached ? c.row(item, idx) : 0;
      float key[kDpl];
      float kscale = 1.0f;  // fp8: the entry's key is kscale * its stored row (the new token's as stored)
      if constexpr (is_row_scaled_v<S>) {
        kscale = cached ? c.key_scale[at] : new_scale[0];
#pragma unroll
        for (int x = 0; x < kDpl; ++x) {
          const std::int64_t d = sub + std::int64_t(x) * kDecodeGroup;
          key[x] = !(valid && d < D) ? 0.0f
                   : cached          ? ld(c.keys + at * D + d)
                                     : fp8_stored_element(ld(new_key + d), kscale);
        }
      } else {
        const S* krow = cached ? c.keys + at * D : new_key;
#pragma unroll
        for (int x = 0; x < kDpl; ++x) {
          const std::int64_t d = sub + std::int64_t(x) * kDecodeGroup;
          key[x] = (valid && d < D) ? ld(krow + d) : 0.0f;
        }
      }
      float sim = 0.0f;
#pragma unroll
      for (int x = 0; x < kDpl; ++x) {
        const std::int64_t d = sub + std::int64_t(x) * kDecodeGroup;
        if (d < D) sim += key[x] * nk[d];
      }
      sim = group_sum(sim) * kscale;
      float lam = 0.0f;
      bool attend = valid;
      if (cached) {
        const RowUpdate up =
            update_row<Set, kEvict>(a, cut, c.lambda[at], sim, c.key_logit[at], c.pos[at], zq, q_part, t);
        lam = up.lambda;
        attend = up.attend;
        if (sub == 0 && !up.dead) c.lambda[plan != nullptr ? moved_row(c, item, plan->dest(idx)) : at] = up.stored();
        if (sub == 0 && up.evict) atomicAdd(&marked, 1);
      }
      for (std::int64_t h = 0; h < r; ++h) {
        float part = 0.0f;
#pragma unroll
        for (int x = 0; x < kDpl; ++x) {
          const std::int64_t d = sub + std::int64_t(x) * kDecodeGroup;
          if (d < D) part += qs[h * D + d] * key[x];
        }
        part = group_sum(part) * kscale;
        if (sub == 0 && valid)
          wts[h * kDecodeThreads + e] = attend ? part + lam : negative_infinity<float>();  // scale 1
      }
    }
    if (plan != nullptr && e0 < n) move_rows(c, item, e0, n - e0 < ne ? n - e0 : ne, *plan);
    __syncthreads();
    // 3. online softmax step per head over the tile (every thread computes the same max / sum)
    for (std::int64_t h = 0; h < r; ++h) {
      const float mine = wts[h * kDecodeThreads + tid];
      const float tile_max = block_reduce_max(mine, scratch);
      const float old_max = run_max[h];
      const float new_max = tile_max > old_max ? tile_max : old_max;
      const float w = (mine == negative_infinity<float>()) ? 0.0f : expf(mine - new_max);
      const float tile_sum = block_reduce_sum(w, scratch);
      const float rescale = (old_max == negative_infinity<float>() || new_max == negative_infinity<float>())
                                ? 0.0f
                                : expf(old_max - new_max);
      __syncthreads();  // everyone has read run_max[h] and wts[h][tid] before they change
      wts[h * kDecodeThreads + tid] = w;
      for (std::int64_t d = tid; d < D; d += blockDim.x) acc[h * D + d] *= rescale;
      if (tid == 0) {
        run_max[h] = new_max;
        run_sum[h] = run_sum[h] * rescale + tile_sum;
      }
    }
    __syncthreads();
    // 4. p.v: one thread per dim, every head, the tile's value rows in entry order
    auto value_at = [&](std::int64_t id, std::int64_t d) {  // entry id's value (fp8: as stored, scaled)
      if constexpr (is_row_scaled_v<S>) {
        if (id < n) return ld(c.values + c.row(item, id) * D + d) * c.value_scale[c.row(item, id)];
        return fp8_stored_element(ld(new_value + d), new_scale[1]) * new_scale[1];
      } else {
        return ld(id < n ? c.values + c.row(item, id) * D + d : new_value + d);
      }
    };
    for (std::int64_t d = tid; d < D; d += blockDim.x) {
      std::int64_t e = 0;
      for (; e + 4 <= ne; e += 4) {  // four independent loads in flight
        float val[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) val[u] = value_at(e0 + e + u, d);
        for (std::int64_t h = 0; h < r; ++h)
#pragma unroll
          for (int u = 0; u < 4; ++u) acc[h * D + d] += wts[h * kDecodeThreads + e + u] * val[u];
      }
      for (; e < ne; ++e) {
        const float val = value_at(e0 + e, d);
        for (std::int64_t h = 0; h < r; ++h) acc[h * D + d] += wts[h * kDecodeThreads + e] * val;
      }
    }
    __syncthreads();
  }
  for (std::int64_t h = 0; h < r; ++h) {
    const std::int64_t slot = (item * a.splits + split) * r + h;  // P = 1 row
    if (tid == 0) {
      a.part_ml[slot * 2] = run_max[h];
      a.part_ml[slot * 2 + 1] = run_sum[h];
    }
    for (std::int64_t d = tid; d < D; d += blockDim.x) a.part_acc[slot * D + d] = acc[h * D + d];
  }
  __syncthreads();
  return marked;
}

// ---- decode, long caches: entry splits over 16-byte rows ----------------------------------------
// The pass that reads each live row once (spec 4.4 and 4.5 in one sweep): kRowLanes lanes share a cache
// row, each holding kVpl 16-byte vectors of its key and value (8 bf16 per load), so a row is two
// coalesced vector reads. A row group takes kU consecutive rows per step with every load of the kU rows
// in flight before any is used; per row it updates λ from the similarity to the new key, decides the
// eviction, and scores the kR heads of the group; one online-softmax step per head then covers the kU
// rows, the group's accumulators living in registers. Rows that go are marked dead where they lie (λ =
// -inf) instead of being moved: a later step reads only their λ, and the item is compacted only when
// enough rows are dead (decode_item); with a plan, every live row is written, from the registers that
// hold it, to its place in the item's fresh pages. At the end the row groups' states merge in a fixed
// order (within a warp by shuffles, then across warps in shared memory) into this split's partial, the
// partial format of decode_split. Returns the rows this block marked dead.
inline constexpr int kRowLanes = 16;  // lanes per cache row: 16 x 16 bytes = a D 128 bf16 row
inline constexpr int kRowGroupsPerWarp = kWarpSize / kRowLanes;
inline constexpr int kDecodeWarps = kDecodeThreads / kWarpSize;
static_assert(kWarpSize % kRowLanes == 0, "a row group is part of one warp");
__device__ inline float row_sum(float x) {  // over the kRowLanes lanes of a row group
  for (int o = kRowLanes / 2; o > 0; o /= 2) x += warp_shfl_xor(x, o);
  return x;
}
// Whether decode_split_rows serves a cache of this shape: 16-byte rows (vector loads) and a group size it
// is built for; other shapes take decode_split.
__host__ __device__ inline bool vector_decode_ok(std::int64_t D, std::int64_t r, std::size_t elem) {
  return (D * std::int64_t(elem)) % 16 == 0 && (r == 4 || r == 8);
}
// Rows a row group of decode_split_rows takes per step: every load of them is in flight together. Two
// keep the pass within the registers that let two blocks share a multiprocessor at r = 4 with one vector
// per lane (decode_min_blocks).
inline constexpr int kRowsInFlight = 2;
// 16-byte vectors a lane of decode_split_rows holds of a row of D <= 8 kDpl elements of S.
template <class S, int kDpl>
__host__ __device__ constexpr int vectors_per_lane() {
  return (kDpl * int(sizeof(S)) + 31) / 32;
}
// Resident blocks decode_attend_kernel asks its registers to allow: two for the vector-row pass at r = 4
// with one vector per lane (bf16 and fp16 rows up to D 128, fp32 up to D 64; a step of many items runs in
// half the waves), one otherwise, where two would spill the pass's accumulators.
// fp8 rows (16 elements per vector) double the accumulators, hence one block.
template <class S, int kDpl, int kR>
__host__ __device__ constexpr int decode_min_blocks() {
  return kR == 4 && vectors_per_lane<S, kDpl>() == 1 && !is_row_scaled_v<S> ? 2 : 1;
}
// The type decode_split_rows keeps the group's queries in, exactly: the storage type, or float for fp8
// storage, whose inputs are bf16.
template <class S>
using split_rows_query_t = std::conditional_t<is_row_scaled_v<S>, float, S>;
// Shared memory of decode_split_rows: the new token's key and value rows (stored), the group's queries,
// for fp8 the new key as given (float: the λ update reads it, as the host does), then the warps' states.
template <class S>
__host__ __device__ inline std::size_t split_rows_head_bytes(std::int64_t D, std::int64_t r) {
  return 2 * std::size_t(D) * sizeof(S) + std::size_t(r) * std::size_t(D) * sizeof(split_rows_query_t<S>) +
         (is_row_scaled_v<S> ? std::size_t(D) * sizeof(float) : 0);
}
template <class S>
__host__ __device__ inline std::size_t split_rows_smem_bytes(std::int64_t D, std::int64_t r) {
  return split_rows_head_bytes<S>(D, r) +
         std::size_t(kDecodeWarps) * std::size_t(r) * std::size_t(D + 2) * sizeof(float);
}
// The end of a decode pass that leaves one online-softmax state per (warp, head) in shared memory (`red`:
// [warps][r][D + 2] = max, sum, accumulator): merges the warps in warp order (deterministic) into this
// split's partial, the format merge_row reads. On the calling block's threads; ends with a barrier.
template <class S>
__device__ inline void write_split_partial(const DeviceCall<S>& a, const float* red, int r, std::int64_t D,
                                           std::int64_t item, int split) {
  const int dim = int(D), pairs = (dim + 1) / 2;  // two adjacent dims of one head a thread: one max, one sum
  for (int x = int(threadIdx.x); x < r * pairs; x += int(blockDim.x)) {
    const int h = x / pairs, d = (x - h * pairs) * 2;
    const bool two = d + 1 < dim;
    float mx = negative_infinity<float>();
    for (int w = 0; w < kDecodeWarps; ++w) mx = fmaxf(mx, red[(std::size_t(w) * r + h) * std::size_t(D + 2)]);
    float sum = 0.0f, y0 = 0.0f, y1 = 0.0f;
    if (mx != negative_infinity<float>())
      for (int w = 0; w < kDecodeWarps; ++w) {
        const float* w_row = red + (std::size_t(w) * r + h) * std::size_t(D + 2);
        if (w_row[0] == negative_infinity<float>()) continue;
        const float f = expf(w_row[0] - mx);
        sum += f * w_row[1];
        y0 += f * w_row[2 + d];
        if (two) y1 += f * w_row[3 + d];
      }
    const std::int64_t slot = (item * a.splits + split) * r + h;  // P = 1 row
    if (d == 0) {
      a.part_ml[slot * 2] = mx;
      a.part_ml[slot * 2 + 1] = sum;
    }
    a.part_acc[slot * D + d] = y0;
    if (two) a.part_acc[slot * D + d + 1] = y1;
  }
  __syncthreads();
}
template <class Set, bool kEvict, class S, int kVpl, int kR, int kU>
__device__ inline int decode_split_rows(const DeviceCache<S>& c, const DeviceCall<S>& a, std::int64_t item,
                                        std::int64_t b, std::int64_t n, int split, Range range, const MovePlan* plan,
                                        unsigned char* smem) {
  constexpr int kE = int(16 / sizeof(S)), kDims = kVpl * kE;
  const std::int64_t D = c.D, g = item % c.G;
  const std::int64_t e_begin = range.begin, e_end = range.end;
  const std::int64_t t = c.counter[item];
  const prune::Cut cut = item_cut<kEvict>(a, item);
  const int tid = int(threadIdx.x), lane = tid % kWarpSize, warp = tid / kWarpSize, sub = tid % kRowLanes;
  const int grp = lane / kRowLanes;
  // The new token (entry n, λ = 0) and the group's queries stay in shared memory, exactly (the storage
  // type; float for fp8, whose inputs are bf16), and are read where a dot product uses them: held in
  // registers, the queries would take the registers of a second resident block. Their rows are 16-byte
  // aligned, and a lane's 16-byte vectors lie 16 bytes apart from its neighbours', so the reads are free of
  // bank conflicts.
  using Q = split_rows_query_t<S>;
  S* new_k = reinterpret_cast<S*>(smem);
  S* new_v = new_k + D;
  Q* qs = reinterpret_cast<Q*>(new_v + D);                                        // [kR][D]
  float* nk_given = reinterpret_cast<float*>(qs + kR * D);                        // [D], fp8 only
  float* red = reinterpret_cast<float*>(smem + split_rows_head_bytes<S>(D, kR));  // [warps][kR][D + 2]
  __shared__ int marked_block;
  __shared__ float new_scale[2];  // fp8 storage: the scales of the new token's stored rows
  const auto* in_k = a.k + b * a.k_b + g * a.k_g;
  const auto* in_v = a.v + b * a.v_b + g * a.v_g;
  if constexpr (is_row_scaled_v<S>) {  // the new token as the cache will store it
    if (warp == 0) {
      const float sk = store_row_warp(in_k, new_k, D), sv = store_row_warp(in_v, new_v, D);
      if (lane == 0) {
        new_scale[0] = sk;
        new_scale[1] = sv;
      }
    }
  } else {
    for (std::int64_t d = tid; d < D; d += blockDim.x) {
      new_k[d] = in_k[d];
      new_v[d] = in_v[d];
    }
  }
  for (std::int64_t x = tid; x < kR * D; x += blockDim.x) {
    const auto* q = a.q + b * a.q_b + (g * kR + x / D) * a.q_h + x % D;
    if constexpr (is_row_scaled_v<S>)
      qs[x] = ld(q);
    else
      qs[x] = *q;
  }
  if constexpr (is_row_scaled_v<S>)
    for (std::int64_t d = tid; d < D; d += blockDim.x) nk_given[d] = ld(in_k + d);
  if (tid == 0) marked_block = 0;
  __syncthreads();
  // the lane's dims: vectors w = sub + kRowLanes * j, elements w * kE .. w * kE + kE - 1
  const auto dot_part = [&](const float* row, const auto* other) {  // this lane's part of row . other
    using O = std::remove_cv_t<std::remove_pointer_t<decltype(other)>>;
    float part = 0.0f;
#pragma unroll
    for (int j = 0; j < kVpl; ++j) {
      const int w = sub + kRowLanes * j;
      float o[kE];
      if constexpr (std::is_same_v<O, S>) {
        unpack<S>(w * kE < D ? *reinterpret_cast<const uint4*>(other + w * kE) : make_uint4(0, 0, 0, 0), o);
      } else {  // float rows (fp8 storage's queries and new key)
#pragma unroll
        for (int k = 0; k < kE; ++k) o[k] = w * kE < D ? other[w * kE + k] : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kE; ++k) part += row[j * kE + k] * o[k];
    }
    return part;
  };
  float acc[kR][kDims], m[kR], l[kR];
#pragma unroll
  for (int h = 0; h < kR; ++h) {
    m[h] = negative_infinity<float>();
    l[h] = 0.0f;
#pragma unroll
    for (int x = 0; x < kDims; ++x) acc[h][x] = 0.0f;
  }
  const float zq = a.z_q[b * a.zq_b + g * a.zq_g];
  const float q_part = kernel::ua::query_gate_part(zq);
  int marked = 0;
  // warp-uniform loop: a warp's row groups take kU rows each, the warp kRowGroupsPerWarp * kU
  constexpr int kWarpRows = kRowGroupsPerWarp * kU;
  // The rows' places (page table) and λ decide which keys and values are read (a dead row's never are), so
  // each iteration fetches them for the next one while its own keys and values are in flight: one memory
  // latency per iteration instead of three dependent ones (table, λ, row).
  std::int64_t rowi[kU];
  float lam[kU];
  bool cached[kU];
  const auto fetch_meta = [&](std::int64_t base) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const std::int64_t idx = base + u;
      cached[u] = idx < e_end && idx < n;
      rowi[u] = cached[u] ? c.row(item, idx) : 0;
      lam[u] = cached[u] ? c.lambda[rowi[u]] : 0.0f;
    }
  };
  constexpr std::int64_t kStride = std::int64_t(kDecodeWarps) * kWarpRows;
  fetch_meta(e_begin + std::int64_t(warp) * kWarpRows + std::int64_t(grp) * kU);
  for (std::int64_t base_w = e_begin + std::int64_t(warp) * kWarpRows; base_w < e_end; base_w += kStride) {
    const std::int64_t base = base_w + std::int64_t(grp) * kU;
    float zk[kU], ksc[kU], vsc[kU];  // ksc, vsc: fp8 row scales (1 for other storage)
    std::int64_t pos[kU];
    bool live[kU];
    uint4 kr[kU][kVpl], vr[kU][kVpl];
    // 1. every vector of the kU live rows (their places and λ came with the previous iteration)
#pragma unroll
    for (int u = 0; u < kU; ++u) live[u] = base + u < e_end && !(cached[u] && is_dead(lam[u]));
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const S* kp = cached[u] ? c.keys + rowi[u] * D : new_k;
      const S* vp = cached[u] ? c.values + rowi[u] * D : new_v;
#pragma unroll
      for (int j = 0; j < kVpl; ++j) {
        const int w = sub + kRowLanes * j;
        const bool ok = live[u] && w * kE < D;
        kr[u][j] = ok ? *reinterpret_cast<const uint4*>(kp + w * kE) : make_uint4(0, 0, 0, 0);
        vr[u][j] = ok ? *reinterpret_cast<const uint4*>(vp + w * kE) : make_uint4(0, 0, 0, 0);
      }
      const bool meta = cached[u] && live[u];
      zk[u] = meta ? c.key_logit[rowi[u]] : 0.0f;
      pos[u] = meta ? c.pos[rowi[u]] : t;
      ksc[u] = vsc[u] = 1.0f;
      if constexpr (is_row_scaled_v<S>) {
        ksc[u] = meta ? c.key_scale[rowi[u]] : new_scale[0];
        vsc[u] = meta ? c.value_scale[rowi[u]] : new_scale[1];
      }
    }
    // this iteration's places and λ move to registers of their own; the next iteration's are fetched now
    std::int64_t row_now[kU];
    float lam_now[kU];
    bool cached_now[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      row_now[u] = rowi[u];
      lam_now[u] = lam[u];
      cached_now[u] = cached[u];
    }
    fetch_meta(base + kStride);
    // 2. λ update (spec 4.4 step 1), eviction (4.5), the kR logits (scale 1); with a plan, the live row to
    //    its new place
    float s[kU][kR];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      float kf[kDims];
#pragma unroll
      for (int j = 0; j < kVpl; ++j) unpack<S>(kr[u][j], kf + j * kE);
      float sim = 0.0f;  // a set without the similarity gate never reads it
      if constexpr (Set::kNeedsSimilarity) {
        if constexpr (is_row_scaled_v<S>)
          sim = row_sum(dot_part(kf, nk_given)) * ksc[u];  // the new key as given (the host's)
        else
          sim = row_sum(dot_part(kf, new_k));
      }
      float lu = lam_now[u];
      bool attend = live[u];
      if (cached_now[u] && live[u]) {
        const RowUpdate up = update_row<Set, kEvict>(a, cut, lam_now[u], sim, zk[u], pos[u], zq, q_part, t);
        lu = up.lambda;
        attend = up.attend;
        marked += (sub == 0 && up.evict) ? 1 : 0;
        if (plan == nullptr) {
          if (sub == 0) c.lambda[row_now[u]] = up.stored();
        } else {
          const std::int64_t to = moved_row(c, item, plan->dest(base + u));
#pragma unroll
          for (int j = 0; j < kVpl; ++j) {
            const int w = sub + kRowLanes * j;
            if (w * kE < D) {
              *reinterpret_cast<uint4*>(c.keys + to * D + w * kE) = kr[u][j];
              *reinterpret_cast<uint4*>(c.values + to * D + w * kE) = vr[u][j];
            }
          }
          if (sub == 0) {
            c.lambda[to] = up.stored();
            c.key_logit[to] = zk[u];
            c.pos[to] = pos[u];
            if constexpr (is_row_scaled_v<S>) {
              c.key_scale[to] = ksc[u];
              c.value_scale[to] = vsc[u];
            }
          }
        }
      }
#pragma unroll
      for (int h = 0; h < kR; ++h) {
        const float part = row_sum(dot_part(kf, qs + h * D)) * ksc[u];
        s[u][h] = attend ? part + lu : negative_infinity<float>();
      }
    }
    // 3. one online-softmax step per head over the kU rows (the group's lanes hold equal m, l)
#pragma unroll
    for (int h = 0; h < kR; ++h) {
      float mx = m[h];
#pragma unroll
      for (int u = 0; u < kU; ++u) mx = fmaxf(mx, s[u][h]);
      if (mx == negative_infinity<float>()) {
#pragma unroll
        for (int u = 0; u < kU; ++u) s[u][h] = 0.0f;
        continue;
      }
      const float scale = m[h] == negative_infinity<float>() ? 0.0f : expf(m[h] - mx);
      float sum = 0.0f;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        s[u][h] = s[u][h] == negative_infinity<float>() ? 0.0f : expf(s[u][h] - mx);
        sum += s[u][h];
      }
      l[h] = l[h] * scale + sum;
      m[h] = mx;
#pragma unroll
      for (int x = 0; x < kDims; ++x) acc[h][x] *= scale;
    }
    // 4. p.v: each value vector converted once for the kR heads
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      float vf[kDims];
#pragma unroll
      for (int j = 0; j < kVpl; ++j) unpack<S>(vr[u][j], vf + j * kE);
#pragma unroll
      for (int h = 0; h < kR; ++h) {
        const float w = s[u][h] * vsc[u];  // fp8: the row's value scale
#pragma unroll
        for (int x = 0; x < kDims; ++x) acc[h][x] += w * vf[x];
      }
    }
  }
  // 5. merge the row groups: within the warp (the lowest group's lanes keep the result), then the warps
  //    in order through shared memory, into this split's partial
#pragma unroll
  for (int h = 0; h < kR; ++h) {
    for (int o = kRowLanes; o < kWarpSize; o *= 2) {
      const float m_o = warp_shfl_xor(m[h], o), l_o = warp_shfl_xor(l[h], o);
      const float mx = fmaxf(m[h], m_o);
      const float a_self = m[h] == negative_infinity<float>() ? 0.0f : expf(m[h] - mx);
      const float a_other = m_o == negative_infinity<float>() ? 0.0f : expf(m_o - mx);
      l[h] = l[h] * a_self + l_o * a_other;
#pragma unroll
      for (int x = 0; x < kDims; ++x) acc[h][x] = acc[h][x] * a_self + warp_shfl_xor(acc[h][x], o) * a_other;
      m[h] = mx;
    }
    if (lane < kRowLanes) {
      float* w_row = red + (std::size_t(warp) * kR + h) * std::size_t(D + 2);
#pragma unroll
      for (int j = 0; j < kVpl; ++j) {
        const int w = sub + kRowLanes * j;
        if (w * kE < D)
#pragma unroll
          for (int k = 0; k < kE; ++k) w_row[2 + w * kE + k] = acc[h][j * kE + k];
      }
      if (lane == 0) {
        w_row[0] = m[h];
        w_row[1] = l[h];
      }
    }
  }
  if (marked != 0) atomicAdd(&marked_block, marked);
  __syncthreads();
  write_split_partial(a, red, kR, D, item, split);
  return marked_block;
}

// The new token's rows, page place, position and key-gate logit, read by the last block of a long item
// before its merge so that their round trip overlaps the merge's: the key and value rows in 16-byte
// pieces, one per thread of the first 2 * D * sizeof(S) / 16 (`held`: 16-byte rows of a storage without
// row scales, within the block; else append_new_row copies the rows itself). Valid for an append at row n
// of the page table as the step found it (not after a page move).
struct NewRowPrefetch {
  uint4 piece;
  std::int64_t row, t;
  float zk;
  bool held;
};
template <class S>
__device__ inline NewRowPrefetch prefetch_new_row(const DeviceCache<S>& c, const DeviceCall<S>& a, std::int64_t item,
                                                  std::int64_t b, std::int64_t n) {
  const std::int64_t D = c.D, g = item % c.G;
  NewRowPrefetch f;
  f.t = c.counter[item];
  f.row = c.row(item, n);
  f.zk = a.z_k[b * a.zk_b + g * a.zk_g];
  const int per_row = int(D) * int(sizeof(S)) / 16, x = int(threadIdx.x);
  f.held = !is_row_scaled_v<S> && new_rows_vec16(a, D) && 2 * per_row <= int(blockDim.x);
  f.piece = make_uint4(0, 0, 0, 0);
  if (f.held && x < 2 * per_row) {
    const auto* src = x < per_row ? a.k + b * a.k_b + g * a.k_g : a.v + b * a.v_b + g * a.v_g;
    f.piece = reinterpret_cast<const uint4*>(src)[x % per_row];
  }
  return f;
}

// The new token after the rows in use, without a compaction (row n; λ = 0 >= ln p: always kept), and the
// item's length and position; on the calling block's threads. `pre`: what prefetch_new_row read, or nullptr.
template <class S>
__device__ inline void append_new_row(const DeviceCache<S>& c, const DeviceCall<S>& a, std::int64_t item,
                                      std::int64_t b, std::int64_t n, const NewRowPrefetch* pre = nullptr) {
  const std::int64_t D = c.D, g = item % c.G;
  const std::int64_t t = pre ? pre->t : c.counter[item], row = pre ? pre->row : c.row(item, n);
  const float zk = pre ? pre->zk : a.z_k[b * a.zk_b + g * a.zk_g];
  const bool vec = new_rows_vec16(a, D);
  const auto* in_k = a.k + b * a.k_b + g * a.k_g;
  const auto* in_v = a.v + b * a.v_b + g * a.v_g;
  if (pre != nullptr && pre->held) {
    const int per_row = int(D) * int(sizeof(S)) / 16, x = int(threadIdx.x);
    if (x < 2 * per_row)
      reinterpret_cast<uint4*>((x < per_row ? c.keys : c.values) + row * D)[x % per_row] = pre->piece;
  } else if constexpr (is_row_scaled_v<S>) {  // fp8: one warp stores the rows with their scales
    if (threadIdx.x < kWarpSize) {
      const float sk = store_row_warp(in_k, c.keys + row * D, D), sv = store_row_warp(in_v, c.values + row * D, D);
      if (threadIdx.x == 0) {
        c.key_scale[row] = sk;
        c.value_scale[row] = sv;
      }
    }
  } else {
    copy_rows<S>(
        1, D, vec, [&](std::int64_t) { return in_k; }, [&](std::int64_t) { return c.keys + row * D; });
    copy_rows<S>(
        1, D, vec, [&](std::int64_t) { return in_v; }, [&](std::int64_t) { return c.values + row * D; });
  }
  __syncthreads();  // every thread has read the counter
  if (threadIdx.x == 0) {
    c.lambda[row] = 0.0f;
    c.key_logit[row] = zk;
    c.pos[row] = t;
    c.length[item] = n + 1;
    c.counter[item] = t + 1;
  }
}

// Slot step: grid item gi is (row gi / G, kv head gi % G). A 1-token row whose slot runs this step is
// decoded: item = slot * G + g, b = its token. Split 0 of a row that does not run (padding, or a slot
// that step_begin_kernel held back: overflowed) zeroes the row's output rows and lse for the kv head's
// query heads, as the host step does for padding; a prefill row is the chunk launches' work.
template <class S>
__device__ inline bool decode_row(const DeviceCache<S>& c, const DeviceCall<S>& a, std::int64_t gi, std::int64_t& item,
                                  std::int64_t& b) {
  if (*a.step_error != 0) return false;
  const std::int64_t row = gi / c.G, g = gi % c.G;
  const int s = a.row_slot[row];
  const std::int64_t x0 = a.row_start[row], n = a.row_start[row + 1] - x0;
  const bool runs = s >= 0 && a.slot_go[s] != 0;
  if (runs && n == 1) {
    item = s * c.G + g;
    b = x0;
    return true;
  }
  if (!runs && blockIdx.y == 0) {
    const std::int64_t r = c.r, D = c.D;
    for (std::int64_t x = threadIdx.x; x < n * r * D; x += blockDim.x) {
      const std::int64_t t = x / (r * D), h = g * r + (x / D) % r, d = x % D;
      a.out[(x0 + t) * a.o_t + h * a.o_h + d] = 0.0f;
      if (a.lse && d == 0) a.lse[(x0 + t) * a.l_t + h * a.l_h] = 0.0f;
    }
  }
  return false;
}

// ---- decode, long caches on the tensor cores (ua_decode_tc.cuh, NVIDIA only) ----------------------
// decode_split_tc lists a window of kDtcWindow entries' live rows at a time (every thread scans
// kDtcPerThread of them) and attends them in tiles of kDtcRows, each warp through kDtcStages stages of its
// own.
inline constexpr int kDtcRows = 16;  // entries per tile: two n-tiles of S^T, the k of one O^T step
inline constexpr int kDtcStages = 1;
inline constexpr int kDtcWindow = 1024;
inline constexpr int kDtcPerThread = kDtcWindow / kDecodeThreads;
static_assert(kDtcWindow % kDecodeThreads == 0, "every thread scans the same number of a window's entries");
// Resident blocks per multiprocessor the tensor-core pass plans for (decode_splits sizes the launch to one
// wave of them): two, i.e. 16 warps to hide the ALU latencies of the λ update and softmax, which is what one
// stage per warp, windows of 1,024 entries and at most 128 registers per thread are sized for.
inline constexpr int kDtcBlocksPerSm = 2;
// Whether decode_split_tc serves a cache of this shape (bf16 storage is the caller's test): D a multiple
// of 16 (whole k-steps and m-tiles) up to 128 (its accumulators in registers), a group of 4 or 8 heads (rows
// 0-7 of S^T; the new key is row 8).
__host__ __device__ inline bool decode_tc_shape_ok(std::int64_t D, std::int64_t r) {
  return D % 16 == 0 && D >= 16 && D <= 128 && (r == 4 || r == 8);
}
// Byte offsets of decode_split_tc's shared memory: A (the group's queries and the new key, 16 rows), the
// window's list of live entries (page places, λ), the prefix sums of its counts, then every warp's stages.
// Staged rows are pitch = D + 8 elements apart (16 bytes more than a row), so the 8 rows an ldmatrix reads
// fall in different banks. A stage: K rows, V rows, then per entry its page place and position (int64), λ
// and key-gate logit (float), and the addresses of its key and value rows (two pointers, 16-byte aligned).
// After the windows the stages hold the warps' states for the merge.
struct DecodeTcLayout {
  std::int64_t pitch;
  std::size_t qs, list_row, list_lam, counts, stages, meta, src, stage_bytes, bytes;
  __host__ __device__ static std::size_t up128(std::size_t x) { return (x + 127) / 128 * 128; }
  __host__ __device__ DecodeTcLayout(std::int64_t D, std::int64_t r) {
    pitch = D + 8;
    const std::size_t rows = std::size_t(kDtcRows) * std::size_t(pitch) * 2;  // one matrix of a stage, bf16
    qs = 0;
    list_row = up128(qs + rows);
    list_lam = list_row + std::size_t(kDtcWindow) * sizeof(std::int64_t);
    counts = up128(list_lam + std::size_t(kDtcWindow) * sizeof(float));
    stages = up128(counts + std::size_t(kDtcPerThread * kDecodeWarps + 1) * sizeof(int));
    meta = 2 * rows;
    src = meta + std::size_t(kDtcRows) * (2 * sizeof(std::int64_t) + 2 * sizeof(float));  // a multiple of 16
    stage_bytes = up128(src + std::size_t(kDtcRows) * 2 * sizeof(const void*));           // RowPair per entry
    const std::size_t states = std::size_t(kDecodeWarps) * std::size_t(r) * std::size_t(D + 2) * sizeof(float);
    const std::size_t staged = std::size_t(kDecodeWarps) * kDtcStages * stage_bytes;
    bytes = stages + (staged > states ? staged : states);
  }
};

// Dynamic shared memory of decode_attend_kernel: the largest of the paths it takes (vector: the vector-row
// pass, else the entry splits; tc: the tensor-core pass too), the one-block pass and the finish.
template <class S>
__host__ __device__ inline std::size_t decode_kernel_smem_bytes(std::int64_t D, std::int64_t r, bool vector,
                                                                bool tc = false) {
  const std::size_t split = vector ? split_rows_smem_bytes<S>(D, r) : decode_smem_bytes(D, r);
  const std::size_t finish = finish_smem_bytes<S>(D),
                    one_block = OneBlockLayout(D, r, sizeof(S), is_row_scaled_v<S>).bytes;
  std::size_t most = split > finish ? split : finish;
  if (tc) {
    const std::size_t tc_bytes = DecodeTcLayout(D, r).bytes;
    most = most > tc_bytes ? most : tc_bytes;
  }
  return most > one_block ? most : one_block;
}
// Whether the last block of a long item compacts it in place at the end of a step that moved nothing:
// once its dead rows are as many as its kept rows (and at least a page's worth: each compaction moves at
// most the kept rows and follows at least as many evictions, so the rows moved per evicted row stay below
// one), or when the new row would not fit. A shared pool moves its items earlier, into fresh pages
// (reserve_slot), whenever the pool has them.
template <class S>
__device__ inline bool compacts_in_place(const DeviceCache<S>& c, std::int64_t n, std::int64_t dead) {
  if (n + 1 > c.capacity) return true;
  const std::int64_t page = std::int64_t(1) << c.pool.shift, kept = n - dead;
  return dead >= (kept > page ? kept : page);
}
// The end of a step that moved the item's `kept` live rows into fresh pages, on the last block's threads:
// the old pages go back to the pool (every row on them moved or was dead), the spare table becomes the
// page table, the new token follows the moved rows, and the rows this step marked dead (`marks`, moved
// with λ = -inf) are the item's dead rows.
template <class S>
__device__ inline void finish_move(const DeviceCache<S>& c, const DeviceCall<S>& a, std::int64_t item, std::int64_t b,
                                   std::int64_t kept, std::int64_t marks) {
  const DevicePool& p = c.pool;
  const std::int64_t fresh = p.fresh[item], first = item * p.pages_per_item;
  if (threadIdx.x == 0) return_pages(p, item, 0);
  __syncthreads();  // the old page numbers are read before the table is overwritten
  for (std::int64_t j = threadIdx.x; j < fresh; j += blockDim.x) p.table[first + j] = p.spare[first + j];
  __syncthreads();
  if (threadIdx.x == 0) {
    p.held[item] = fresh;
    p.fresh[item] = 0;
    c.dead[item] = marks;
  }
  append_new_row(c, a, item, b, kept);
}
#if KVMEM_GPU_VENDOR_PATHS
// The tensor-core pass (ua_decode_tc.cuh, which backend/cuda/ua.cuh includes on the vendor path): D up to
// kDmax, groups of kR heads.
template <class Set, bool kEvict, int kDmax, int kR>
__device__ inline int decode_split_tc(const DeviceCache<bf16>& c, const DeviceCall<bf16>& a, std::int64_t item,
                                      std::int64_t b, std::int64_t n, int split, Range range, unsigned char* smem);
#endif
// This block's part of a long item's step: the entries of `range` (not empty); returns the rows it marked
// dead. kTc: the tensor-core pass (bf16, a shape decode_tc_ok takes, 16-byte input rows: the host's choice)
// unless the step moves the item's rows; else kR != 0: the vector-row pass for groups of kR query heads,
// else the entry splits.
template <class Set, bool kEvict, class S, int kDpl, int kR, bool kTc = false>
__device__ inline int decode_part(const DeviceCache<S>& c, const DeviceCall<S>& a, std::int64_t item, std::int64_t b,
                                  std::int64_t n, int split, Range range, const MovePlan* plan, unsigned char* smem) {
#if KVMEM_GPU_VENDOR_PATHS
  if constexpr (kTc) {
    static_assert(std::is_same_v<S, bf16> && (kR == 4 || kR == 8), "the tensor-core pass takes bf16 groups of 4 or 8");
    if (plan == nullptr) return decode_split_tc<Set, kEvict, 8 * kDpl, kR>(c, a, item, b, n, split, range, smem);
    // a step that moves the rows: the vector-row pass with one row in flight, fewer registers for
    // kDtcBlocksPerSm blocks
    constexpr int kVpl = vectors_per_lane<S, kDpl>();
    return decode_split_rows<Set, kEvict, S, kVpl, kR, 1>(c, a, item, b, n, split, range, plan, smem);
  }
#else
  static_assert(!kTc, "the tensor-core decode pass exists on the vendor path only");
#endif
  if constexpr (kR != 0) {
    constexpr int kVpl = vectors_per_lane<S, kDpl>();
    return decode_split_rows<Set, kEvict, S, kVpl, kR, kRowsInFlight>(c, a, item, b, n, split, range, plan, smem);
  } else {
    return decode_split<Set, kEvict, S, kDpl>(c, a, item, b, n, split, range, plan, reinterpret_cast<float*>(smem));
  }
}
// Memory ordering of the decode ticket (PTX memory model, GPU scope): the length every block reads
// first is an acquire load, so nothing the block does afterwards (its ticket included) is ordered
// before it; a block that wrote something releases it with an acq_rel fence before its ticket, and
// the last block fences after its ticket before reading the others' writes. (__threadfence is a
// sequentially consistent fence: stronger than needed, and it is the costliest step of an idle block.)
// One decode step of every item in one launch. The device reads each item's true length and picks the
// path: up to kOneBlockMaxKept rows in use, split 0 does the whole step (decode_one_block) and the other
// splits only take their ticket; longer items split their entries over the blocks, and the last block
// merges the partials in split order and finishes the step: it appends the new row after the rows in use,
// compacts the item in place first (compacts_in_place), or, when the step moved the item's live rows
// into fresh pages, swaps the pages (finish_move).
// Every block of an item takes one integer ticket after its part (which block arrives last does not
// change the result); the last one publishes the new length and position. Until then no block of the
// step can see a changed length, and the dead count and the fresh pages change only there too, so every
// block of an item takes the same path. Items run along grid x, splits along y: the blocks are
// dispatched x first, so every item's split 0 starts in the first wave even when the idle splits do not
// all fit at once.
// kDpl: dims per lane of an 8-lane group (>= ceil(D / 8)).
// Returns true in the one block that answers for grid item blockIdx.x: the last block of an item it
// decodes, or split 0 of one it does not (a padding or prefill row, a slot that does not run).
template <class Set, bool kEvict, class S, int kDpl, int kR, bool kTc>
__device__ inline bool decode_item(const DeviceCache<S>& c, const DeviceCall<S>& a, unsigned char* smem) {
  std::int64_t item = blockIdx.x, b = item / c.G;
  if (a.row_slot != nullptr && !decode_row(c, a, blockIdx.x, item, b)) return blockIdx.y == 0;
  if (a.row_slot == nullptr && a.slot_go != nullptr && a.slot_go[b] == 0) return blockIdx.y == 0;  // pool dry
  const std::int64_t n = ptx::load_acquire(c.length + item);
  const int split = int(blockIdx.y);
  const bool one_block = n <= kOneBlockMaxKept;
  const bool moves = !one_block && c.pool.fresh != nullptr && c.pool.fresh[item] != 0;
  __shared__ MovePlan plan;
  int marked = 0;
  bool wrote = false;
  std::int64_t own_length = -1;  // the one-block pass's new length, in the block that ran it
  if (one_block) {
    if (split == 0) {
      own_length = decode_one_block<Set, kEvict, S, kDpl>(c, a, item, b, n, smem);
      if (threadIdx.x == 0) c.next_length[item] = own_length;
      wrote = true;
    }
  } else if (const Range range = decode_range(n + 1, a.splits, split); range.begin < range.end) {
    const bool plans = moves && range.begin < n;  // a range of the new token alone moves nothing
    if (plans) plan_moves(c, item, range.begin, range.end < n ? range.end : n, plan);
    marked = decode_part<Set, kEvict, S, kDpl, kR, kTc>(c, a, item, b, n, split, range, plans ? &plan : nullptr, smem);
    wrote = true;
  }
  __shared__ int last;
  if (threadIdx.x == 0 && marked != 0)
    atomicAdd(reinterpret_cast<unsigned long long*>(c.marks + item), (unsigned long long)marked);
  if (wrote) ptx::fence_acq_rel_gpu();  // this block's rows, λ, marks, partial and next length before its ticket
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(c.done + item, 1) == int(gridDim.y) - 1 ? 1 : 0;
  __syncthreads();
  if (!last) return false;
  ptx::fence_acq_rel_gpu();
  if (one_block) {  // compacted in the pass: no dead row is left
    if (threadIdx.x == 0) {
      // the block that ran the pass knows the length (usually the last: the other splits only take tickets)
      const std::int64_t length = own_length >= 0 ? own_length : load_cg(c.next_length + item);
      c.length[item] = length;
      c.dead[item] = 0;
      c.counter[item] += 1;
      if (c.pool.table != nullptr) return_pages(c.pool, item, length);  // own pages: publishing counts them
    }
  } else {
    // the dead count, this step's marks and (where the step moves no rows) the new row, in flight with
    // the merge's loads
    const std::int64_t dead = c.dead[item], marks = load_cg(c.marks + item);
    NewRowPrefetch fresh{};
    if (!moves && n + 1 <= c.capacity) fresh = prefetch_new_row(c, a, item, b, n);  // else it compacts
    merge_row(c, a, item, b, 0, 0, active_splits(n + 1, a.splits, kDecodePiece));
    if (moves)
      finish_move(c, a, item, b, n - dead, marks);
    else if (compacts_in_place(c, n, dead + marks))
      finish_item<kEvict>(c, a, item, b, 0, 1, true, dead + marks, smem);  // the attention buffers are free now
    else {
      append_new_row(c, a, item, b, n, &fresh);
      if (threadIdx.x == 0) c.dead[item] = dead + marks;
    }
    if (threadIdx.x == 0) c.marks[item] = 0;
  }
  if (threadIdx.x == 0) c.done[item] = 0;
  return true;
}
// grid (I or rows * G, splits), block kDecodeThreads, dynamic smem decode_kernel_smem_bytes<S>(D, r, kR != 0,
// kTc). Two resident blocks per multiprocessor where the vector-row pass fits them (decode_min_blocks), which
// also doubles the one-block pass's residency in this kernel; kDtcBlocksPerSm with the tensor-core pass
// (kTc), whose stages and registers are sized for it.
// A step whose last launch this is publishes from the last of the blocks that answer for a grid item
// (every page move of the launch is one of theirs), not from every block: a ticket per grid item, not per
// block.
// (The bound is parenthesised: hipcc's __launch_bounds__ is a macro, which a template argument list's commas
// would split.)
template <class Set, bool kEvict, class S, int kDpl, int kR, bool kTc = false>
__global__ void __launch_bounds__(kDecodeThreads, (kTc ? kDtcBlocksPerSm : decode_min_blocks<S, kDpl, kR>()))
    decode_attend_kernel(DeviceCache<S> c, DeviceCall<S> a) {
  extern __shared__ __align__(16) unsigned char dsm[];
  const bool answers = decode_item<Set, kEvict, S, kDpl, kR, kTc>(c, a, dsm);
  if (a.publish_ticket != nullptr && answers) publish_if_last(c.pool, a.publish_ticket, gridDim.x);
}

// ---- the pages a call takes before it runs -------------------------------------------------------
// The pages slot s takes from a shared pool before `tokens` of its tokens run (DevicePool: in the first
// kernel of a step or fixed-batch call), all of them or none; false, the pool unchanged, when it cannot
// give them. Each kv head's table grows to the pages of min(length + tokens, capacity) rows: the rows the
// call can touch, as a compaction comes before any append past the capacity. A decode (tokens = 1, and
// `splits` > 0: the splits of the decode launch that follows) of a long item whose dead rows reach a
// page's worth asks instead for fresh pages for its live rows and the new one, and the decode moves its
// rows there (decode_item; every range of that launch fits a plan); when the pool cannot give those, the
// slot asks again without moving. A call that runs no decode launch passes splits = 0.
template <class S>
__device__ inline bool reserve_slot(const DeviceCache<S>& c, std::int64_t s, std::int64_t tokens, int splits,
                                    unsigned long long* free_count = nullptr) {
  const DevicePool& p = c.pool;
  const auto moves = [&](std::int64_t it) {
    const std::int64_t n = c.length[it];
    return tokens == 1 && splits > 0 && n > kOneBlockMaxKept && c.dead[it] >= (std::int64_t(1) << p.shift) &&
           plan_fits(n, splits);
  };
  const auto grown = [&](std::int64_t it) {
    return p.pages_for(c.length[it] + tokens < c.capacity ? c.length[it] + tokens : c.capacity);
  };
  bool any = false;
  for (std::int64_t g = 0; g < c.G; ++g) any = any || moves(s * c.G + g);
  for (int attempt = any ? 0 : 1; attempt < 2; ++attempt) {
    const bool moving = attempt == 0;
    std::int64_t k = 0;
    for (std::int64_t g = 0; g < c.G; ++g) {
      const std::int64_t it = s * c.G + g, held = p.held[it];
      if (moving && moves(it))
        k += p.pages_for(c.length[it] - c.dead[it] + 1);
      else
        k += grown(it) > held ? grown(it) - held : 0;
    }
    std::int64_t first = 0;
    if (!pop_pages(p, k, first, free_count)) continue;
    std::int64_t next = first + k;
    for (std::int64_t g = 0; g < c.G; ++g) {
      const std::int64_t it = s * c.G + g;
      if (moving && moves(it)) {
        const std::int64_t fresh = p.pages_for(c.length[it] - c.dead[it] + 1);
        for (std::int64_t j = 0; j < fresh; ++j) p.spare[it * p.pages_per_item + j] = p.free_list[--next];
        p.fresh[it] = fresh;
      } else {
        assign_pages(p, it, grown(it), next);
      }
    }
    return true;
  }
  return false;
}

// ---- slot step: the rows' check and the per-row decisions, on the device ------------------------
// The rows of a step live in device memory, so they are checked here, before any kernel of the step
// changes the cache (DESIGN.md 3: validation first; no host round trip, so a captured graph replays).
// One block: it zeroes the per-step scratch, checks every row as core/slots.hpp validate_rows does
// (query_start[0] = 0, non-decreasing, the last = tokens; slots in [-1, max_slots), each at most once;
// a row naming a slot within the rows' max_query_len, from which the host sized the prefill rounds)
// and records the first refused row (lowest row, then lowest check) in `error`. A refused step runs
// nothing, and the error is sticky: every later step is refused too until UaCache::step_status reads
// and clears it, so an engine replaying a graph cannot miss a refused step (a slot operation whose list
// the device refused, slot_lists.cuh, refuses the later steps the same way). Otherwise each row of a slot with tokens
// decides whether it runs: its slot is not flagged as overflowed, every kv head of it has room for kept + tokens
// rows and the pool gives their pages (see the kernel); a row that does not run flags its slot and is skipped, while
// the other rows run.
enum StepCheck : int {
  kStepOk = 0,
  kStepFirstStart = 1,  // query_start[0] != 0
  kStepDecreasing = 2,  // query_start[r + 1] < query_start[r]
  kStepLastStart = 3,   // query_start[rows] != tokens
  kStepSlotRange = 4,   // slot[r] outside [-1, max_slots)
  kStepSlotTwice = 5,   // slot[r] used by an earlier row
  kStepOverBound = 6,   // row r names a slot and holds more than max_query_len tokens
};
struct StepRows {
  const std::int32_t* slot = nullptr;   // [rows]
  const std::int32_t* start = nullptr;  // [rows + 1]
  std::int64_t rows = 0, tokens = 0, max_slots = 0;
  std::int64_t max_len = 0;      // Rows::max_query_len (0: no bound)
  int splits = 1;                // the step's decode launch's splits (reserve_slot)
  int* go = nullptr;             // [max_slots] out: 1 = the slot's row runs this step
  int* first = nullptr;          // [max_slots] scratch: first row naming the slot
  int* overflow = nullptr;       // [max_slots] sticky: the slot ran out of rows
  int* error = nullptr;          // [4] out: check (StepCheck), row, two values it saw
  int* prefill_rows = nullptr;   // [max_slots] out: running rows of >= 2 tokens (DeviceCall::prefill_rows)
  int* prefill_count = nullptr;  // out
};
inline constexpr int kStepBeginThreads = 512;
template <class S>
__global__ void __launch_bounds__(kStepBeginThreads) step_begin_kernel(DeviceCache<S> c, StepRows sr) {
  __shared__ long long worst;  // (row + 1) * 8 + check of the first refused row; LLONG_MAX: none
  __shared__ int prefills;
  const int tid = int(threadIdx.x), threads = int(blockDim.x);
  if (tid == 0) {
    worst = LLONG_MAX;
    prefills = 0;
  }
  for (std::int64_t s = tid; s < sr.max_slots; s += threads) {
    sr.go[s] = 0;
    sr.first[s] = INT_MAX;
  }
  if (sr.error[0] != kStepOk) {  // an earlier refusal not yet read: refuse this step too
    if (tid == 0) *sr.prefill_count = 0;
    return;
  }
  __syncthreads();
  const auto refuse = [&](std::int64_t row, int check) { atomicMin(&worst, (long long)((row + 1) * 8 + check)); };
  if (tid == 0) {
    if (sr.start[0] != 0) refuse(-1, kStepFirstStart);
    if (sr.start[sr.rows] != sr.tokens) refuse(sr.rows, kStepLastStart);
  }
  for (std::int64_t row = tid; row < sr.rows; row += threads) {
    const int s = sr.slot[row];
    if (sr.start[row + 1] < sr.start[row])
      refuse(row, kStepDecreasing);
    else if (s < -1 || s >= sr.max_slots)
      refuse(row, kStepSlotRange);
    else if (s >= 0)
      atomicMin(sr.first + s, int(row));
  }
  __syncthreads();
  for (std::int64_t row = tid; row < sr.rows; row += threads) {
    const int s = sr.slot[row];
    if (s >= 0 && s < sr.max_slots && sr.first[s] != int(row)) refuse(row, kStepSlotTwice);
    if (s >= 0 && sr.max_len > 0 && sr.start[row + 1] - sr.start[row] > sr.max_len) refuse(row, kStepOverBound);
  }
  __syncthreads();
  if (worst != LLONG_MAX) {
    if (tid == 0) {
      const int check = int(worst % 8);
      const std::int64_t row = worst / 8 - 1;
      sr.error[0] = check;
      sr.error[1] = int(row);
      sr.error[2] = check == kStepFirstStart   ? sr.start[0]
                    : check == kStepLastStart  ? sr.start[sr.rows]
                    : check == kStepDecreasing ? sr.start[row]
                    : check == kStepOverBound  ? sr.start[row + 1] - sr.start[row]
                                               : sr.slot[row];
      sr.error[3] = check == kStepDecreasing  ? sr.start[row + 1]
                    : check == kStepOverBound ? int(sr.max_len < INT_MAX ? sr.max_len : INT_MAX)
                                              : 0;
    }
    if (tid == 0) *sr.prefill_count = 0;
    return;  // every go flag is 0, and every kernel of the step reads the error first
  }
  if (tid == 0) sr.error[0] = kStepOk;
  __shared__ unsigned long long free_pages;
  hold_free_count(c.pool, free_pages);
  // Room and pages (DevicePool): a row runs when its slot is not flagged, has room for kept + tokens rows
  // in every kv head (eviction is data-dependent: the host backend's bound) and gets its pages, all of
  // them or none (reserve_slot; a decode row: at most one page per kv head, as the host takes it, or the
  // fresh pages its live rows move into); a row
  // that does not run flags its slot (sticky until the slot is reset, copied over or imported) and is
  // skipped while the other rows run. After a barrier, a slot that found the pool dry returns its pages.
  for (std::int64_t row = tid; row < sr.rows; row += threads) {
    const int s = sr.slot[row];
    const std::int64_t n = sr.start[row + 1] - sr.start[row];
    if (s < 0 || n == 0) continue;
    if (sr.overflow[s] != 0) continue;  // flagged by an earlier step: skipped until reset
    // room as the host counts it: kept rows (dead ones go at the item's next compaction)
    const bool own = c.pool.table == nullptr;  // own pages: publishing counts them, nothing to take
    bool room = true;
#pragma unroll 4
    for (std::int64_t g = 0; g < c.G; ++g) {  // every kv head's counts loaded together
      const std::int64_t it = s * c.G + g;
      const bool fits = c.length[it] - c.dead[it] + n <= c.capacity;
      room = room && fits;
    }
    if (room && (own || reserve_slot(c, s, n, sr.splits, &free_pages))) {
      sr.go[s] = 1;
      if (n >= 2) sr.prefill_rows[atomicAdd(&prefills, 1)] = int(row);
    } else {
      sr.overflow[s] = 1;
      // a slot without room keeps its rows (the step skips its row); one that found the pool dry is
      // emptied, its pages going back below (the host's overflow)
      if (room) sr.first[s] = -1;
    }
  }
  release_free_count(c.pool, free_pages);
  for (std::int64_t s = tid; s < sr.max_slots; s += threads) {
    if (sr.first[s] != -1) continue;
    for (std::int64_t g = 0; g < c.G; ++g) {
      return_pages(c.pool, s * c.G + g, 0);
      c.length[s * c.G + g] = 0;
      c.dead[s * c.G + g] = 0;
    }
  }
  __syncthreads();
  if (tid == 0) *sr.prefill_count = prefills;
}

// Slot operations. The lists of reset_slots and copy_slots are in device memory and checked by
// slot_lists::slot_list_check_kernel, their first launch, which writes a refusal into the step status
// word (`error`); each launch below reads that word first and does nothing while it holds a refusal
// (that list's, or one not yet read), so a refused list changes nothing.
//
// reset: grid (n), one thread per kv head: empty the slot (its pages back to the pool), restart its
// positions, clear its flag. slots != nullptr: block i takes slots[i] when the check's scratch word of
// the slot (`first`) names entry i, so a slot listed twice is reset once (its pages return once);
// slots == nullptr (no list, no check): the one slot `one`, or with one < 0 slot blockIdx.x.
template <class S>
__global__ void reset_slots_kernel(DeviceCache<S> c, int* overflow, const std::int32_t* slots, std::int32_t one,
                                   const int* error, const int* first) {
  std::int64_t s = one >= 0 ? one : std::int64_t(blockIdx.x);
  if (slots != nullptr) {
    if (slot_lists::refused(error)) return;
    s = slots[blockIdx.x];
    if ((first[s] & slot_lists::kIndexMask) != int(blockIdx.x)) return;
  }
  for (std::int64_t g = threadIdx.x; g < c.G; g += blockDim.x) {
    return_pages(c.pool, s * c.G + g, 0);
    c.length[s * c.G + g] = 0;
    c.dead[s * c.G + g] = 0;
    c.counter[s * c.G + g] = 0;
  }
  if (threadIdx.x == 0) overflow[s] = 0;
}
// Page counts in a status word (int): larger counts show as INT_MAX.
__device__ inline int status_count(std::int64_t x) {
  return x > INT_MAX ? INT_MAX : int(x);
}
// copy, first launch after the check (one thread): the destinations' pages. Every destination item
// returns its pages and takes those of its source's rows, when the pool can give them all; otherwise
// nothing changes and the copy is refused whole (the host's rule) through the status word: code
// slot_lists::kCopyPoolDry, then the pages needed, the free pages and the pages the destinations
// would return (the host's check_pool message).
template <class S>
__global__ void copy_pages_kernel(DeviceCache<S> c, const std::int32_t* src, const std::int32_t* dst, std::int64_t n,
                                  int* error) {
  if (slot_lists::refused(error)) return;
  const std::int64_t rows_per_page = std::int64_t(1) << c.pool.shift;
  std::int64_t need = 0, back = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    if (src[i] == dst[i]) continue;
    for (std::int64_t g = 0; g < c.G; ++g) {
      need += (c.length[src[i] * c.G + g] + rows_per_page - 1) / rows_per_page;
      back += c.pool.held[dst[i] * c.G + g];
    }
  }
  const std::int64_t free = *static_cast<volatile std::int64_t*>(c.pool.stats);
  if (free + back < need) {
    error[1] = status_count(need);
    error[2] = status_count(free);
    error[3] = status_count(back);
    error[0] = slot_lists::kCopyPoolDry;
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) {
    if (src[i] == dst[i]) continue;
    for (std::int64_t g = 0; g < c.G; ++g) return_pages(c.pool, dst[i] * c.G + g, 0);
  }
  for (std::int64_t i = 0; i < n; ++i) {
    if (src[i] == dst[i]) continue;
    for (std::int64_t g = 0; g < c.G; ++g) (void)take_pages(c.pool, dst[i] * c.G + g, c.length[src[i] * c.G + g]);
  }
}
// import, before the rows are copied in (one thread): slot `slot` returns its pages and takes those of
// the record's lengths [G] (device memory), when the pool can give them; else nothing changes and
// report[0] is set (report: refused (0/1), pages needed, free pages, pages the slot returns; import_slot
// reads it back).
template <class S>
__global__ void import_pages_kernel(DeviceCache<S> c, std::int64_t slot, const std::int64_t* lengths,
                                    std::int64_t* report) {
  const std::int64_t rows_per_page = std::int64_t(1) << c.pool.shift;
  std::int64_t need = 0, back = 0;
  for (std::int64_t g = 0; g < c.G; ++g) {
    need += (lengths[g] + rows_per_page - 1) / rows_per_page;
    back += c.pool.held[slot * c.G + g];
  }
  const std::int64_t free = *static_cast<volatile std::int64_t*>(c.pool.stats);
  report[0] = free + back < need ? 1 : 0;
  report[1] = need;
  report[2] = free;
  report[3] = back;
  if (report[0] != 0) return;
  for (std::int64_t g = 0; g < c.G; ++g) return_pages(c.pool, slot * c.G + g, 0);
  for (std::int64_t g = 0; g < c.G; ++g) (void)take_pages(c.pool, slot * c.G + g, lengths[g]);
}
// copy, last launch: grid (n, G): item (src, g) into (dst, g), every kept row through both page maps,
// the counters and the overflow flag. No destination is a source of another pair, so the blocks never
// read what another block writes.
template <class S>
__global__ void copy_slots_kernel(DeviceCache<S> c, int* overflow, const std::int32_t* src, const std::int32_t* dst,
                                  const int* error) {
  if (slot_lists::refused(error)) return;
  const std::int64_t from_slot = src[blockIdx.x], to_slot = dst[blockIdx.x], g = blockIdx.y;
  if (from_slot == to_slot) return;
  const std::int64_t from = from_slot * c.G + g, to = to_slot * c.G + g, n = c.length[from];
  for (std::int64_t x = threadIdx.x; x < n * c.D; x += blockDim.x) {
    const std::int64_t e = x / c.D, d = x % c.D, f = c.row(from, e) * c.D + d, t = c.row(to, e) * c.D + d;
    c.keys[t] = c.keys[f];
    c.values[t] = c.values[f];
  }
  for (std::int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    const std::int64_t f = c.row(from, e), t = c.row(to, e);
    c.lambda[t] = c.lambda[f];
    c.key_logit[t] = c.key_logit[f];
    c.pos[t] = c.pos[f];
    if constexpr (is_row_scaled_v<S>) {
      c.key_scale[t] = c.key_scale[f];
      c.value_scale[t] = c.value_scale[f];
    }
  }
  if (threadIdx.x == 0) {
    c.length[to] = n;
    c.dead[to] = c.dead[from];
    c.counter[to] = c.counter[from];
    if (g == 0) overflow[to_slot] = overflow[from_slot];
  }
}

// A fixed-batch call (ua_prefill, ua_decode): one block, before the call's kernels. Sequence b runs
// (go[b] = 1) when its slot is not flagged and got the pages of its T rows (reserve_slot, all or none,
// as a step takes them; a.splits is the decode launch's, 0 for a prefill); otherwise the slot is
// flagged, after a barrier its pages go back, and its output rows (and lse) are zeroed, as the host's
// finish_batch does.
template <class S>
__global__ void batch_reserve_kernel(DeviceCache<S> c, DeviceCall<S> a, int* go, int* overflow, std::int64_t B,
                                     std::int64_t T) {
  __shared__ unsigned long long free_pages;
  hold_free_count(c.pool, free_pages);
  for (std::int64_t s = threadIdx.x; s < B; s += blockDim.x)
    go[s] = overflow[s] == 0 && reserve_slot(c, s, T, a.splits, &free_pages) ? 1 : 0;
  release_free_count(c.pool, free_pages);
  const std::int64_t H = c.G * c.r, D = c.D;
  for (std::int64_t s = 0; s < B; ++s) {
    if (go[s] != 0) continue;
    if (threadIdx.x == 0) {
      for (std::int64_t g = 0; g < c.G; ++g) {
        return_pages(c.pool, s * c.G + g, 0);
        c.length[s * c.G + g] = 0;
        c.dead[s * c.G + g] = 0;
      }
      overflow[s] = 1;
    }
    for (std::int64_t x = threadIdx.x; x < T * H * D; x += blockDim.x) {
      const std::int64_t t = x / (H * D), h = (x / D) % H, d = x % D;
      a.out[s * a.o_b + t * a.o_t + h * a.o_h + d] = 0.0f;
      if (a.lse && d == 0) a.lse[s * a.l_b + h * a.l_h + t * a.l_t] = 0.0f;
    }
  }
}

// Every slot empty, every page free (page p is the (P-1-p)-th popped, the host's order), the device
// bookkeeping zeroed. grid-stride over the largest array.
template <class S>
__global__ void init_cache_kernel(DeviceCache<S> c, std::int64_t items, std::int64_t slots, std::int64_t pages,
                                  int* overflow, int* step_error, int* publish_ticket) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < pages; i += stride) {
    c.pool.free_list[i] = std::int32_t(pages - 1 - i);
  }
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < items; i += stride) {
    c.length[i] = 0;
    c.dead[i] = 0;
    c.counter[i] = 0;
    c.done[i] = 0;
    c.next_length[i] = 0;
    c.marks[i] = 0;
    c.pool.held[i] = 0;
    if (c.pool.fresh != nullptr) c.pool.fresh[i] = 0;
  }
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < slots; i += stride) overflow[i] = 0;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    for (int k = 0; k < 4; ++k) step_error[k] = 0;
    *publish_ticket = 0;
    c.pool.stats[0] = pages;
    c.pool.stats[1] = c.pool.stats[2] = 0;
    if (c.pool.mirror != nullptr) {
      c.pool.mirror[0] = pages;
      c.pool.mirror[1] = c.pool.mirror[2] = 0;
    }
  }
}

}  // namespace kvmem::cuda::ua_detail
