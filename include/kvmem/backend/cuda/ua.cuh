// SPDX-License-Identifier: Apache-2.0
#pragma once
// Universal Attention on the CUDA backend (spec UA.md).
//
//   kvmem::cuda::UaCache<S>          the pruned cache in device memory, owning (create) or placed over
//                                    caller memory (place, attach_workspace): max_slots() =
//                                    CacheShape::batch sequence slots; per (slot, kv head) a
//                                    variable-length list of (key, value, λ, z_k, position) rows in
//                                    ascending position, kept in pages of the host's page layout (one
//                                    pool, a page table per (slot, kv head), a free list), a length and
//                                    an absolute position counter, and per slot an overflow flag, all on
//                                    the device;
//   kvmem::ua::step<Set>(exec, cache, rows, in, opt, out, lse)  a ragged batch of slots (DESIGN.md 3):
//                                    the host ua::step's arguments, packed token-major, in device memory
//   kvmem::ua::reset_slots / copy_slots / export_bytes / export_slot / import_slot / truncate
//                                    the host's slot operations (ua/slots.hpp) for this cache
//   kvmem::ua::prefill<Set>(exec, cache, in, opt, out)   every slot: chunked prefill with pruning (4.5)
//   kvmem::ua::decode<Set>(exec, cache, in1, opt, out1)  every slot: one self-pruning decode step
//   kvmem::ua::forward<Set>(exec, in, out, lse, lambda_last)  dense UA (p = 0)
//                                    the host's calls and argument order (ua/ops.hpp); the same as
//                                    kvmem::cuda::ua_prefill / ua_decode / ua_forward, whose forward also
//                                    takes a scratch cache (no allocation, no synchronisation)
//   kvmem::ua::cache_t<cuda::Executor, S>  is cuda::UaCache<S> (ua::Backend), as on every backend
// Inputs live in device memory: q, k, v (and the optional output-gate logits z_o) in the storage type S
// (float, bf16 or fp16), or bf16 for an fp8 cache (S = kvmem::e4m3: keys and values stored in e4m3 with
// one scale per row, docs/compose.md), the gate logits z_k, z_q in fp32; outputs are fp32. λ and the decay sums are
// fp32 throughout. Results are deterministic: partials of the entry splits are merged in split order,
// never with float atomics (an integer ticket only picks which block of a decode step does the merge).
//
// ua::step takes every per-row decision on the device from the device counters (the rows' check, the
// room check that flags a full slot and skips its row while the others step on, λ update, append,
// eviction, compaction), and its launches and grids depend only on the row count, the token count and
// the cache: no allocation, no host synchronisation and no host state, so one CUDA graph captured for a
// padded batch replays step after step. Pages (docs/memory.md): step_begin_kernel takes, for every row
// that runs, the pages of its slot's kept + tokens rows per kv head before any other kernel of the step
// (a decode row: at most one page, as the host takes it; a prefill row: its worst case before eviction,
// where the host takes them chunk by chunk); a dry pool flags that slot, returns its pages and skips its
// row while the others run; the end of each row's work returns the pages past its survivors. The slot
// operations reset_slots and copy_slots check their device slot lists on the device too
// (slot_lists.cuh), and copy_slots asks the pool for its pages there: a refusal changes nothing and is
// reported through step_status like a refused step's, so they never synchronise and capture like a
// step. Records are the host's UA record, so a slot moves between backends.
//
// The fixed-batch calls (ua_prefill, ua_decode) advance every slot by the call's T. They keep a host
// bound on the cache length: when it says a call might not fit (longest + T > capacity), the call first
// reads the true lengths back (one synchronisation) and refuses the call if one item lacks room. A step
// leaves the bound unknown, so the next fixed-batch call reads the lengths back; a captured ua_decode
// replays without advancing the bound, so engines capture ua::step instead. With a shared pool they take
// their pages like a step (batch_reserve_kernel): a sequence whose slot finds the pool dry is skipped, its
// outputs zeroed; over items that own their pages (pool_pages = 0) every sequence runs and no kernel
// counts pages: publishing counts them from the kept rows (docs/memory.md).
// UaCache::create and place allocate the cache's mapped counter block and wait for their initialisation
// (their own stream, not the device); ua_forward without a scratch cache allocates one and synchronises;
// the accessors position, positions, lengths, pages, download, overflowed and step_status read the
// device and synchronise. The occupancy accessors (free_pages, pages_in_use, pages_taken,
// pages_returned) read the mapped block and never synchronise; a step fills it from the last block of its
// last kernel (no launch of its own); a fixed-batch ua_decode over items that own their pages does no page
// accounting and leaves that block as it was (publish_occupancy brings it up to date).
// A decode step of an item longer than kOneBlockMaxKept rows reads every live row once, split over enough
// blocks to give every multiprocessor two (decode_split_rows: 16-byte vector rows, the λ update, the
// eviction and the attention in one pass; decode_split for other shapes). It marks evicted rows dead in
// place (λ = -inf) instead of moving kept rows. Over a shared pool, once an item's dead rows reach a page's
// worth, its next decode step moves the live rows into fresh pages taken by the step's first kernel while
// its blocks read them (reserve_slot, plan_moves, finish_move: no block waits for another) and returns the
// old pages at its end; over own pages, or when the pool has no fresh pages, the item's last block compacts
// it in place once its dead rows are as many as its kept rows (compacts_in_place), so compaction moves at
// most one row per evicted row over time. lengths, download, export_slot and the room checks see the kept
// rows only; a shared pool counts the pages of the rows in use, own pages publish those of the kept rows;
// a prefill drops the dead rows first. The launches of a pruned prefill on the dense kernel (below) leave the
// rows they evict dead in place the same way while they are under a sixteenth of an item's rows
// (prune_compact_kernel).
// A prefill with p = 0 (nothing is evicted) in bf16 with D in {64, 80, 128} and r in {4, 8} on a cache with
// pool_pages = 0 (contiguous items) runs every row of the call in one pipelined tensor-core launch
// (ua_dense_tc.cuh); every other prefill, and every
// prefill row of a step, runs chunk by chunk (ua_kernels.cuh, ua_attend_tc.cuh; on AMD GPUs every prefill,
// whose bf16 chunks of those shapes take the matrix cores: ua_attend_mfma.cuh).
//
// Shapes and options are validated (messages name the argument); values (NaN/Inf) are the caller's
// precondition here, as on the CUDA KVM path: checking them would cost a device-to-host round trip.

#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvmem/backend/cuda/common.cuh"
#if KVMEM_GPU_VENDOR_PATHS
#include "kvmem/backend/cuda/ua_attend_tc.cuh"
#include "kvmem/backend/cuda/ua_decode_tc.cuh"
#endif
#if KVMEM_GPU_MFMA_PATHS
#include "kvmem/backend/cuda/ua_attend_mfma.cuh"
#endif
#include "kvmem/backend/cuda/ua_dense_tc.cuh"
#include "kvmem/backend/cuda/ua_kernels.cuh"
#include "kvmem/backend/cuda/ua_prune.cuh"
#include "kvmem/core/arena.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/policy/decay.hpp"
#include "kvmem/ua/cache.hpp"
#include "kvmem/ua/ops.hpp"

namespace kvmem::cuda {

// One call's inputs in device memory (q, k, v, z_o in the storage type S, bf16 for an fp8 cache:
// input_type_t; gate logits fp32).
template <class S>
using UaInputs = ua::InputsOf<input_type_t<S>>;

// Sizes of the per-step workspace (UaCache::workspace_bytes): B*G*max_splits*r*max_prefill_chunk*(D+2)
// floats of split partials (134 MB at B8 G4 r4 D128 with the defaults) and B*G*max_prefill_chunk λ,
// plus, with pool_pages = 0, 8 bytes per cache row for the dense tensor-core prefill's λ hand-off; and
// from which call length the dense prefill takes its kernel with the skip past the decay's reach.
struct UaCacheLimits {
  std::int64_t max_prefill_chunk = 128;  // largest Options::prefill_chunk a prefill may use (<= 1024)
  int max_splits = 16;                   // entry splits per (sequence, kv head): parallelism of a call
  // The dense tensor-core prefill on sm_90a (bf16, D 64 or 128, p = 0): a call whose longest row tile may see
  // more than this many 64-entry tiles (the cache's longest bound plus the call's tokens) runs the kernel
  // that skips the value tile and P V of the entry tiles predicted past the decay's reach. Below the default
  // (calls up to 8K rows) the skip's code costs more than it saves; 0: every call skips. The results are the
  // same bits either way.
  int dense_skip_past_after_tiles = ua_detail::kDnSkipPastAfterTiles;
  // The dense tensor-core prefill hands its row tiles out item group by item group (an item is a (sequence,
  // kv head)): the row tiles of this many items run together, row tile k of each before row tile k + 1. A
  // smaller group keeps an item's concurrent row tiles closer together in their walk over its keys and
  // values, which are then read from L2 rather than DRAM; too small a group leaves too many of an item's
  // row tiles waiting for λ from the one before. 0 (default): about ua_detail::kDnRowTilesInFlight row tiles
  // of each item in flight on this device (dense_item_group_for). Results are the same bits for every group.
  int dense_item_group = 0;
  // A pruned prefill (p > 0, a threshold evictor) takes the dense tensor-core prefill where a p = 0 call
  // would (bf16, items that own their pages, Options::prefill_chunk a multiple of the row tile), as launches
  // of this many rows (rounded down to whole chunks, at least one): each launch masks, at every chunk start,
  // the entries whose λ fell below ln p (spec UA.md 4.5), and a kernel after it marks the rows below ln p dead
  // and drops them once they are a sixteenth of the item's rows, so the next launch walks the kept rows and
  // at most that many dead ones. Fewer rows per launch walk fewer evicted rows; each launch adds that kernel
  // and the fill of its λ pipeline. 0: every pruned prefill takes the chunked path.
  std::int64_t dense_prune_rows = 4096;
  // A decode step of a bf16 cache whose items hold more than 256 rows runs its long items on the tensor
  // cores (ua_decode_tc.cuh) where the shape allows (D a multiple of 16 up to 128, 4 or 8 query heads per kv
  // head, the call's k and v rows 16-byte aligned); false: on the CUDA cores (the vector-row pass), as
  // before. The kept sets agree up to near-ties, the outputs within DESIGN.md 5's bf16 tolerance.
  bool decode_tensor_cores = true;
};

namespace ua_detail {
struct SlotAccess;

// Alignment of placed cache and workspace memory and of every array carved from them: cudaMalloc's.
inline constexpr std::size_t kUaAlign = 256;

// Where the arrays of a cache live in its memory: first the host's layout of the same CacheShape
// (ua::cache_detail::offsets: the pool's keys, values, λ, key-gate logits and positions, the page
// tables, the pages held and the length of every (slot, kv head), the free list and the pool
// counters), then the device's own bookkeeping.
struct UaCacheOffsets {
  ua::cache_detail::Offsets host;
  std::size_t counter, dead, done, next_length, marks, fresh, spare, go, first, overflow, error, prefill, report,
      ticket, bytes;
};
template <class S>
UaCacheOffsets cache_offsets(const ua::CacheShape& s) {
  const auto I = std::size_t(s.batch * s.kv_heads), B = std::size_t(s.batch);
  UaCacheOffsets o{};
  o.host = ua::cache_detail::offsets<S>(s);
  ArenaLayout a(kUaAlign);
  a.take(o.host.total);
  o.counter = a.take(I * sizeof(std::int64_t));      // [I] positions (every kv head of a slot alike)
  o.dead = a.take(I * sizeof(std::int64_t));         // [I] dead rows awaiting compaction (own pages)
  o.done = a.take(I * sizeof(int));                  // [I] decode tickets
  o.next_length = a.take(I * sizeof(std::int64_t));  // [I]
  o.marks = a.take(I * sizeof(std::int64_t));        // [I] a decode step's dead marks
  o.fresh = a.take(I * sizeof(std::int64_t));        // [I] pages a decode step moves the rows into
  // [I, pages per item] their page numbers (a shared pool's items only: own pages never move)
  o.spare = a.take(s.pool_pages > 0 ? I * std::size_t(s.pages_per_item()) * sizeof(std::int32_t) : 0);
  o.go = a.take(B * sizeof(int));               // [B] per step: the slot's row runs
  o.first = a.take(B * sizeof(int));            // [B] scratch: a step's rows' check, a slot list's
  o.overflow = a.take(B * sizeof(int));         // [B] sticky overflow flags
  o.error = a.take(4 * sizeof(int));            // the first unread refusal (step or slot list)
  o.prefill = a.take((B + 1) * sizeof(int));    // [B + 1] a step's prefill rows and their count
  o.report = a.take(4 * sizeof(std::int64_t));  // import page check
  o.ticket = a.take(sizeof(int));               // publish_if_last's ticket
  o.bytes = a.total();
  return o;
}

// The per-step workspace: split partials, the new keys' λ of a prefill chunk and a prune rule's cut
// (ua_prune.cuh) for every (slot, kv head) (the kernels index them by cache item), and with
// pool_pages = 0 the dense prefill's λ hand-off words (8 bytes per cache row).
struct UaWorkOffsets {
  std::size_t part_ml, part_acc, lambda_new, cuts, dense_sync, bytes;
};
inline std::int64_t item_stride(const ua::CacheShape& s) {
  return s.pages_per_item() * s.page_rows;
}
inline UaWorkOffsets work_offsets(const ua::CacheShape& s, const UaCacheLimits& limits) {
  const auto I = std::size_t(s.batch * s.kv_heads), D = std::size_t(s.head_dim);
  const auto r = std::size_t(s.query_heads / s.kv_heads), P = std::size_t(limits.max_prefill_chunk),
             splits = std::size_t(limits.max_splits);
  ArenaLayout a(kUaAlign);
  UaWorkOffsets o{};
  o.part_ml = a.take(I * splits * r * P * 2 * sizeof(float));
  o.part_acc = a.take(I * splits * r * P * D * sizeof(float));
  o.lambda_new = a.take(I * P * sizeof(float));
  o.cuts = a.take(I * sizeof(prune::Cut));
  o.dense_sync =
      a.take(s.pool_pages == 0 ? std::size_t(dense_sync_bytes(std::int64_t(I), item_stride(s))) : std::size_t(0));
  o.bytes = a.total();
  return o;
}

// Splits of a decode launch over I items: as many as fit the launch in one wave of `blocks_per_sm`
// blocks per multiprocessor (DecodeKernel: two, kDtcBlocksPerSm for the tensor-core pass; rounded down: one block
// more than the wave holds would run alone after it and double the step's time), at least one, within
// the partials the workspace holds for a 1-row call (max_splits * max_prefill_chunk per item) and at
// most 4 * max_splits (the last block of an item merges them all). Few items split their rows widely;
// many items take few splits each, so that a step of many short items does not launch blocks that find
// no rows (every split of an item takes part in its ticket, rows or not) and a long item's blocks walk
// more rows each, the bytes of a step being spread over the whole launch either way.
inline int decode_splits(const UaCacheLimits& limits, int sm_count, std::int64_t items, int blocks_per_sm = 2) {
  const std::int64_t want = std::int64_t(blocks_per_sm) * sm_count / std::max<std::int64_t>(items, 1);
  const std::int64_t most = std::min<std::int64_t>(4 * std::int64_t(limits.max_splits),
                                                   std::int64_t(limits.max_splits) * limits.max_prefill_chunk);
  return int(std::clamp<std::int64_t>(want, 1, std::max<std::int64_t>(most, 1)));
}

inline Status check_device_memory(const void* memory, std::size_t bytes, std::size_t need, const char* what) {
  if (memory == nullptr) return invalid_argument(what, "a non-null device pointer", "nullptr");
  if (reinterpret_cast<std::uintptr_t>(memory) % kUaAlign != 0)
    return invalid_argument(what, std::to_string(kUaAlign) + "-byte alignment", "a misaligned pointer");
  if (bytes < need) return invalid_argument(std::string(what) + " bytes", ">= " + std::to_string(need), bytes);
  return Status::ok();
}

// A small pinned host block mapped into the device's address space (cudaHostAllocMapped): publish_kernel
// stores the pool counters there, the host reads them without a synchronisation. Owned; freed on
// destruction.
class MappedCounters {
 public:
  MappedCounters() = default;
  MappedCounters(const MappedCounters&) = delete;
  MappedCounters& operator=(const MappedCounters&) = delete;
  MappedCounters(MappedCounters&& o) noexcept
      : host_(std::exchange(o.host_, nullptr)), device_(std::exchange(o.device_, nullptr)) {}
  MappedCounters& operator=(MappedCounters&& o) noexcept {
    if (this != &o) {
      release();
      host_ = std::exchange(o.host_, nullptr);
      device_ = std::exchange(o.device_, nullptr);
    }
    return *this;
  }
  ~MappedCounters() { release(); }
  static Status allocate(MappedCounters& out) {
    MappedCounters m;
    void* h = nullptr;
    KVMEM_RETURN_IF_ERROR(
        to_status(cudaHostAlloc(&h, 4 * sizeof(std::int64_t), cudaHostAllocMapped), "cudaHostAlloc (pool counters)"));
    m.host_ = static_cast<std::int64_t*>(h);
    void* d = nullptr;
    KVMEM_RETURN_IF_ERROR(to_status(cudaHostGetDevicePointer(&d, h, 0), "cudaHostGetDevicePointer (pool counters)"));
    m.device_ = static_cast<std::int64_t*>(d);
    out = std::move(m);
    return Status::ok();
  }
  // The value the kernels stored last (a plain load of host memory the device writes).
  [[nodiscard]] std::int64_t read(int i) const {
    return host_ != nullptr ? static_cast<const volatile std::int64_t*>(host_)[i] : 0;
  }
  [[nodiscard]] std::int64_t* device() const { return device_; }

 private:
  void release() {
    if (host_ != nullptr) (void)cudaFreeHost(host_);
    host_ = nullptr;
    device_ = nullptr;
  }
  std::int64_t* host_ = nullptr;
  std::int64_t* device_ = nullptr;
};
// The pool counters into the cache's mapped block after an operation's kernels (occupancy reads).
template <class S>
Status publish(const DeviceCache<S>& d, cudaStream_t stream) {
  publish_kernel<><<<1, kPublishThreads, 0, stream>>>(d.pool);
  return to_status(cudaGetLastError(), "ua publish_kernel");
}
}  // namespace ua_detail

// The UA cache on the device (DESIGN.md 3, docs/memory.md): the host PrunedCache's page layout for the
// same CacheShape, in device memory, followed by the device's bookkeeping (cache_layout, cache_bytes),
// and a per-step workspace (workspace_bytes). Owning (create: one cudaMalloc holding both) or placed
// over caller device memory (place, then attach_workspace). create and place allocate the cache's
// mapped counter block and initialise the cache on a stream of their own, waiting for that work only
// (no device synchronisation). No operation allocates or creates streams or events; the steps, the
// fixed-batch calls, reset_slots and copy_slots do not synchronise with the host.
template <class S = float>
class UaCache {
  static_assert(std::is_same_v<S, float> || std::is_same_v<S, bf16> || std::is_same_v<S, fp16> ||
                    std::is_same_v<S, e4m3>,
                "kvmem::cuda::UaCache: storage must be float, kvmem::bf16, kvmem::fp16 or kvmem::e4m3 (fp8, bf16 "
                "inputs)");

 public:
  using storage_type = S;
  static constexpr std::size_t kAlign = ua_detail::kUaAlign;

  UaCache() = default;
  UaCache(const UaCache&) = delete;
  UaCache& operator=(const UaCache&) = delete;
  // A move leaves `o` empty (DESIGN.md 3): no device memory, no slots, and no pointer into the memory
  // the new owner holds, so an operation on it is refused instead of writing the owner's rows.
  UaCache(UaCache&& o) noexcept { swap(o); }
  UaCache& operator=(UaCache&& o) noexcept {
    if (this != &o) {
      UaCache taken;
      taken.swap(o);
      swap(taken);
    }
    return *this;
  }

  // Whether the CUDA backend runs a cache of this shape with these limits: ok, or why not.
  static Status can_run(const ua::CacheShape& s, const UaCacheLimits& limits = {}) {
    KVMEM_RETURN_IF_ERROR(ua::PrunedCache<float>::validate_shape(s));
    if (limits.max_prefill_chunk <= 0 || limits.max_prefill_chunk > 1024)
      return invalid_argument("UaCacheLimits max_prefill_chunk", "1..1024", limits.max_prefill_chunk);
    if (limits.max_splits <= 0 || limits.max_splits > 1024)
      return invalid_argument("UaCacheLimits max_splits", "1..1024", limits.max_splits);
    if (limits.dense_skip_past_after_tiles < 0)
      return invalid_argument("UaCacheLimits dense_skip_past_after_tiles", ">= 0", limits.dense_skip_past_after_tiles);
    if (limits.dense_item_group < 0)
      return invalid_argument("UaCacheLimits dense_item_group", ">= 0", limits.dense_item_group);
    if (s.head_dim > 256)
      return {StatusCode::kUnsupported, "cuda UA: head_dim must be <= 256, got " + std::to_string(s.head_dim)};
    return Status::ok();
  }
  // Persistent bytes of a cache of shape s (ua::cache_layout's fields; `bytes` adds the device's
  // bookkeeping to the host layout, `alignment` is kAlign). All zero when s is invalid.
  static ua::CacheLayout cache_layout(const ua::CacheShape& s) {
    ua::CacheLayout l = ua::cache_layout<S>(s);
    if (l.bytes == 0) return {};
    // position, dead rows, next length, dead marks, fresh pages, decode ticket; a shared pool's spare table
    l.item_bytes += 5 * sizeof(std::int64_t) + sizeof(int) +
                    (s.pool_pages > 0 ? std::size_t(s.pages_per_item()) * sizeof(std::int32_t) : 0);
    l.slot_bytes += 3 * sizeof(int);  // go, first, overflow flag
    l.bytes = ua_detail::cache_offsets<S>(s).bytes;
    l.alignment = kAlign;
    return l;
  }
  static std::size_t cache_bytes(const ua::CacheShape& s) { return cache_layout(s).bytes; }
  // Workspace bytes of the steps and fixed-batch calls. The kernels index their scratch by cache item,
  // so a workspace serves every slot: limits.max_rows and max_tokens do not change it (the common shape
  // of the API). 0 when s or the limits are invalid.
  static std::size_t workspace_bytes(const ua::CacheShape& s, const Limits& limits = {},
                                     const UaCacheLimits& tuning = {}) {
    if (!can_run(s, tuning).is_ok() || limits.max_rows < 0) return 0;
    return ua_detail::work_offsets(s, tuning).bytes;
  }
  // What create allocates: the cache, then its workspace.
  static std::size_t bytes_required(const ua::CacheShape& s, const UaCacheLimits& tuning = {}) {
    if (!can_run(s, tuning).is_ok()) return 0;
    return cache_bytes(s) + workspace_bytes(s, {}, tuning);
  }

  // Owning cache: one device allocation of bytes_required (cache, then workspace).
  static Status create(const ua::CacheShape& s, UaCache& out, UaCacheLimits limits = {}) {
    KVMEM_RETURN_IF_ERROR(can_run(s, limits));
    UaCache c;
    KVMEM_RETURN_IF_ERROR(DeviceBuffer::allocate(bytes_required(s, limits), c.memory_));
    auto* base = static_cast<unsigned char*>(c.memory_.get());
    KVMEM_RETURN_IF_ERROR(c.bind(base, s, limits));
    c.bind_workspace(base + cache_bytes(s), workspace_bytes(s, {}, limits));
    out = std::move(c);
    return Status::ok();
  }
  // A cache over caller device memory (at least cache_bytes(s), kAlign-aligned, not owned, not in use
  // by pending work): every slot empty, every page free. Writes nothing outside [memory, memory +
  // cache_bytes(s)). Steps need a workspace (attach_workspace).
  static Status place(void* memory, std::size_t bytes, const ua::CacheShape& s, UaCache& out,
                      UaCacheLimits limits = {}) {
    KVMEM_RETURN_IF_ERROR(can_run(s, limits));
    KVMEM_RETURN_IF_ERROR(ua_detail::check_device_memory(memory, bytes, cache_bytes(s), "cache memory"));
    UaCache c;
    KVMEM_RETURN_IF_ERROR(c.bind(static_cast<unsigned char*>(memory), s, limits));
    out = std::move(c);
    return Status::ok();
  }
  // Uses caller device memory (at least workspace_bytes(shape, limits), kAlign-aligned, not owned) as
  // the scratch of every later call; replaces the workspace used before. Nothing is written here; caches
  // whose calls never run at the same time (one stream) may share one workspace.
  Status attach_workspace(void* memory, std::size_t bytes, const Limits& limits = {}) {
    KVMEM_RETURN_IF_ERROR(check_valid());
    if (limits.max_rows < 0) return invalid_argument("limits max_rows", ">= 0", limits.max_rows);
    const std::size_t need = workspace_bytes(shape_, limits, limits_);
    KVMEM_RETURN_IF_ERROR(ua_detail::check_device_memory(memory, bytes, need, "workspace memory"));
    bind_workspace(static_cast<unsigned char*>(memory), need);
    return Status::ok();
  }
  // Ok when the cache has a workspace; else the reason (checked before anything is enqueued).
  [[nodiscard]] Status check_workspace() const {
    if (ws_ == nullptr)
      return invalid_argument("workspace", "a workspace (UaCache::create, or attach_workspace after place)", "none");
    return Status::ok();
  }

  [[nodiscard]] const ua::CacheShape& shape() const { return shape_; }
  // False for a cache never created or placed, and for a moved-from one: every operation refuses it.
  [[nodiscard]] bool valid() const { return base_ != nullptr; }
  // Sequence slots (CacheShape::batch); 0 for an empty cache.
  [[nodiscard]] std::int64_t max_slots() const { return valid() ? shape_.batch : 0; }
  [[nodiscard]] const UaCacheLimits& limits() const { return limits_; }
  [[nodiscard]] std::int64_t group_size() const { return shape_.query_heads / shape_.kv_heads; }
  // Bytes of the cache proper (cache_bytes(shape())), of its workspace, and of the device memory this
  // object allocated (create: both; place: 0).
  [[nodiscard]] std::size_t cache_bytes() const { return valid() ? cache_total_ : 0; }
  [[nodiscard]] std::size_t workspace_bytes() const { return ws_ != nullptr ? ws_total_ : 0; }
  [[nodiscard]] std::size_t allocated_bytes() const { return memory_.bytes(); }
  [[nodiscard]] std::size_t page_bytes() const { return valid() ? ua::cache_layout<S>(shape_).page_bytes : 0; }

  // ---- occupancy (DESIGN.md 3: an engine's admission control) ----
  // Read from the cache's mapped counter block, which the last kernel of every operation fills from
  // the device counters: no synchronisation, no device call. The values are those of the last
  // completed operation (a read while a step runs shows the one before it); pages_taken -
  // pages_returned == pages_in_use.
  [[nodiscard]] std::int64_t pool_pages() const { return valid() ? shape_.pages() : 0; }
  [[nodiscard]] std::int64_t free_pages() const { return valid() ? mirror_.read(0) : 0; }
  [[nodiscard]] std::int64_t pages_in_use() const { return pool_pages() - free_pages(); }
  [[nodiscard]] std::int64_t pages_taken() const { return valid() ? mirror_.read(1) : 0; }
  [[nodiscard]] std::int64_t pages_returned() const { return valid() ? mirror_.read(2) : 0; }
  // Enqueues the copy of the device's page counters into that block on exec.stream, as the end of every
  // operation does except a fixed-batch ua_decode over items that own their pages (pool_pages = 0), which
  // publishes nothing: call this where such a cache's occupancy must be current.
  Status publish_occupancy(const Executor& exec) const {
    KVMEM_RETURN_IF_ERROR(check_valid());
    return ua_detail::publish(dev_, exec.stream);
  }
  // Pages every (slot, kv head) holds ([max_slots * kv_heads], item b * G + g), after the work enqueued
  // on exec.stream (synchronises it; for tests and inspection).
  Status pages(const Executor& exec, std::vector<std::int64_t>& out) const {
    KVMEM_RETURN_IF_ERROR(check_valid());
    out.resize(std::size_t(shape_.batch * shape_.kv_heads));
    KVMEM_RETURN_IF_ERROR(to_status(cudaMemcpyAsync(out.data(), dev_.pool.held, out.size() * sizeof(std::int64_t),
                                                    cudaMemcpyDeviceToHost, exec.stream),
                                    "UaCache pages copy"));
    return to_status(cudaStreamSynchronize(exec.stream), "UaCache pages sync");
  }

  // Next absolute position of slot b (tokens seen since creation or the slot's last reset), read from
  // the device counter: waits for all work on the device (cudaDeviceSynchronize), so it is for tests and
  // inspection, never inside a captured graph; `positions` reads every slot after one stream's work.
  // 0 for a slot outside the cache or a failed read.
  [[nodiscard]] std::int64_t position(std::int64_t b) const {
    if (b < 0 || b >= max_slots()) return 0;
    std::int64_t n = 0;
    if (cudaDeviceSynchronize() != cudaSuccess ||
        cudaMemcpy(&n, dev_.counter + b * shape_.kv_heads, sizeof(n), cudaMemcpyDeviceToHost) != cudaSuccess)
      return 0;
    return n;
  }
  // Every slot's position ([max_slots]), after the work enqueued on exec.stream (synchronises it).
  Status positions(const Executor& exec, std::vector<std::int64_t>& out) const {
    const cudaStream_t stream = exec.stream;
    KVMEM_RETURN_IF_ERROR(check_valid());
    std::vector<std::int64_t> items(std::size_t(shape_.batch * shape_.kv_heads));
    KVMEM_RETURN_IF_ERROR(to_status(cudaMemcpyAsync(items.data(), dev_.counter, items.size() * sizeof(std::int64_t),
                                                    cudaMemcpyDeviceToHost, stream),
                                    "UaCache positions copy"));
    KVMEM_RETURN_IF_ERROR(to_status(cudaStreamSynchronize(stream), "UaCache positions sync"));
    out.resize(std::size_t(shape_.batch));
    for (std::int64_t b = 0; b < shape_.batch; ++b) out[std::size_t(b)] = items[std::size_t(b * shape_.kv_heads)];
    return Status::ok();
  }
  // Every slot's overflow flag ([max_slots], 1 = a step found no room or no pool pages for the slot's
  // row and skipped it; the slot steps no more until reset_slots, copy_slots or import_slot replaces
  // it), after the work enqueued on exec.stream (synchronises it).
  Status overflowed(const Executor& exec, std::vector<std::int32_t>& out) const {
    const cudaStream_t stream = exec.stream;
    KVMEM_RETURN_IF_ERROR(check_valid());
    out.resize(std::size_t(shape_.batch));
    KVMEM_RETURN_IF_ERROR(
        to_status(cudaMemcpyAsync(out.data(), overflow_, out.size() * sizeof(int), cudaMemcpyDeviceToHost, stream),
                  "UaCache overflow flags copy"));
    return to_status(cudaStreamSynchronize(stream), "UaCache overflow flags sync");
  }
  // ua::step checks its rows on the device (they live there) and refuses a bad step without changing
  // the cache, and reset_slots / copy_slots check their device slot lists (and copy_slots the pool's
  // pages) the same way; the reason stays in the cache, and refuses every later step and slot
  // operation, until this call reads it (as KvmState::step_status does): ok, or the Status the host
  // would have returned for the first refused call since the last read (for a step, its first refused
  // row). Clears it. Synchronises exec.stream.
  Status step_status(const Executor& exec);
  // A bound the host keeps without reading the device: no item holds more entries than this.
  [[nodiscard]] std::int64_t length_bound() const { return bound_; }
  [[nodiscard]] const ua_detail::DeviceCache<S>& device() const { return dev_; }

  // Reads every item's kept count back ([B*G], item b*G+g: rows in use less the dead rows awaiting
  // compaction) and tightens length_bound(). Synchronises `stream`, which must be the stream the cache's
  // operations run on.
  Status lengths(std::vector<std::int64_t>& out, cudaStream_t stream) {
    KVMEM_RETURN_IF_ERROR(check_valid());
    out.resize(std::size_t(shape_.batch * shape_.kv_heads));
    std::vector<std::int64_t> dead(out.size());
    KVMEM_RETURN_IF_ERROR(to_status(
        cudaMemcpyAsync(out.data(), dev_.length, out.size() * sizeof(std::int64_t), cudaMemcpyDeviceToHost, stream),
        "UaCache lengths copy"));
    KVMEM_RETURN_IF_ERROR(to_status(
        cudaMemcpyAsync(dead.data(), dev_.dead, dead.size() * sizeof(std::int64_t), cudaMemcpyDeviceToHost, stream),
        "UaCache dead rows copy"));
    KVMEM_RETURN_IF_ERROR(to_status(cudaStreamSynchronize(stream), "UaCache lengths sync"));
    for (std::size_t i = 0; i < out.size(); ++i) out[i] -= dead[i];
    bound_ = out.empty() ? 0 : *std::max_element(out.begin(), out.end());
    return Status::ok();
  }

  // The pool row of each logical page of item `item` that holds its first n rows ([ceil(n / page_rows)]):
  // the item's own pages, or its page table read back (synchronises `stream`).
  Status page_rows_of(std::int64_t item, std::int64_t n, std::vector<std::int64_t>& out, cudaStream_t stream) const {
    const std::int64_t pr = shape_.page_rows, count = (n + pr - 1) / pr;
    out.resize(std::size_t(count));
    if (dev_.pool.table == nullptr) {
      for (std::int64_t p = 0; p < count; ++p) out[std::size_t(p)] = item * dev_.stride + p * pr;
      return Status::ok();
    }
    std::vector<std::int32_t> table(static_cast<std::size_t>(count));
    if (count > 0)
      KVMEM_RETURN_IF_ERROR(
          to_status(cudaMemcpyAsync(table.data(), dev_.pool.table + item * shape_.pages_per_item(),
                                    table.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost, stream),
                    "UaCache page table copy"));
    KVMEM_RETURN_IF_ERROR(to_status(cudaStreamSynchronize(stream), "UaCache page table sync"));
    for (std::int64_t p = 0; p < count; ++p) out[std::size_t(p)] = std::int64_t(table[std::size_t(p)]) * pr;
    return Status::ok();
  }
  // Copies the first n rows of one field (width elements a row) of an item between the device pool and
  // contiguous host rows, page run by page run, on `stream` (to_host: pool -> host).
  template <class T>
  Status copy_item_rows(T* pool_field, T* host_rows, std::int64_t width, std::int64_t n,
                        const std::vector<std::int64_t>& page_rows, bool to_host, cudaStream_t stream) const {
    const std::int64_t pr = shape_.page_rows;
    for (std::int64_t p = 0; p * pr < n;) {
      std::int64_t q = p + 1;  // pages p..q-1 are consecutive in the pool
      while (q * pr < n && page_rows[std::size_t(q)] == page_rows[std::size_t(p)] + (q - p) * pr) ++q;
      const std::int64_t e0 = p * pr, rows = std::min(q * pr, n) - e0;
      T* dev = pool_field + page_rows[std::size_t(p)] * width;
      T* host = host_rows + e0 * width;
      const std::size_t bytes = std::size_t(rows * width) * sizeof(T);
      KVMEM_RETURN_IF_ERROR(to_status(to_host ? cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, stream)
                                              : cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream),
                                      "UaCache rows copy"));
      p = q;
    }
    return Status::ok();
  }

  // Copies the kept entries of item (b, g) to the host in ascending position: positions and λ [kept];
  // keys and values [kept, D] when the pointers are given, and for fp8 storage their row scales [kept]
  // (a stored row reads as scale * row; tests, replay, export, inspection; synchronises `stream`).
  Status download(std::int64_t b, std::int64_t g, std::vector<std::int64_t>& pos, std::vector<float>& lambda,
                  std::vector<S>* keys, std::vector<S>* values, cudaStream_t stream,
                  std::vector<float>* key_scales = nullptr, std::vector<float>* value_scales = nullptr) const {
    KVMEM_RETURN_IF_ERROR(check_slot(b, "download b"));
    if (g < 0 || g >= shape_.kv_heads)
      return {StatusCode::kOutOfRange,
              kvmem::detail::concat("download g: expected 0 <= g < kv_heads = ", shape_.kv_heads, ", got ", g)};
    const std::int64_t item = b * shape_.kv_heads + g, D = shape_.head_dim;
    std::int64_t n = 0;
    KVMEM_RETURN_IF_ERROR(to_status(cudaMemcpyAsync(&n, dev_.length + item, sizeof(n), cudaMemcpyDeviceToHost, stream),
                                    "download length"));
    KVMEM_RETURN_IF_ERROR(to_status(cudaStreamSynchronize(stream), "download sync"));
    std::vector<std::int64_t> rows;
    KVMEM_RETURN_IF_ERROR(page_rows_of(item, n, rows, stream));
    pos.resize(std::size_t(n));
    lambda.resize(std::size_t(n));
    KVMEM_RETURN_IF_ERROR(copy_item_rows(dev_.pos, pos.data(), 1, n, rows, true, stream));
    KVMEM_RETURN_IF_ERROR(copy_item_rows(dev_.lambda, lambda.data(), 1, n, rows, true, stream));
    if (keys) {
      keys->resize(std::size_t(n * D));
      KVMEM_RETURN_IF_ERROR(copy_item_rows(dev_.keys, keys->data(), D, n, rows, true, stream));
    }
    if (values) {
      values->resize(std::size_t(n * D));
      KVMEM_RETURN_IF_ERROR(copy_item_rows(dev_.values, values->data(), D, n, rows, true, stream));
    }
    if constexpr (is_row_scaled_v<S>) {
      if (key_scales) {
        key_scales->resize(std::size_t(n));
        KVMEM_RETURN_IF_ERROR(copy_item_rows(dev_.key_scale, key_scales->data(), 1, n, rows, true, stream));
      }
      if (value_scales) {
        value_scales->resize(std::size_t(n));
        KVMEM_RETURN_IF_ERROR(copy_item_rows(dev_.value_scale, value_scales->data(), 1, n, rows, true, stream));
      }
    }
    KVMEM_RETURN_IF_ERROR(to_status(cudaStreamSynchronize(stream), "download sync"));
    // the kept rows only: rows a decode marked dead (λ = -inf) wait in place for the next compaction
    std::size_t kept = 0;
    for (std::size_t e = 0; e < std::size_t(n); ++e) {
      if (lambda[e] == -std::numeric_limits<float>::infinity()) continue;
      pos[kept] = pos[e];
      lambda[kept] = lambda[e];
      if (keys)
        std::copy_n(keys->begin() + std::ptrdiff_t(e * std::size_t(D)), D,
                    keys->begin() + std::ptrdiff_t(kept * std::size_t(D)));
      if (values)
        std::copy_n(values->begin() + std::ptrdiff_t(e * std::size_t(D)), D,
                    values->begin() + std::ptrdiff_t(kept * std::size_t(D)));
      if (key_scales && !key_scales->empty()) (*key_scales)[kept] = (*key_scales)[e];
      if (value_scales && !value_scales->empty()) (*value_scales)[kept] = (*value_scales)[e];
      ++kept;
    }
    pos.resize(kept);
    lambda.resize(kept);
    if (keys) keys->resize(kept * std::size_t(D));
    if (values) values->resize(kept * std::size_t(D));
    if (key_scales && !key_scales->empty()) key_scales->resize(kept);
    if (value_scales && !value_scales->empty()) value_scales->resize(kept);
    return Status::ok();
  }

  // Empties sequence b (all its kv heads, its pages back to the pool), restarts its position counter
  // and clears its overflow flag, on `stream`.
  Status reset_sequence(std::int64_t b, cudaStream_t stream) {
    KVMEM_RETURN_IF_ERROR(check_slot(b, "reset_sequence b"));
    ua_detail::reset_slots_kernel<S><<<1, 32, 0, stream>>>(dev_, overflow_, nullptr, std::int32_t(b), nullptr, nullptr);
    KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua reset_slots_kernel");
    return ua_detail::publish(dev_, stream);
  }

 private:
  Status check_valid() const {
    if (!valid()) return invalid_argument("cache", "a cache made by UaCache::create or place", "an empty cache");
    return Status::ok();
  }
  Status check_slot(std::int64_t b, const char* name) const {
    KVMEM_RETURN_IF_ERROR(check_valid());
    if (b < 0 || b >= shape_.batch)
      return {StatusCode::kOutOfRange,
              kvmem::detail::concat(name, ": expected 0 <= b < max_slots = ", shape_.batch, ", got ", b)};
    return Status::ok();
  }
  // Carves the cache's arrays from `base` and initialises them (every slot empty, every page free) on a
  // stream of its own, waiting for that stream only.
  Status bind(unsigned char* base, const ua::CacheShape& s, const UaCacheLimits& limits) {
    using namespace ua_detail;
    const UaCacheOffsets o = cache_offsets<S>(s);
    shape_ = s;
    limits_ = limits;
    base_ = base;
    cache_total_ = o.bytes;
    KVMEM_RETURN_IF_ERROR(MappedCounters::allocate(mirror_));
    auto& d = dev_;
    d.keys = reinterpret_cast<S*>(base + o.host.keys);
    d.values = reinterpret_cast<S*>(base + o.host.values);
    d.lambda = reinterpret_cast<float*>(base + o.host.lambda);
    d.key_logit = reinterpret_cast<float*>(base + o.host.key_logit);
    d.pos = reinterpret_cast<std::int64_t*>(base + o.host.pos);
    d.key_scale = is_row_scaled_v<S> ? reinterpret_cast<float*>(base + o.host.key_scale) : nullptr;
    d.value_scale = is_row_scaled_v<S> ? reinterpret_cast<float*>(base + o.host.value_scale) : nullptr;
    d.length = reinterpret_cast<std::int64_t*>(base + o.host.length);
    d.dead = reinterpret_cast<std::int64_t*>(base + o.dead);
    d.counter = reinterpret_cast<std::int64_t*>(base + o.counter);
    d.done = reinterpret_cast<int*>(base + o.done);
    d.next_length = reinterpret_cast<std::int64_t*>(base + o.next_length);
    d.marks = reinterpret_cast<std::int64_t*>(base + o.marks);
    d.pool.table = s.pool_pages > 0 ? reinterpret_cast<std::int32_t*>(base + o.host.table) : nullptr;
    d.pool.spare = s.pool_pages > 0 ? reinterpret_cast<std::int32_t*>(base + o.spare) : nullptr;
    d.pool.fresh = s.pool_pages > 0 ? reinterpret_cast<std::int64_t*>(base + o.fresh) : nullptr;
    d.pool.held = reinterpret_cast<std::int64_t*>(base + o.host.held);
    d.pool.free_list = reinterpret_cast<std::int32_t*>(base + o.host.free_list);
    d.pool.stats = reinterpret_cast<std::int64_t*>(base + o.host.stats);
    d.pool.mirror = mirror_.device();
    d.pool.length = d.length;
    d.pool.dead = d.dead;
    d.pool.items = s.batch * s.kv_heads;
    d.pool.pages_per_item = s.pages_per_item();
    d.pool.shift = ua::cache_detail::log2_exact(s.page_rows);
    d.stride = ua_detail::item_stride(s);
    d.capacity = s.capacity;
    d.D = s.head_dim;
    d.G = s.kv_heads;
    d.r = s.query_heads / s.kv_heads;
    slot_go_ = reinterpret_cast<int*>(base + o.go);
    slot_first_ = reinterpret_cast<int*>(base + o.first);
    overflow_ = reinterpret_cast<int*>(base + o.overflow);
    step_error_ = reinterpret_cast<int*>(base + o.error);
    prefill_rows_ = reinterpret_cast<int*>(base + o.prefill);
    report_ = reinterpret_cast<std::int64_t*>(base + o.report);
    publish_ticket_ = reinterpret_cast<int*>(base + o.ticket);
    KVMEM_RETURN_IF_ERROR(current_sm_count(sm_count_));
    cudaStream_t init = nullptr;
    KVMEM_RETURN_IF_ERROR(to_status(cudaStreamCreateWithFlags(&init, cudaStreamNonBlocking), "UaCache init stream"));
    const std::int64_t items = s.batch * s.kv_heads, most = std::max({s.pages(), items, s.batch});
    init_cache_kernel<S><<<unsigned(std::min<std::int64_t>((most + 255) / 256, 1024)), 256, 0, init>>>(
        d, items, s.batch, s.pages(), overflow_, step_error_, publish_ticket_);
    const Status launched = to_status(cudaGetLastError(), "ua init_cache_kernel");
    const Status synced = to_status(cudaStreamSynchronize(init), "UaCache init sync");
    (void)cudaStreamDestroy(init);
    KVMEM_RETURN_IF_ERROR(launched);
    return synced;
  }
  void bind_workspace(unsigned char* ws, std::size_t bytes) {
    const ua_detail::UaWorkOffsets o = ua_detail::work_offsets(shape_, limits_);
    ws_ = ws;
    ws_total_ = bytes;
    part_ml_ = reinterpret_cast<float*>(ws + o.part_ml);
    part_acc_ = reinterpret_cast<float*>(ws + o.part_acc);
    lambda_new_ = reinterpret_cast<float*>(ws + o.lambda_new);
    cuts_ = reinterpret_cast<prune::Cut*>(ws + o.cuts);
    dense_sync_ = shape_.pool_pages == 0 ? reinterpret_cast<int*>(ws + o.dense_sync) : nullptr;
  }
  void swap(UaCache& o) noexcept {
    std::swap(shape_, o.shape_);
    std::swap(limits_, o.limits_);
    std::swap(memory_, o.memory_);
    std::swap(mirror_, o.mirror_);
    std::swap(base_, o.base_);
    std::swap(ws_, o.ws_);
    std::swap(cache_total_, o.cache_total_);
    std::swap(ws_total_, o.ws_total_);
    std::swap(dev_, o.dev_);
    std::swap(part_ml_, o.part_ml_);
    std::swap(part_acc_, o.part_acc_);
    std::swap(lambda_new_, o.lambda_new_);
    std::swap(cuts_, o.cuts_);
    std::swap(dense_sync_, o.dense_sync_);
    std::swap(sm_count_, o.sm_count_);
    std::swap(slot_go_, o.slot_go_);
    std::swap(slot_first_, o.slot_first_);
    std::swap(overflow_, o.overflow_);
    std::swap(step_error_, o.step_error_);
    std::swap(prefill_rows_, o.prefill_rows_);
    std::swap(report_, o.report_);
    std::swap(publish_ticket_, o.publish_ticket_);
    std::swap(bound_, o.bound_);
  }

  template <class Set, class S2, class Ev, class Dims>
  friend Status ua_run(const Executor&, UaCache<S2>&, const UaInputs<S2>&, const ua::Options&, const Ev&,
                       TensorView<float, 4>, TensorView<float, 3>, bool, Dims);
  friend struct ua_detail::SlotAccess;

  ua::CacheShape shape_{0, 1, 1, 0, 0, 16};  // empty: no slots, a group size of 1
  UaCacheLimits limits_{};
  DeviceBuffer memory_;               // create's allocation (cache, then workspace); empty when placed
  ua_detail::MappedCounters mirror_;  // pool counters the kernels store for the host (occupancy reads)
  unsigned char* base_ = nullptr;     // the cache's memory
  unsigned char* ws_ = nullptr;       // the workspace's memory
  std::size_t cache_total_ = 0, ws_total_ = 0;
  ua_detail::DeviceCache<S> dev_{};
  float* part_ml_ = nullptr;
  float* part_acc_ = nullptr;
  float* lambda_new_ = nullptr;
  prune::Cut* cuts_ = nullptr;      // [I] a prune rule's cut per item (ua_prune.cuh)
  int* dense_sync_ = nullptr;       // ticket + λ hand-off of the dense tensor-core prefill (pool_pages = 0)
  int sm_count_ = 1;                // multiprocessors: sizes the dense prefill's item groups
  int* slot_go_ = nullptr;          // [B] per step: the slot's row runs (step_begin_kernel, batch_reserve_kernel)
  int* slot_first_ = nullptr;       // [B] scratch of a step's rows' check and of a slot list's check
  int* overflow_ = nullptr;         // [B] sticky: a step found no room or no pages for the slot's row
  int* step_error_ = nullptr;       // [4] the first unread refusal of a step or slot operation
  int* prefill_rows_ = nullptr;     // [B + 1] per step: its prefill rows, then their count
  std::int64_t* report_ = nullptr;  // [4] import_slot's page check (read back by import_slot)
  int* publish_ticket_ = nullptr;   // the ticket of a step's last kernel (publish_if_last)
  std::int64_t bound_ = 0;          // >= every item's length, as far as the host knows (fixed-batch calls)
};

namespace ua_detail {

template <class S>
DeviceCall<S> make_call(const UaInputs<S>& in, TensorView<float, 4> out, TensorView<float, 3> lse) {
  DeviceCall<S> a;
  a.q = in.q.data();
  a.q_b = in.q.stride(0), a.q_h = in.q.stride(1), a.q_t = in.q.stride(2);
  a.k = in.k.data();
  a.k_b = in.k.stride(0), a.k_g = in.k.stride(1), a.k_t = in.k.stride(2);
  a.v = in.v.data();
  a.v_b = in.v.stride(0), a.v_g = in.v.stride(1), a.v_t = in.v.stride(2);
  a.kv_rows16 = rows_16byte_aligned(in.k) && rows_16byte_aligned(in.v);
  a.z_k = in.z_k.data();
  a.zk_b = in.z_k.stride(0), a.zk_g = in.z_k.stride(1), a.zk_t = in.z_k.stride(2);
  a.z_q = in.z_q.data();
  a.zq_b = in.z_q.stride(0), a.zq_g = in.z_q.stride(1), a.zq_t = in.z_q.stride(2);
  if (!in.z_o.empty()) {
    a.z_o = in.z_o.data();
    a.zo_b = in.z_o.stride(0), a.zo_t = in.z_o.stride(1), a.zo_h = in.z_o.stride(2);
  }
  a.out = out.data();
  a.o_b = out.stride(0), a.o_t = out.stride(1), a.o_h = out.stride(2);
  if (!lse.empty()) {
    a.lse = lse.data();
    a.l_b = lse.stride(0), a.l_h = lse.stride(1), a.l_t = lse.stride(2);
  }
  return a;
}

// The tensor-core kernels read q, k, v rows as 16-byte vectors.
template <class In>
bool tc_aligned(const ua::InputsOf<In>& in) {
  return rows_16byte_aligned(in.q) && rows_16byte_aligned(in.k) && rows_16byte_aligned(in.v);
}

// The chunk kernel of a call and its launch shape. Every variant has the same signature for a given S.
template <class S>
struct ChunkKernel {
  void (*kernel)(DeviceCache<S>, DeviceCall<S>, std::int64_t, std::int64_t);
  std::size_t shared_bytes;
  int threads;
};

// Tensor cores (matrix cores on AMD) for bf16 with D in {64, 80, 128} and r in {4, 8} (the paper's shapes) when
// the inputs' rows are 16-byte aligned (`aligned`), else the CUDA-core kernel, whose lanes hold ceil(D / 4) dims
// each (four ranges). Chosen once per call: every chunk of a call has the same inputs, head dim and group size.
// Dims: the head dim a composed variant fixed (HeadDims), whose kernels alone are instantiated.
inline constexpr int chunk_dims_per_thread(std::int64_t D) {
  return D <= 32 ? 8 : D <= 64 ? 16 : D <= 128 ? 32 : 64;
}
template <class Set, class S, int kDpt>
ChunkKernel<S> chunk_kernel_dims(std::int64_t D, std::int64_t r) {
  return {chunk_attend_kernel<Set, S, kDpt>, chunk_smem_bytes(D, r, is_row_scaled_v<S>), kChunkThreads};
}
template <class Set, class S, class Dims>
ChunkKernel<S> chunk_kernel_of(bool aligned, std::int64_t D, std::int64_t r) {
#if KVMEM_GPU_VENDOR_PATHS
  if constexpr (std::is_same_v<S, bf16>) {
    if (tc_group_ok(r) && aligned) {
      if constexpr (Dims::key_may_be(64))
        if (D == 64) return {chunk_attend_tc_kernel<Set, 64>, UaTcLayout<64>::kBytes, 32 * kTcWarps};
      if constexpr (Dims::key_may_be(80))
        if (D == 80) return {chunk_attend_tc_kernel<Set, 80>, UaTcLayout<80>::kBytes, 32 * kTcWarps};
      if constexpr (Dims::key_may_be(128))
        if (D == 128) return {chunk_attend_tc_kernel<Set, 128>, UaTcLayout<128>::kBytes, 32 * kTcWarps};
    }
  }
#elif KVMEM_GPU_MFMA_PATHS
  if constexpr (std::is_same_v<S, bf16>) {
    if (mfma_group_ok(r) && aligned) {
      if constexpr (Dims::key_may_be(64))
        if (D == 64) return {chunk_attend_mfma_kernel<Set, 64>, UaMfmaLayout<64>::kBytes, kMfmaThreads};
      if constexpr (Dims::key_may_be(80))
        if (D == 80) return {chunk_attend_mfma_kernel<Set, 80>, UaMfmaLayout<80>::kBytes, kMfmaThreads};
      if constexpr (Dims::key_may_be(128))
        if (D == 128) return {chunk_attend_mfma_kernel<Set, 128>, UaMfmaLayout<128>::kBytes, kMfmaThreads};
    }
  }
#else
  (void)aligned;  // the portable path has no tensor-core kernel, whose rows must be 16-byte aligned
#endif
  if constexpr (Dims::kFixed) {
    return chunk_kernel_dims<Set, S, chunk_dims_per_thread(Dims::kKey)>(D, r);
  } else {
    switch (chunk_dims_per_thread(D)) {
      case 8:
        return chunk_kernel_dims<Set, S, 8>(D, r);
      case 16:
        return chunk_kernel_dims<Set, S, 16>(D, r);
      case 32:
        return chunk_kernel_dims<Set, S, 32>(D, r);
      default:
        return chunk_kernel_dims<Set, S, 64>(D, r);
    }
  }
}
template <class Set, class S, class Dims = HeadDims<>>
ChunkKernel<S> chunk_kernel_for(const UaInputs<S>& in, std::int64_t D, std::int64_t r) {
  return chunk_kernel_of<Set, S, Dims>(tc_aligned(in), D, r);
}

// The dense tensor-core prefill (ua_dense_tc.cuh): bf16 with D in {64, 80, 128}, r in {4, 8}, and either p = 0
// (nothing is evicted, so the whole call is one pipelined launch) or a threshold whose chunks are whole row
// tiles (dense_prune_rows). kernel == nullptr: the call takes the chunked path.
template <class S>
struct DenseKernel {
  void (*kernel)(DeviceCache<S>, DeviceCall<S>, std::int64_t, std::int64_t, std::int64_t, std::int64_t, int*) = nullptr;
  std::size_t shared_bytes = 0;
};

// Whether a dense prefill of T rows takes the kernel with the skip past the decay's reach: its longest row
// tile may see more entry tiles than UaCacheLimits::dense_skip_past_after_tiles (the cache's longest bound
// plus the call's rows).
template <class S>
bool dense_skips_past(const UaCache<S>& cache, std::int64_t T) {
  return (cache.length_bound() + T + kDnEntries - 1) / kDnEntries > cache.limits().dense_skip_past_after_tiles;
}

// Rows per launch of a dense prefill of the call (`a`: its eviction, set_eviction): every row of it for p =
// 0; for a threshold, UaCacheLimits::dense_prune_rows rounded down to whole chunks (at least one), provided
// that a chunk (Options::prefill_chunk) is whole row tiles of the kernel (its chunk starts are row tile
// starts) and that the limit is not 0. 0: the call takes the chunked path. Other conditions of the kernel:
// dense_kernel_for.
template <class S>
std::int64_t dense_prune_rows(const UaCache<S>& cache, const UaInputs<S>& in, const DeviceCall<S>& a,
                              const ua::Options& opt, std::int64_t r) {
  const std::int64_t T = in.q.extent(2), P = opt.prefill_chunk, limit = cache.limits().dense_prune_rows;
  if (a.log_p == -std::numeric_limits<double>::infinity()) return T;
  if ((r != 4 && r != 8) || limit <= 0 || P <= 0 || P % dense_row_tile(r) != 0) return 0;  // r: tc_group_ok
  return std::max(P, limit / P * P);
}

// The call `a` from its row t0 on: inputs, output gate, outputs and lse start t0 rows in (a launch of the
// dense prefill over rows t0.. of the call, whose positions start at the counter the launches before it
// advanced).
template <class S>
DeviceCall<S> dense_call_rows(DeviceCall<S> a, std::int64_t t0) {
  a.q += t0 * a.q_t;
  a.k += t0 * a.k_t;
  a.v += t0 * a.v_t;
  a.z_k += t0 * a.zk_t;
  a.z_q += t0 * a.zq_t;
  if (a.z_o != nullptr) a.z_o += t0 * a.zo_t;
  a.out += t0 * a.o_t;
  if (a.lse != nullptr) a.lse += t0 * a.l_t;
  return a;
}

// skip_past: the kernel that skips the steps past the decay's reach (D 64 and 128; D 80 has no wgmma path).
template <class Set, class S, class Dims = HeadDims<>>
DenseKernel<S> dense_kernel_for(const UaInputs<S>& in, std::int64_t D, std::int64_t r, bool skip_past) {
#if !KVMEM_GPU_VENDOR_PATHS
  (void)in, (void)D, (void)r, (void)skip_past;  // portable: every prefill takes the chunked path
#else
  if constexpr (std::is_same_v<S, bf16>) {
    if (tc_group_ok(r) && tc_aligned(in)) {
      if constexpr (Dims::key_may_be(64))
        if (D == 64)
          return {skip_past ? dense_prefill_tc_kernel<Set, 64, true> : dense_prefill_tc_kernel<Set, 64, false>,
                  dense_shared_bytes<64>()};
      if constexpr (Dims::key_may_be(80))
        if (D == 80) return {dense_prefill_tc_kernel<Set, 80, false>, dense_shared_bytes<80>()};
      if constexpr (Dims::key_may_be(128))
        if (D == 128)
          return {skip_past ? dense_prefill_tc_kernel<Set, 128, true> : dense_prefill_tc_kernel<Set, 128, false>,
                  dense_shared_bytes<128>()};
    }
  }
#endif
  return {};
}

// The decode kernel of a cache and its dynamic shared memory: with `tc` (the limits allow it and the call's
// k and v rows are 16-byte aligned) the tensor-core pass for bf16 shapes it takes (decode_tc_shape_ok, NVIDIA
// only), else the vector-row pass for groups of 4 or 8 query heads over 16-byte rows (vector_decode_ok),
// else the entry splits; the lanes of an 8-lane group hold ceil(D / 8) dims each. Every variant has the same
// signature for a given S. kEvict: whether the kernel compiles the eviction (kEvicts of the call's evictor;
// false for prune::None). blocks_per_sm: the residency the launch's splits plan for (decode_splits).
template <class S>
struct DecodeKernel {
  void (*kernel)(DeviceCache<S>, DeviceCall<S>);
  std::size_t shared_bytes;
  int blocks_per_sm = 2;
};
template <class Set, bool kEvict, class S, int kDpl>
DecodeKernel<S> decode_kernel_dims(std::int64_t D, std::int64_t r, bool tc) {
  if constexpr (kVendorPaths && std::is_same_v<S, bf16> && kDpl <= 16) {
    if (tc && decode_tc_shape_ok(D, r) && D <= 8 * kDpl) {
      const std::size_t bytes = decode_kernel_smem_bytes<S>(D, r, true, true);
      if (r == 4) return {decode_attend_kernel<Set, kEvict, S, kDpl, 4, true>, bytes, kDtcBlocksPerSm};
      return {decode_attend_kernel<Set, kEvict, S, kDpl, 8, true>, bytes, kDtcBlocksPerSm};
    }
  }
  const bool vector = vector_decode_ok(D, r, sizeof(S));
  const std::size_t bytes = decode_kernel_smem_bytes<S>(D, r, vector);
  if (vector && r == 4) return {decode_attend_kernel<Set, kEvict, S, kDpl, 4>, bytes};
  if (vector && r == 8) return {decode_attend_kernel<Set, kEvict, S, kDpl, 8>, bytes};
  return {decode_attend_kernel<Set, kEvict, S, kDpl, 0>, bytes};
}
inline constexpr int decode_dims_per_lane(std::int64_t D) {
  return D <= 64 ? 8 : D <= 128 ? 16 : 32;
}
// Dims: the head dim a composed variant fixed (HeadDims), whose kernels alone are instantiated.
template <class Set, bool kEvict, class S, class Dims = HeadDims<>>
DecodeKernel<S> decode_kernel_for(std::int64_t D, std::int64_t r, bool tc) {
  if constexpr (Dims::kFixed) {
    return decode_kernel_dims<Set, kEvict, S, decode_dims_per_lane(Dims::kKey)>(D, r, tc);
  } else {
    if (D <= 64) return decode_kernel_dims<Set, kEvict, S, 8>(D, r, tc);
    if (D <= 128) return decode_kernel_dims<Set, kEvict, S, 16>(D, r, tc);
    return decode_kernel_dims<Set, kEvict, S, 32>(D, r, tc);
  }
}

// How a call evicts (policy/prune.hpp): a threshold evictor's ln p (prune::LogThreshold) in
// DeviceCall::log_p, which the fused kernels test where they meet each row; any other evictor through
// per-item cuts that the cut kernels of ua_prune.cuh compute first; nothing (ua::detail::NoEvictor:
// prune::None), and then the decode and finish kernels are the instances without eviction (kEvict =
// false: no threshold test, no cut read, no dead marks of their own).
template <class Ev>
inline constexpr bool kCutsPerItem = ua::detail::kEvicts<Ev> && !std::is_same_v<Ev, prune::LogThreshold>;
template <class Ev, class S>
void set_eviction(DeviceCall<S>& a, const Ev& ev, prune::Cut* cuts) {
  a.log_p = -std::numeric_limits<double>::infinity();
  if constexpr (std::is_same_v<Ev, prune::LogThreshold>)
    a.log_p = ev.log_p;
  else if constexpr (kCutsPerItem<Ev>)
    a.cuts = cuts;
}

// Before the first cut of a call (a cut reads every row in use as an entry): the rows decode steps marked
// dead leave every item of the cache (compact_kernel; an item without dead rows is not touched, and the
// kept rows, their order and λ do not change).
template <class S>
Status drop_dead_rows(const DeviceCache<S>& dev, DeviceCall<S> a, std::int64_t items, cudaStream_t stream) {
  a.cuts = nullptr;
  a.log_p = -std::numeric_limits<double>::infinity();
  const std::size_t bytes = finish_smem_bytes<S>(dev.D);
  KVMEM_RETURN_IF_ERROR(allow_shared(compact_kernel<S>, bytes));
  compact_kernel<S><<<unsigned(items), kFinishThreads, bytes, stream>>>(dev, a);
  KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua compact_kernel (before a prune rule's cuts)");
  return Status::ok();
}

// A decode launch's λ update and cuts (decode_cut_kernel over the launch's `items`, the grid x of its
// decode_attend_kernel), then that launch reads λ as it is and evicts by the cuts.
template <class Set, class Ev, class S>
Status decode_cuts(const DeviceCache<S>& dev, DeviceCall<S>& a, const Ev& ev, prune::Cut* cuts, std::int64_t items,
                   cudaStream_t stream) {
  decode_cut_kernel<Set, Ev, S><<<unsigned(items), kCutThreads, 0, stream>>>(dev, a, ev, cuts);
  KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua decode_cut_kernel");
  a.lambda_updated = true;
  return Status::ok();
}

}  // namespace ua_detail

// Prefill (decode == false: T tokens in chunks of opt.prefill_chunk) or one decode step (T = 1). `ev`: the
// evictor of the call's prune rule (policy/prune.hpp; Options::p's threshold for the calls without one).
// Dims: a composed variant's fixed head dim (HeadDims<D>: only the kernels of D are instantiated, and a
// cache of another head dim is refused), or HeadDims<> (the run-time choice).
template <class Set, class S, class Ev, class Dims>
Status ua_run(const Executor& exec, UaCache<S>& cache, const UaInputs<S>& in, const ua::Options& opt, const Ev& ev,
              TensorView<float, 4> out, TensorView<float, 3> lse, bool decode, Dims) {
  using namespace ua_detail;
  const ua::CacheShape& s = cache.shape_;
  KVMEM_RETURN_IF_ERROR(cache.check_valid());
  if (!Dims::key_may_be(s.head_dim))
    return invalid_argument("head_dim", "the variant's head dim " + std::to_string(Dims::kKey), s.head_dim);
  KVMEM_RETURN_IF_ERROR(cache.check_workspace());
  KVMEM_RETURN_IF_ERROR(ua::detail::validate_options(opt));
  KVMEM_RETURN_IF_ERROR(ua::detail::check_call_shapes(in, out, s.batch, s.query_heads, s.kv_heads, s.head_dim));
  const std::int64_t T = in.q.extent(2), B = s.batch, G = s.kv_heads, I = B * G, D = s.head_dim;
  if (!lse.empty())
    KVMEM_RETURN_IF_ERROR(check_shape(TensorView<const float, 3>(lse), {B, s.query_heads, T}, "lse [B,H,T]"));
  if (decode && T != 1) return invalid_argument("decode tokens (q dim 2)", 1, T);
  if (!decode && opt.prefill_chunk > cache.limits_.max_prefill_chunk)
    return invalid_argument(
        "Options prefill_chunk",
        kvmem::detail::concat("<= UaCacheLimits max_prefill_chunk = ", cache.limits_.max_prefill_chunk),
        opt.prefill_chunk);
  // Room for everything the call may append before evicting (the host backend's rule). The host bound
  // grows by T per call; only when it says "might not fit" are the true lengths read back.
  if (cache.bound_ + T > s.capacity) {
    std::vector<std::int64_t> len;
    KVMEM_RETURN_IF_ERROR(cache.lengths(len, exec.stream));
    if (cache.bound_ + T > s.capacity)
      return {StatusCode::kOutOfRange, kvmem::detail::concat("cache capacity: expected room for ", cache.bound_ + T,
                                                             " rows per (sequence, kv head) (longest ", cache.bound_,
                                                             " + ", T, " new tokens), got capacity ", s.capacity)};
  }
  DeviceCall<S> a = make_call<S>(in, out, lse);
  a.part_ml = cache.part_ml_;
  a.part_acc = cache.part_acc_;
  set_eviction(a, ev, cache.cuts_);
  a.evict_before_attention = opt.evict_before_attention;
  a.tokens = T;
  const auto& dev = cache.dev_;
  const std::int64_t r = cache.group_size();
  // With a shared pool, every sequence's pages for kept + T rows before anything runs; a sequence whose
  // slot is flagged or finds the pool dry is skipped (outputs zeroed, slot flagged, its pages back in
  // the pool). Items that own their pages cannot run dry: every sequence runs, no kernel counts pages,
  // and publishing counts them from the kept rows (publish_block).
  const bool own_pages = s.pool_pages == 0;
  a.slot_go = own_pages ? nullptr : cache.slot_go_;
  // Splits that fill every multiprocessor with the blocks the decode kernel plans for (decode_splits,
  // DecodeKernel::blocks_per_sm): the decode kernel reads the true length; an item of at most
  // kOneBlockMaxKept rows in use is decoded by one block (the others take their ticket and return), a longer
  // one is split in pieces of at least kDecodePiece rows. The reservation below sizes a decode's page moves
  // for these splits.
  DecodeKernel<S> dk{};
  if (decode)
    dk = decode_kernel_for<Set, ua::detail::kEvicts<Ev>, S, Dims>(D, r,
                                                                  cache.limits_.decode_tensor_cores && a.kv_rows16);
  a.splits = decode ? decode_splits(cache.limits_, cache.sm_count_, I, dk.blocks_per_sm)
                    : 0;  // a prefill sets its own per chunk
  if (!own_pages) {
    // A prune rule's cuts compact every item first (drop_dead_rows), so its decode moves no rows: the
    // reservation then asks for no fresh pages (splits = 0).
    DeviceCall<S> reserve = a;
    if constexpr (kCutsPerItem<Ev>) reserve.splits = 0;
    batch_reserve_kernel<S><<<1, 256, 0, exec.stream>>>(dev, reserve, cache.slot_go_, cache.overflow_, B, T);
    KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua batch_reserve_kernel");
  }
  if constexpr (kCutsPerItem<Ev>) KVMEM_RETURN_IF_ERROR(drop_dead_rows(dev, a, I, exec.stream));
  if (decode) {
    a.P = 1;
    a.lambda_new = nullptr;
    const DecodeKernel<S>& k = dk;
    KVMEM_RETURN_IF_ERROR(allow_shared(k.kernel, k.shared_bytes));
    if constexpr (kCutsPerItem<Ev>) KVMEM_RETURN_IF_ERROR(decode_cuts<Set>(dev, a, ev, cache.cuts_, I, exec.stream));
    k.kernel<<<dim3(unsigned(I), unsigned(a.splits)), kDecodeThreads, k.shared_bytes, exec.stream>>>(dev, a);
    KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua decode_attend_kernel");
  } else if (const std::int64_t super_rows = dense_prune_rows(cache, in, a, opt, r);
             s.pool_pages == 0 && a.cuts == nullptr && super_rows > 0 &&
             dense_kernel_for<Set, S, Dims>(in, D, r, false).kernel) {
    // contiguous items only: the dense prefill walks rows by address. With p = 0 the whole call is one
    // launch; with a threshold, launches of super_rows rows (whole chunks from the call's first row), each
    // masking at its chunk starts and followed by prune_compact_kernel, which marks its evicted rows dead
    // (λ = -inf) and compacts an item whose dead rows reach a sixteenth of its rows, so that the next one
    // walks the kept rows and at most that many dead ones (masked entries, weight 0). Every launch starts at
    // a chunk start: its first row tile takes the cache's λ, at or above ln p or -inf.
    // Rows a decode marked dead go first: the kernel walks rows [0, length) by address and appends after
    // them. Device lengths stay within the host bound plus the call's rows so far: the hand-off words below
    // cover them, and the capacity check above keeps them in the items' rows.
    const std::size_t cbytes = finish_smem_bytes<S>(D);
    KVMEM_RETURN_IF_ERROR(allow_shared(compact_kernel<S>, cbytes));
    compact_kernel<S><<<unsigned(I), kFinishThreads, cbytes, exec.stream>>>(dev, a);
    KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua compact_kernel");
    const bool pruned = a.log_p > -std::numeric_limits<double>::infinity();
    if (pruned) KVMEM_RETURN_IF_ERROR(allow_shared(prune_compact_kernel<S>, cbytes));
    const std::int64_t group = dense_item_group_for(cache.limits_.dense_item_group, cache.sm_count_, I);
    decltype(DenseKernel<S>::kernel) opted = nullptr;  // the kernel whose shared memory the call opted into
    for (std::int64_t t0 = 0; t0 < T; t0 += super_rows) {
      const std::int64_t rows = std::min(super_rows, T - t0), tiles = dense_row_tiles(rows, r);  // rows >= 1
      // a launch of one super-chunk of rows takes the skip past the decay's reach by its own rows: the
      // kept rows before it are within the reach (λ >= ln p)
      const DenseKernel<S> dense = dense_kernel_for<Set, S, Dims>(
          in, D, r,
          pruned ? (rows + kDnEntries - 1) / kDnEntries > cache.limits_.dense_skip_past_after_tiles
                 : dense_skips_past(cache, T));
      DeviceCall<S> sc = dense_call_rows(a, t0);
      sc.prune_tiles = pruned ? int(opt.prefill_chunk / dense_row_tile(r)) : 0;
      // the ticket, and the λ hand-off words of the rows this launch walks (the cache's rows, then its own)
      KVMEM_RETURN_IF_ERROR(
          to_status(cudaMemsetAsync(cache.dense_sync_, 0, 8, exec.stream), "cudaMemsetAsync dense prefill ticket"));
      KVMEM_RETURN_IF_ERROR(
          to_status(cudaMemset2DAsync(cache.dense_sync_ + 2, std::size_t(dev.stride) * 8, 0,
                                      std::size_t(cache.bound_ + t0 + rows) * 8, std::size_t(I), exec.stream),
                    "cudaMemsetAsync dense prefill hand-off"));
      if (dense.kernel != opted) {  // the shared-memory opt-in is a driver call: once per kernel of the call
        KVMEM_RETURN_IF_ERROR(allow_shared(dense.kernel, dense.shared_bytes));
        opted = dense.kernel;
      }
      dense.kernel<<<unsigned(tiles * I), kDnThreads, dense.shared_bytes, exec.stream>>>(dev, sc, rows, I, tiles, group,
                                                                                         cache.dense_sync_);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua dense_prefill_tc_kernel");
      dense_advance_kernel<S><<<1, 128, 0, exec.stream>>>(dev, I, rows, a.slot_go);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua dense_advance_kernel");
      if (pruned) {
        prune_compact_kernel<S><<<unsigned(I), kFinishThreads, cbytes, exec.stream>>>(dev, sc);
        KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua prune_compact_kernel");
      }
    }
  } else {
    a.P = cache.limits_.max_prefill_chunk;
    a.lambda_new = cache.lambda_new_;
    const std::size_t fbytes = finish_smem_bytes<S>(D);
    const ChunkKernel<S> chunk = chunk_kernel_for<Set, S, Dims>(in, D, r);
    // shared-memory opt-ins are driver calls: once per call, not once per chunk
    KVMEM_RETURN_IF_ERROR(allow_shared(finish_kernel<ua::detail::kEvicts<Ev>, S>, fbytes));
    KVMEM_RETURN_IF_ERROR(allow_shared(chunk.kernel, chunk.shared_bytes));
    std::int64_t bound = cache.bound_;
    for (std::int64_t t0 = 0; t0 < T; t0 += opt.prefill_chunk) {
      const std::int64_t rows = std::min(opt.prefill_chunk, T - t0);
      const std::int64_t want = (bound + rows + 2 * kEntryTile - 1) / (2 * kEntryTile);
      a.splits = int(std::clamp<std::int64_t>(want, 1, cache.limits_.max_splits));
      chunk.kernel<<<dim3(unsigned(a.splits), unsigned(I)), unsigned(chunk.threads), chunk.shared_bytes, exec.stream>>>(
          dev, a, t0, rows);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua chunk_attend_kernel");
      merge_kernel<S>
          <<<dim3(unsigned(rows), unsigned(I)), kMergeThreads, 0, exec.stream>>>(dev, a, t0, rows, kEntryTile);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua merge_kernel");
      if constexpr (kCutsPerItem<Ev>) {
        prefill_cut_kernel<Ev, S><<<unsigned(I), kCutThreads, 0, exec.stream>>>(dev, a, ev, cache.cuts_, t0, rows);
        KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua prefill_cut_kernel");
      }
      finish_kernel<ua::detail::kEvicts<Ev>, S><<<unsigned(I), kFinishThreads, fbytes, exec.stream>>>(dev, a, t0, rows);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua finish_kernel (prefill)");
      bound += rows;
    }
  }
  cache.bound_ += T;
  // A decode over items that own their pages does no page accounting at all and publishes nothing (a
  // launch is a measurable part of a decode step, for counts of memory that cannot run dry): the next
  // publishing operation (publish_occupancy, a prefill, a step, a slot operation) counts them.
  if (own_pages && decode) return Status::ok();
  return publish(dev, exec.stream);
}

// Prefill T tokens of every sequence (spec UA.md 4.5): the caller rotates token t of sequence b at
// position cache.position(b) + t. out: [B,T,H,D] fp32, device. lse [B,H,T] optional.
template <DecaySet Set = decay::Universal, class S>
Status ua_prefill(const Executor& exec, UaCache<S>& cache, const UaInputs<S>& in, const ua::Options& opt,
                  TensorView<float, 4> out, TensorView<float, 3> lse = {}) {
  return ua_run<Set>(exec, cache, in, opt, prune::Threshold{opt.p}.evictor(opt.layer), out, lse, false, HeadDims<>{});
}

// One decode step (T = 1) of every sequence at position cache.position(b) (spec UA.md 4.4, 4.5).
template <DecaySet Set = decay::Universal, class S>
Status ua_decode(const Executor& exec, UaCache<S>& cache, const UaInputs<S>& in, const ua::Options& opt,
                 TensorView<float, 4> out) {
  return ua_run<Set>(exec, cache, in, opt, prune::Threshold{opt.p}.evictor(opt.layer), out, {}, true, HeadDims<>{});
}

// ---- sequence slots (DESIGN.md 3, core/slots.hpp, docs/slots-ua.md) ------------------------------

namespace ua_detail {

inline constexpr int kStepMergeBlocks = 32;  // a step's merge blocks per (prefill row, kv head) and chunk

// The cache's private parts the slot functions below use.
struct SlotAccess {
  template <class S>
  static const DeviceCache<S>& dev(const UaCache<S>& c) {
    return c.dev_;
  }
  template <class S>
  static StepRows step_rows(const UaCache<S>& c, const Rows& rows, std::int64_t tokens, int splits) {
    StepRows sr;
    sr.splits = splits;
    sr.slot = rows.slot.data();
    sr.start = rows.query_start.data();
    sr.rows = rows.count();
    sr.tokens = tokens;
    sr.max_len = rows.max_query_len;
    sr.max_slots = c.shape_.batch;
    sr.go = c.slot_go_;
    sr.first = c.slot_first_;
    sr.overflow = c.overflow_;
    sr.error = c.step_error_;
    sr.prefill_rows = c.prefill_rows_;
    sr.prefill_count = c.prefill_rows_ + c.shape_.batch;
    return sr;
  }
  template <class S>
  static void scratch(const UaCache<S>& c, DeviceCall<S>& a) {
    a.part_ml = c.part_ml_;
    a.part_acc = c.part_acc_;
    a.lambda_new = c.lambda_new_;
    a.slot_go = c.slot_go_;
    a.step_error = c.step_error_;
    a.prefill_rows = c.prefill_rows_;
    a.prefill_count = c.prefill_rows_ + c.shape_.batch;
  }
  template <class S>
  static int* overflow(const UaCache<S>& c) {
    return c.overflow_;
  }
  template <class S>
  static prune::Cut* cuts(const UaCache<S>& c) {
    return c.cuts_;
  }
  template <class S>
  static const int* step_error(const UaCache<S>& c) {
    return c.step_error_;
  }
  // The host's length bound is unknown after a step (the device decided every row): the next
  // fixed-batch call reads the lengths back before it trusts it.
  template <class S>
  static void forget_bound(UaCache<S>& c) {
    c.bound_ = c.shape_.capacity;
  }
  template <class S>
  static void set_bound(UaCache<S>& c, std::int64_t bound) {
    c.bound_ = bound;
  }
  template <class S>
  static std::int64_t* report(const UaCache<S>& c) {
    return c.report_;
  }
  // The list check of a slot operation (slot_lists.cuh): the step status word and the rows' check
  // scratch, which no step uses between steps.
  template <class S>
  static Status check_slot_list(const cuda::Executor& exec, UaCache<S>& c, const std::int32_t* src,
                                const std::int32_t* dst, std::int64_t n, slot_lists::Args& out) {
    return slot_lists::launch_check(exec.stream, src, dst, n, c.shape_.batch, c.slot_first_, c.step_error_, out);
  }

  template <class S>
  static int sm_count(const UaCache<S>& c) {
    return c.sm_count_;
  }
  template <class S>
  static int* publish_ticket(const UaCache<S>& c) {
    return c.publish_ticket_;
  }
};

// A packed step's device arguments: b is the row's first token and each *_b stride is the token stride
// (DeviceCall), so the kernels' b * x_b + t * x_t addresses token b + t.
template <class S>
DeviceCall<S> make_step_call(const ua::PackedInputsOf<input_type_t<S>>& in, const Rows& rows, TensorView<float, 3> out,
                             TensorView<float, 2> lse) {
  DeviceCall<S> a;
  a.q = in.q.data();
  a.q_b = a.q_t = in.q.stride(0), a.q_h = in.q.stride(1);
  a.k = in.k.data();
  a.k_b = a.k_t = in.k.stride(0), a.k_g = in.k.stride(1);
  a.v = in.v.data();
  a.v_b = a.v_t = in.v.stride(0), a.v_g = in.v.stride(1);
  a.kv_rows16 = rows_16byte_aligned(in.k) && rows_16byte_aligned(in.v);
  a.z_k = in.z_k.data();
  a.zk_b = a.zk_t = in.z_k.stride(0), a.zk_g = in.z_k.stride(1);
  a.z_q = in.z_q.data();
  a.zq_b = a.zq_t = in.z_q.stride(0), a.zq_g = in.z_q.stride(1);
  if (!in.z_o.empty()) {
    a.z_o = in.z_o.data();
    a.zo_b = a.zo_t = in.z_o.stride(0), a.zo_h = in.z_o.stride(1);
  }
  a.out = out.data();
  a.o_b = a.o_t = out.stride(0), a.o_h = out.stride(1);
  if (!lse.empty()) {
    a.lse = lse.data();
    a.l_b = a.l_t = lse.stride(0), a.l_h = lse.stride(1);
  }
  a.row_slot = rows.slot.data();
  a.row_start = rows.query_start.data();
  return a;
}

// The chunk kernel of a step: chunk_kernel_for's choice, made from the packed views' alignment.
template <class Set, class S, class Dims = HeadDims<>>
ChunkKernel<S> step_chunk_kernel_for(const ua::PackedInputsOf<input_type_t<S>>& in, std::int64_t D, std::int64_t r) {
  return chunk_kernel_of<Set, S, Dims>(
      rows_16byte_aligned(in.q) && rows_16byte_aligned(in.k) && rows_16byte_aligned(in.v), D, r);
}

template <class S>
Status check_cache(const UaCache<S>& cache) {
  if (!cache.valid()) return invalid_argument("cache", "a cache made by UaCache::create", "an empty cache");
  return Status::ok();
}
template <class S>
Status check_slot(const UaCache<S>& cache, std::int64_t slot) {
  KVMEM_RETURN_IF_ERROR(check_cache(cache));
  if (slot < 0 || slot >= cache.max_slots())
    return {StatusCode::kOutOfRange,
            kvmem::detail::concat("slot: expected 0 <= slot < max_slots = ", cache.max_slots(), ", got ", slot)};
  return Status::ok();
}

// The host's check_pool message for a copy or import the pool could not hold (report as
// copy_pages_kernel writes it); ok when it could.
template <class S>
Status pool_refusal(const UaCache<S>& cache, const std::int64_t* r, const char* what) {
  if (r[0] == 0) return Status::ok();
  return {StatusCode::kOutOfRange,
          kvmem::detail::concat(what, ": needs ", r[1], " pages of ", cache.shape().page_rows, " rows, the pool has ",
                                r[2], " free (+ ", r[3], " the replaced rows return)")};
}

// Slot `slot` of the device cache as slot 0 of a host cache of `capacity` rows (the host record code
// then writes it: one record format for every backend). Synchronises `stream`.
template <class S>
Status download_slot(const UaCache<S>& cache, std::int64_t slot, ua::PrunedCache<S>& host, cudaStream_t stream) {
  const ua::CacheShape& s = cache.shape();
  const DeviceCache<S>& d = SlotAccess::dev(cache);
  const std::int64_t G = s.kv_heads, D = s.head_dim;
  std::vector<std::int64_t> length(static_cast<std::size_t>(G)), counter(static_cast<std::size_t>(G));
  KVMEM_RETURN_IF_ERROR(to_status(cudaMemcpyAsync(length.data(), d.length + slot * G,
                                                  length.size() * sizeof(std::int64_t), cudaMemcpyDeviceToHost, stream),
                                  "export lengths"));
  KVMEM_RETURN_IF_ERROR(
      to_status(cudaMemcpyAsync(counter.data(), d.counter + slot * G, counter.size() * sizeof(std::int64_t),
                                cudaMemcpyDeviceToHost, stream),
                "export position"));
  KVMEM_RETURN_IF_ERROR(to_status(cudaStreamSynchronize(stream), "export sync"));
  const std::int64_t longest = *std::max_element(length.begin(), length.end());
  KVMEM_RETURN_IF_ERROR(
      ua::PrunedCache<S>::create({1, s.query_heads, G, D, std::max<std::int64_t>(longest, 1), s.page_rows}, host));
  for (std::int64_t g = 0; g < G; ++g) {
    auto v = host.item_view(0, g);  // the host cache's own pages: contiguous rows
    const std::int64_t n = length[std::size_t(g)];
    std::vector<std::int64_t> rows;
    KVMEM_RETURN_IF_ERROR(cache.page_rows_of(slot * G + g, n, rows, stream));
    KVMEM_RETURN_IF_ERROR(cache.copy_item_rows(d.keys, v.keys, D, n, rows, true, stream));
    KVMEM_RETURN_IF_ERROR(cache.copy_item_rows(d.values, v.values, D, n, rows, true, stream));
    KVMEM_RETURN_IF_ERROR(cache.copy_item_rows(d.lambda, v.lambda, 1, n, rows, true, stream));
    KVMEM_RETURN_IF_ERROR(cache.copy_item_rows(d.key_logit, v.key_logit, 1, n, rows, true, stream));
    KVMEM_RETURN_IF_ERROR(cache.copy_item_rows(d.pos, v.pos, 1, n, rows, true, stream));
    if constexpr (is_row_scaled_v<S>) {
      KVMEM_RETURN_IF_ERROR(cache.copy_item_rows(d.key_scale, v.key_scale, 1, n, rows, true, stream));
      KVMEM_RETURN_IF_ERROR(cache.copy_item_rows(d.value_scale, v.value_scale, 1, n, rows, true, stream));
    }
    KVMEM_RETURN_IF_ERROR(to_status(cudaStreamSynchronize(stream), "export sync"));
    // the kept rows only, in order: rows a decode marked dead (λ = -inf) wait for a compaction
    std::int64_t kept = 0;
    for (std::int64_t e = 0; e < n; ++e) {
      if (v.lambda[e] == -std::numeric_limits<float>::infinity()) continue;
      if (kept != e) {
        std::copy_n(v.keys + e * D, D, v.keys + kept * D);
        std::copy_n(v.values + e * D, D, v.values + kept * D);
        v.lambda[kept] = v.lambda[e];
        v.key_logit[kept] = v.key_logit[e];
        v.pos[kept] = v.pos[e];
        if constexpr (is_row_scaled_v<S>) {
          v.key_scale[kept] = v.key_scale[e];
          v.value_scale[kept] = v.value_scale[e];
        }
      }
      ++kept;
    }
    *v.length = kept;
  }
  host.set_position(0, counter[0]);
  return Status::ok();
}

}  // namespace ua_detail

// Dense UA over T tokens (spec UA.md 2) in a scratch cache the caller made once: out [B,T,H,D],
// optional lse [B,H,T] and lambda_last [B,G,T] (contiguous). `scratch` has the inputs' B, H, G, D, a
// capacity >= T and pool_pages = 0; it is emptied on exec.stream (every slot reset) and the call runs as
// a chunked prefill with p = 0 into it (memory O(B*G*T*D), never L x L). Nothing is allocated and
// nothing waits for the device: the scratch cache holds the rows until the next call.
template <DecaySet Set = decay::Universal, class S>
Status ua_forward(const Executor& exec, UaCache<S>& scratch, const UaInputs<S>& in, TensorView<float, 4> out,
                  TensorView<float, 3> lse = {}, TensorView<float, 3> lambda_last = {}) {
  const std::int64_t B = in.q.extent(0), H = in.q.extent(1), T = in.q.extent(2), D = in.q.extent(3), G = in.k.extent(1);
  if (G <= 0 || H % G != 0) return invalid_argument("H % G (q dim 1, k dim 1)", 0, G > 0 ? H % G : G);
  KVMEM_RETURN_IF_ERROR(ua_detail::check_cache(scratch));
  const ua::CacheShape& s = scratch.shape();
  if (s.batch != B || s.query_heads != H || s.kv_heads != G || s.head_dim != D || s.capacity < T || s.pool_pages != 0)
    return invalid_argument(
        "scratch cache shape",
        kvmem::detail::concat("{", B, ", ", H, ", ", G, ", ", D, ", capacity >= ", T, ", pool_pages 0}"),
        kvmem::detail::concat("{", s.batch, ", ", s.query_heads, ", ", s.kv_heads, ", ", s.head_dim, ", ", s.capacity,
                              ", pool_pages ", s.pool_pages, "}"));
  if (!lambda_last.empty()) {
    KVMEM_RETURN_IF_ERROR(check_shape(TensorView<const float, 3>(lambda_last), {B, G, T}, "lambda_last [B,G,T]"));
    if (!lambda_last.is_contiguous()) return invalid_argument("lambda_last", "a contiguous view", "a strided view");
  }
  ua_detail::reset_slots_kernel<S><<<unsigned(B), 32, 0, exec.stream>>>(
      scratch.device(), ua_detail::SlotAccess::overflow(scratch), nullptr, -1, nullptr, nullptr);
  KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua reset_slots_kernel (ua_forward)");
  ua_detail::SlotAccess::set_bound(scratch, 0);
  KVMEM_RETURN_IF_ERROR(ua_prefill<Set>(exec, scratch, in, ua::Options{}, out, lse));
  if (!lambda_last.empty() && T > 0) {  // no eviction: row j of every item is position j, λ_j = Λ_{T-1, j}
    const std::size_t row = std::size_t(T) * sizeof(float),
                      pitch = std::size_t(scratch.device().stride) * sizeof(float);
    KVMEM_RETURN_IF_ERROR(to_status(cudaMemcpy2DAsync(lambda_last.data(), row, scratch.device().lambda, pitch, row,
                                                      std::size_t(B * G), cudaMemcpyDeviceToDevice, exec.stream),
                                    "lambda_last copy"));
  }
  return Status::ok();
}

// The same without a scratch cache: makes one for the call (an allocation) and waits for the work that
// reads it before freeing it (a stream synchronisation). Engines keep a cache and call the form above.
template <DecaySet Set = decay::Universal, class S>
Status ua_forward(const Executor& exec, const ua::InputsOf<S>& in, TensorView<float, 4> out,
                  TensorView<float, 3> lse = {}, TensorView<float, 3> lambda_last = {}) {
  const std::int64_t B = in.q.extent(0), H = in.q.extent(1), T = in.q.extent(2), D = in.q.extent(3), G = in.k.extent(1);
  if (G <= 0 || H % G != 0) return invalid_argument("H % G (q dim 1, k dim 1)", 0, G > 0 ? H % G : G);
  UaCache<S> scratch;
  KVMEM_RETURN_IF_ERROR(UaCache<S>::create({B, H, G, D, std::max<std::int64_t>(T, 1), 16}, scratch));
  KVMEM_RETURN_IF_ERROR(ua_forward<Set>(exec, scratch, in, out, lse, lambda_last));
  return to_status(cudaStreamSynchronize(exec.stream), "ua_forward sync");
}

template <class S>
Status UaCache<S>::step_status(const Executor& exec) {
  KVMEM_RETURN_IF_ERROR(check_valid());
  const cudaStream_t stream = exec.stream;
  int e[4] = {};
  KVMEM_RETURN_IF_ERROR(
      to_status(cudaMemcpyAsync(e, step_error_, sizeof e, cudaMemcpyDeviceToHost, stream), "step status copy"));
  KVMEM_RETURN_IF_ERROR(to_status(cudaStreamSynchronize(stream), "step status sync"));
  if (e[0] != ua_detail::kStepOk) {
    KVMEM_RETURN_IF_ERROR(to_status(cudaMemsetAsync(step_error_, 0, sizeof e, stream), "clear step status"));
    KVMEM_RETURN_IF_ERROR(to_status(cudaStreamSynchronize(stream), "step status sync"));
  }
  if (e[0] == slot_lists::kCopyPoolDry) {
    const std::int64_t r[4] = {1, e[1], e[2], e[3]};
    return ua_detail::pool_refusal(*this, r, "copy_slots");
  }
  if (e[0] >= slot_lists::kFirstCode) return slot_lists::slot_list_status(e[0], e[1], e[2], shape_.batch);
  const std::string at = kvmem::detail::indexed("", e[1]);
  switch (e[0]) {
    case ua_detail::kStepOk:
      return Status::ok();
    case ua_detail::kStepFirstStart:
      return invalid_argument("query_start[0]", 0, e[2]);
    case ua_detail::kStepDecreasing:
      return invalid_argument(
          "query_start" + at,
          "<= query_start[" + std::to_string(e[1] + 1) + "] = " + std::to_string(e[3]) + " (non-decreasing)", e[2]);
    case ua_detail::kStepLastStart:
      return invalid_argument("query_start" + at, "the packed token count", e[2]);
    case ua_detail::kStepSlotRange:
      return {StatusCode::kOutOfRange, "slot" + at + ": expected -1 (padding) or 0 <= slot < max_slots = " +
                                           std::to_string(shape_.batch) + ", got " + std::to_string(e[2])};
    case ua_detail::kStepOverBound:
      return row_over_bound(e[1], e[2], e[3]);
    default:
      return invalid_argument("slot" + at, "a slot used by no earlier row of this step", e[2]);
  }
}

}  // namespace kvmem::cuda

namespace kvmem::ua {

template <>
struct Backend<cuda::Executor> {
  template <class S>
  using cache_type = cuda::UaCache<S>;
};

// ua::prefill, decode and forward with the host's signatures (ua/ops.hpp), over device memory: the
// same calls as cuda::ua_prefill, ua_decode and ua_forward. The eviction runs Options::p's threshold, or
// with a prune policy `rule` in place of Options::p (which must then be 0) the policy's evictor at
// Options::layer (ua_prune.cuh), as on the host.
template <DecaySet Set = decay::Universal, class S>
Status prefill(const cuda::Executor& exec, cuda::UaCache<S>& cache, const InputsOf<input_type_t<S>>& in,
               const Options& opt, TensorView<float, 4> out) {
  return cuda::ua_prefill<Set>(exec, cache, in, opt, out);
}
template <DecaySet Set = decay::Universal, PrunePolicy Rule, class S>
Status prefill(const cuda::Executor& exec, cuda::UaCache<S>& cache, const InputsOf<input_type_t<S>>& in,
               const Options& opt, const Rule& rule, TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_rule(rule, opt));
  return cuda::ua_run<Set>(exec, cache, in, opt, detail::evictor_of(rule, opt), out, {}, false, HeadDims<>{});
}
template <DecaySet Set = decay::Universal, class S>
Status decode(const cuda::Executor& exec, cuda::UaCache<S>& cache, const InputsOf<input_type_t<S>>& in,
              const Options& opt, TensorView<float, 4> out) {
  return cuda::ua_decode<Set>(exec, cache, in, opt, out);
}
template <DecaySet Set = decay::Universal, PrunePolicy Rule, class S>
Status decode(const cuda::Executor& exec, cuda::UaCache<S>& cache, const InputsOf<input_type_t<S>>& in,
              const Options& opt, const Rule& rule, TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_rule(rule, opt));
  return cuda::ua_run<Set>(exec, cache, in, opt, detail::evictor_of(rule, opt), out, {}, true, HeadDims<>{});
}
// The calls of a composed variant with a fixed head dim (ua::Attention<.., HeadDim>, which passes
// HeadDims<HeadDim>): the policy overloads above, compiling only the kernels of that head dim (a cache of
// another head dim is refused with a Status).
template <DecaySet Set = decay::Universal, std::int64_t kD, PrunePolicy Rule, class S>
Status prefill(HeadDims<kD> dims, const cuda::Executor& exec, cuda::UaCache<S>& cache,
               const InputsOf<input_type_t<S>>& in, const Options& opt, const Rule& rule, TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_rule(rule, opt));
  return cuda::ua_run<Set>(exec, cache, in, opt, detail::evictor_of(rule, opt), out, {}, false, dims);
}
template <DecaySet Set = decay::Universal, std::int64_t kD, PrunePolicy Rule, class S>
Status decode(HeadDims<kD> dims, const cuda::Executor& exec, cuda::UaCache<S>& cache,
              const InputsOf<input_type_t<S>>& in, const Options& opt, const Rule& rule, TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_rule(rule, opt));
  return cuda::ua_run<Set>(exec, cache, in, opt, detail::evictor_of(rule, opt), out, {}, true, dims);
}
// float inputs: the host's forward template (any executor) with one more constraint, so it is the more
// constrained match for a cuda::Executor; bf16 and fp16 inputs only this backend takes.
template <DecaySet Set = decay::Universal, class Exec>
requires std::is_same_v<Exec, cuda::Executor> Status forward(const Exec& exec, const Inputs& in,
                                                             TensorView<float, 4> out, TensorView<float, 3> lse = {},
                                                             TensorView<float, 3> lambda_last = {}) {
  return cuda::ua_forward<Set>(exec, in, out, lse, lambda_last);
}
template <DecaySet Set = decay::Universal>
Status forward(const cuda::Executor& exec, const InputsOf<bf16>& in, TensorView<float, 4> out,
               TensorView<float, 3> lse = {}, TensorView<float, 3> lambda_last = {}) {
  return cuda::ua_forward<Set>(exec, in, out, lse, lambda_last);
}
template <DecaySet Set = decay::Universal>
Status forward(const cuda::Executor& exec, const InputsOf<fp16>& in, TensorView<float, 4> out,
               TensorView<float, 3> lse = {}, TensorView<float, 3> lambda_last = {}) {
  return cuda::ua_forward<Set>(exec, in, out, lse, lambda_last);
}

// One step of a ragged batch of sequence slots on the CUDA backend: the host ua::step's arguments, in
// device memory (rows.slot, rows.query_start, the packed inputs, out, lse). Row r runs the tokens
// [query_start[r], query_start[r+1]) for slot[r]: 1 token is a decode step (spec UA.md 4.4, 4.5), more
// tokens a chunked prefill that continues the slot (4.5; chunks counted from the row's first token);
// padding rows (-1) are skipped and their out / lse rows zeroed; 0 tokens leave the slot untouched.
// out: [tokens,H,D] fp32; lse: [tokens,H] fp32 or empty.
//
// Every per-row decision is taken on the device from the device counters, and the host enqueues a
// fixed sequence of launches whose grids depend only on the row count, the token count and the cache
// (no allocation, no host synchronisation, no host state read), so one CUDA graph captured for a
// padded batch replays step after step:
//  - step_begin_kernel checks the rows as core/slots.hpp validate_rows does. A refused step changes
//    nothing and writes no output; the reason stays in the cache and refuses the later steps too,
//    until UaCache::step_status reads (and clears) the Status the host would have returned.
//  - A row whose slot has no room for kept + tokens rows in some kv head is skipped (out / lse rows
//    zeroed) and its slot flagged as overflowed (UaCache::overflowed), while the other rows step on;
//    a flagged slot is skipped by later steps until reset_slots, copy_slots or import_slot.
//  - decode_attend_kernel over (row, kv head) runs the 1-token rows; then ceil(L / prefill_chunk)
//    rounds of chunk, merge and finish launches run the prefill rows chunk by chunk (a round finds
//    nothing to do for rows that are shorter, and returns at once), where L bounds a row's tokens:
//    rows.max_query_len when given (step_begin_kernel refuses a step with a row naming a slot over it),
//    else the packed token count. With max_query_len = 1 no prefill round is launched.
// Shapes and options are checked on the host; values (NaN / Inf) are the caller's precondition, as for
// ua_prefill / ua_decode. With a prune policy `rule` in place of Options::p (which must then be 0), the
// eviction runs the policy's evictor at Options::layer (ua_prune.cuh), as on the host.
namespace detail {
template <class Set, class S, class Ev, class Dims = HeadDims<>>
Status cuda_step(const cuda::Executor& exec, cuda::UaCache<S>& cache, const Rows& rows,
                 const PackedInputsOf<input_type_t<S>>& in, const Options& opt, const Ev& ev, TensorView<float, 3> out,
                 TensorView<float, 2> lse, Dims = {}) {
  using namespace cuda::ua_detail;
  KVMEM_RETURN_IF_ERROR(cuda::ua_detail::check_cache(cache));
  if (!Dims::key_may_be(cache.shape().head_dim))
    return invalid_argument("head_dim", "the variant's head dim " + std::to_string(Dims::kKey), cache.shape().head_dim);
  KVMEM_RETURN_IF_ERROR(cache.check_workspace());
  KVMEM_RETURN_IF_ERROR(detail::validate_options(opt));
  const CacheShape& s = cache.shape();
  const std::int64_t N = in.tokens(), G = s.kv_heads, D = s.head_dim, R = rows.count();
  const std::int64_t r = cache.group_size();
  if (opt.prefill_chunk > cache.limits().max_prefill_chunk)
    return invalid_argument(
        "Options prefill_chunk",
        kvmem::detail::concat("<= UaCacheLimits max_prefill_chunk = ", cache.limits().max_prefill_chunk),
        opt.prefill_chunk);
  KVMEM_RETURN_IF_ERROR(detail::check_packed_step(s, in, out, lse));
  if (rows.query_start.extent(0) != R + 1)
    return invalid_argument("query_start shape", "[rows + 1] = [" + std::to_string(R + 1) + "]",
                            shape_string(rows.query_start.extents()));
  if (rows.max_query_len < 0) return invalid_argument("max_query_len", ">= 0 (0: no bound)", rows.max_query_len);
  if (R == 0) return N == 0 ? Status::ok() : invalid_argument("tokens", "0 for an empty batch", N);
  if (rows.slot.data() == nullptr || rows.query_start.data() == nullptr)
    return invalid_argument("slot, query_start", "device pointers", "nullptr");
  if ((R > 1 && rows.slot.stride(0) != 1) || rows.query_start.stride(0) != 1)
    return invalid_argument("slot, query_start stride", 1,
                            R > 1 && rows.slot.stride(0) != 1 ? rows.slot.stride(0) : rows.query_start.stride(0));
  // Prefill rows (>= 2 tokens each, each slot at most once): at most min(max_slots, rows, tokens / 2) of
  // them, listed by step_begin_kernel, none when the bound on a row's tokens is 1; none is longer than
  // that bound (`longest`), which sets the rounds. They run along grid y.
  const std::int64_t longest = rows.max_query_len > 0 ? std::min(rows.max_query_len, N) : N;
  const std::int64_t prefills = longest < 2 ? 0 : std::min({s.batch, R, N / 2});
  if (prefills * G > 65535)
    return {StatusCode::kUnsupported,
            kvmem::detail::concat("cuda UA step: min(max_slots, rows, tokens / 2) * kv_heads must be <= 65535 (a "
                                  "grid dimension), got ",
                                  prefills * G)};

  const DeviceCache<S>& dev = SlotAccess::dev(cache);
  DeviceCall<S> a = make_step_call<S>(in, rows, out, lse);
  SlotAccess::scratch(cache, a);
  set_eviction(a, ev, SlotAccess::cuts(cache));
  a.evict_before_attention = opt.evict_before_attention;
  const cudaStream_t stream = exec.stream;

  // the decode launch's kernel and splits: step_begin_kernel sizes the page moves of the decode rows for them
  const DecodeKernel<S> dk =
      decode_kernel_for<Set, ua::detail::kEvicts<Ev>, S, Dims>(D, r, cache.limits().decode_tensor_cores && a.kv_rows16);
  const int decode_splits_now = decode_splits(cache.limits(), SlotAccess::sm_count(cache), R * G, dk.blocks_per_sm);
  // (a prune rule's cuts compact every item first, drop_dead_rows, so its decode moves no rows: no fresh pages)
  step_begin_kernel<S><<<1, kStepBeginThreads, 0, stream>>>(
      dev, SlotAccess::step_rows(cache, rows, N, kCutsPerItem<Ev> ? 0 : decode_splits_now));
  KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua step_begin_kernel");
  if constexpr (kCutsPerItem<Ev>) KVMEM_RETURN_IF_ERROR(drop_dead_rows(dev, a, s.batch * G, stream));
  {  // the 1-token rows (and the zeroed output of rows that do not run)
    DeviceCall<S> d = a;
    d.P = 1;
    d.lambda_new = nullptr;
    d.splits = decode_splits_now;
    // no prefill rounds follow: this launch is the step's last, and its last block publishes
    if (prefills == 0) d.publish_ticket = SlotAccess::publish_ticket(cache);
    const DecodeKernel<S>& k = dk;
    KVMEM_RETURN_IF_ERROR(cuda::allow_shared(k.kernel, k.shared_bytes));
    if constexpr (kCutsPerItem<Ev>)
      KVMEM_RETURN_IF_ERROR(decode_cuts<Set>(dev, d, ev, SlotAccess::cuts(cache), R * G, stream));
    k.kernel<<<dim3(unsigned(R * G), unsigned(d.splits)), kDecodeThreads, k.shared_bytes, stream>>>(dev, d);
    KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua step decode_attend_kernel");
  }
  // The prefill rows' rounds of chunks. A merge block takes every kStepMergeBlocks-th row of a chunk, so
  // the rounds of a decode-only step, which find no prefill row, launch few blocks.
  if (prefills > 0) {
    a.P = cache.limits().max_prefill_chunk;
    a.splits = cache.limits().max_splits;
    const std::size_t fbytes = finish_smem_bytes<S>(D);
    const ChunkKernel<S> chunk = step_chunk_kernel_for<Set, S, Dims>(in, D, r);
    KVMEM_RETURN_IF_ERROR(cuda::allow_shared(finish_kernel<ua::detail::kEvicts<Ev>, S>, fbytes));
    KVMEM_RETURN_IF_ERROR(cuda::allow_shared(chunk.kernel, chunk.shared_bytes));
    const unsigned items = unsigned(prefills * G);
    DeviceCall<S> fin = a;  // the last finish launch publishes (its last block)
    for (std::int64_t t0 = 0; t0 < longest; t0 += opt.prefill_chunk) {
      fin.publish_ticket = t0 + opt.prefill_chunk >= longest ? SlotAccess::publish_ticket(cache) : nullptr;
      const std::int64_t most = std::min({opt.prefill_chunk, longest - t0, std::int64_t(kStepMergeBlocks)});
      chunk.kernel<<<dim3(unsigned(a.splits), items), unsigned(chunk.threads), chunk.shared_bytes, stream>>>(
          dev, a, t0, opt.prefill_chunk);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua step chunk_attend_kernel");
      merge_kernel<S>
          <<<dim3(unsigned(most), items), kMergeThreads, 0, stream>>>(dev, a, t0, opt.prefill_chunk, kEntryTile);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua step merge_kernel");
      if constexpr (kCutsPerItem<Ev>) {
        prefill_cut_kernel<Ev, S>
            <<<items, kCutThreads, 0, stream>>>(dev, a, ev, SlotAccess::cuts(cache), t0, opt.prefill_chunk);
        KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua step prefill_cut_kernel");
      }
      finish_kernel<ua::detail::kEvicts<Ev>, S>
          <<<items, kFinishThreads, fbytes, stream>>>(dev, fin, t0, opt.prefill_chunk);
      KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua step finish_kernel");
    }
  }
  SlotAccess::forget_bound(cache);
  return Status::ok();  // published by the last block of the step's last launch
}
}  // namespace detail

template <DecaySet Set = decay::Universal, class S>
Status step(const cuda::Executor& exec, cuda::UaCache<S>& cache, const Rows& rows,
            const PackedInputsOf<input_type_t<S>>& in, const Options& opt, TensorView<float, 3> out,
            TensorView<float, 2> lse = {}) {
  return detail::cuda_step<Set>(exec, cache, rows, in, opt, prune::Threshold{opt.p}.evictor(opt.layer), out, lse);
}
template <DecaySet Set = decay::Universal, PrunePolicy Rule, class S>
Status step(const cuda::Executor& exec, cuda::UaCache<S>& cache, const Rows& rows,
            const PackedInputsOf<input_type_t<S>>& in, const Options& opt, const Rule& rule, TensorView<float, 3> out,
            TensorView<float, 2> lse = {}) {
  KVMEM_RETURN_IF_ERROR(detail::validate_rule(rule, opt));
  return detail::cuda_step<Set>(exec, cache, rows, in, opt, detail::evictor_of(rule, opt), out, lse);
}
// A composed variant's step with a fixed head dim (HeadDims<HeadDim>, as prefill and decode above).
template <DecaySet Set = decay::Universal, std::int64_t kD, PrunePolicy Rule, class S>
Status step(HeadDims<kD> dims, const cuda::Executor& exec, cuda::UaCache<S>& cache, const Rows& rows,
            const PackedInputsOf<input_type_t<S>>& in, const Options& opt, const Rule& rule, TensorView<float, 3> out,
            TensorView<float, 2> lse) {
  KVMEM_RETURN_IF_ERROR(detail::validate_rule(rule, opt));
  return detail::cuda_step<Set>(exec, cache, rows, in, opt, detail::evictor_of(rule, opt), out, lse, dims);
}

// Slot operations of the CUDA cache: the host's names, arguments and checks (ua/slots.hpp). Slot lists
// (slots, src, dst) are in device memory and checked there (slot_lists.cuh): the host checks lengths,
// strides and pointers and returns a Status for those at once; slot_list_check_kernel then checks the
// indices before anything changes. reset_slots and copy_slots enqueue launches whose grids depend only
// on the list length and the cache, allocate nothing and never synchronise, so they capture in a CUDA
// graph beside the steps. A list the device refuses (or, for copy_slots, a copy the pool cannot hold)
// changes nothing, the call having returned ok: UaCache::step_status returns the host's Status for it,
// and until then every later step and slot operation is refused too. The work reads the device lists,
// so they stay valid until it has run (stream order). Records are the host's UA record, written and
// read by the host code: a slot exported here imports on the host backend and the other way round.

// Empties the listed slots, restarts their positions and clears their overflow flags (a slot listed
// twice is reset once).
template <class S>
Status reset_slots(const cuda::Executor& exec, cuda::UaCache<S>& cache, TensorView<const std::int32_t, 1> slots) {
  using namespace cuda::ua_detail;
  KVMEM_RETURN_IF_ERROR(check_cache(cache));
  KVMEM_RETURN_IF_ERROR(cuda::slot_lists::check_device_slot_list(slots, "slots"));
  const std::int64_t n = slots.extent(0);
  if (n == 0) return Status::ok();
  const DeviceCache<S>& d = SlotAccess::dev(cache);
  cuda::slot_lists::Args check;
  KVMEM_RETURN_IF_ERROR(SlotAccess::check_slot_list(exec, cache, slots.data(), nullptr, n, check));
  reset_slots_kernel<S><<<unsigned(n), 32, 0, exec.stream>>>(d, SlotAccess::overflow(cache), slots.data(),
                                                             std::int32_t(0), check.status, check.mark);
  KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua reset_slots_kernel");
  return publish(d, exec.stream);
}

// Slot dst[i] becomes a copy of slot src[i] (fork): kept rows, λ, key-gate logits, positions, the
// position counter and the overflow flag, so the copy continues bit for bit like its source. A copy
// whose rows the page pool cannot hold is refused whole, as on the host (through step_status here).
template <class S>
Status copy_slots(const cuda::Executor& exec, cuda::UaCache<S>& cache, TensorView<const std::int32_t, 1> src,
                  TensorView<const std::int32_t, 1> dst) {
  using namespace cuda::ua_detail;
  KVMEM_RETURN_IF_ERROR(check_cache(cache));
  if (src.extent(0) != dst.extent(0)) return invalid_argument("dst count", src.extent(0), dst.extent(0));
  KVMEM_RETURN_IF_ERROR(cuda::slot_lists::check_device_slot_list(src, "src"));
  KVMEM_RETURN_IF_ERROR(cuda::slot_lists::check_device_slot_list(dst, "dst"));
  const std::int64_t n = src.extent(0);
  if (n == 0) return Status::ok();
  const DeviceCache<S>& d = SlotAccess::dev(cache);
  cuda::slot_lists::Args check;
  KVMEM_RETURN_IF_ERROR(SlotAccess::check_slot_list(exec, cache, src.data(), dst.data(), n, check));
  copy_pages_kernel<S><<<1, 1, 0, exec.stream>>>(d, src.data(), dst.data(), n, check.status);
  KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua copy_pages_kernel");
  copy_slots_kernel<S><<<dim3(unsigned(n), unsigned(d.G)), 256, 0, exec.stream>>>(d, SlotAccess::overflow(cache),
                                                                                  src.data(), dst.data(), check.status);
  KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua copy_slots_kernel");
  return publish(d, exec.stream);
}

// Bytes of the record of `slot` (0 for an empty cache, a slot outside it, or a failed read). Reads the
// slot's lengths after all work on the device (cudaDeviceSynchronize).
template <class S>
std::size_t export_bytes(const cuda::UaCache<S>& cache, std::int32_t slot) {
  using namespace cuda::ua_detail;
  if (!check_slot(cache, slot).is_ok() || cudaDeviceSynchronize() != cudaSuccess) return 0;
  PrunedCache<S> host;
  if (!download_slot(cache, slot, host, cudaStream_t{}).is_ok()) return 0;
  return export_bytes(host, 0);
}

// Writes the record of `slot` (ua/slots.hpp) into the first export_bytes(cache, slot) bytes of `out`
// (host memory), after the work enqueued on exec.stream (synchronises it).
template <class S>
Status export_slot(const cuda::Executor& exec, const cuda::UaCache<S>& cache, std::int32_t slot,
                   std::span<std::byte> out) {
  using namespace cuda::ua_detail;
  KVMEM_RETURN_IF_ERROR(check_slot(cache, slot));
  PrunedCache<S> host;
  KVMEM_RETURN_IF_ERROR(download_slot(cache, slot, host, exec.stream));
  return export_slot(exec, host, 0, out);
}

// Replaces `slot` with a record (any backend's export): checked whole by the host's import (version,
// shape, storage, lengths against this cache's capacity, positions, λ, values) before the slot changes;
// then the rows are copied in on exec.stream (synchronised before return) and the overflow flag cleared.
template <class S>
Status import_slot(const cuda::Executor& exec, cuda::UaCache<S>& cache, std::int32_t slot,
                   std::span<const std::byte> in) {
  using namespace cuda::ua_detail;
  KVMEM_RETURN_IF_ERROR(check_slot(cache, slot));
  const CacheShape& s = cache.shape();
  const std::int64_t G = s.kv_heads, D = s.head_dim;
  PrunedCache<S> host;
  KVMEM_RETURN_IF_ERROR(PrunedCache<S>::create({1, s.query_heads, G, D, s.capacity, s.page_rows}, host));
  KVMEM_RETURN_IF_ERROR(import_slot(exec, host, 0, in));
  const DeviceCache<S>& d = SlotAccess::dev(cache);
  std::vector<std::int64_t> length(static_cast<std::size_t>(G)), counter(static_cast<std::size_t>(G), host.position(0));
  for (std::int64_t g = 0; g < G; ++g) length[std::size_t(g)] = host.length(0, g);
  // the slot's pages for the record's rows (its old pages return first), or the host's refusal with
  // nothing changed; the lengths travel through the slot's next_length words (decode scratch)
  std::int64_t* report = SlotAccess::report(cache);
  KVMEM_RETURN_IF_ERROR(
      cuda::to_status(cudaMemcpyAsync(d.next_length + slot * G, length.data(), length.size() * sizeof(std::int64_t),
                                      cudaMemcpyHostToDevice, exec.stream),
                      "import lengths"));
  import_pages_kernel<S><<<1, 1, 0, exec.stream>>>(d, slot, d.next_length + slot * G, report);
  KVMEM_CUDA_RETURN_IF_LAUNCH_FAILED("ua import_pages_kernel");
  KVMEM_RETURN_IF_ERROR(publish(d, exec.stream));
  std::int64_t r[4] = {};
  KVMEM_RETURN_IF_ERROR(
      cuda::to_status(cudaMemcpyAsync(r, report, sizeof r, cudaMemcpyDeviceToHost, exec.stream), "import report"));
  KVMEM_RETURN_IF_ERROR(cuda::to_status(cudaStreamSynchronize(exec.stream), "import sync"));
  KVMEM_RETURN_IF_ERROR(pool_refusal(cache, r, "import_slot"));
  for (std::int64_t g = 0; g < G; ++g) {
    const std::int64_t n = length[std::size_t(g)];
    std::vector<std::int64_t> rows;
    KVMEM_RETURN_IF_ERROR(cache.page_rows_of(slot * G + g, n, rows, exec.stream));
    auto v = host.item_view(0, g);  // the one-slot host cache's own pages: contiguous rows
    KVMEM_RETURN_IF_ERROR(cache.copy_item_rows(d.keys, v.keys, D, n, rows, false, exec.stream));
    KVMEM_RETURN_IF_ERROR(cache.copy_item_rows(d.values, v.values, D, n, rows, false, exec.stream));
    KVMEM_RETURN_IF_ERROR(cache.copy_item_rows(d.lambda, v.lambda, 1, n, rows, false, exec.stream));
    KVMEM_RETURN_IF_ERROR(cache.copy_item_rows(d.key_logit, v.key_logit, 1, n, rows, false, exec.stream));
    KVMEM_RETURN_IF_ERROR(cache.copy_item_rows(d.pos, v.pos, 1, n, rows, false, exec.stream));
    if constexpr (is_row_scaled_v<S>) {
      KVMEM_RETURN_IF_ERROR(cache.copy_item_rows(d.key_scale, v.key_scale, 1, n, rows, false, exec.stream));
      KVMEM_RETURN_IF_ERROR(cache.copy_item_rows(d.value_scale, v.value_scale, 1, n, rows, false, exec.stream));
    }
  }
  KVMEM_RETURN_IF_ERROR(
      cuda::to_status(cudaMemcpyAsync(d.length + slot * G, length.data(), length.size() * sizeof(std::int64_t),
                                      cudaMemcpyHostToDevice, exec.stream),
                      "import lengths"));
  KVMEM_RETURN_IF_ERROR(
      cuda::to_status(cudaMemcpyAsync(d.counter + slot * G, counter.data(), counter.size() * sizeof(std::int64_t),
                                      cudaMemcpyHostToDevice, exec.stream),
                      "import position"));
  KVMEM_RETURN_IF_ERROR(cuda::to_status(
      cudaMemsetAsync(d.dead + slot * G, 0, std::size_t(G) * sizeof(std::int64_t), exec.stream), "import dead rows"));
  KVMEM_RETURN_IF_ERROR(cuda::to_status(
      cudaMemsetAsync(SlotAccess::overflow(cache) + slot, 0, sizeof(int), exec.stream), "import overflow flag"));
  // the host copies are freed on return
  return cuda::to_status(cudaStreamSynchronize(exec.stream), "import sync");
}

// Drops the last n tokens of `slot` exactly as the host does (ua/slots.hpp truncate): n = 0 changes
// nothing, n = the slot's tokens resets it, any other n is refused with the host's Status. Reads the
// slot's position after the work enqueued on exec.stream (synchronises it).
template <class S>
Status truncate(const cuda::Executor& exec, cuda::UaCache<S>& cache, std::int32_t slot, std::int64_t n) {
  using namespace cuda::ua_detail;
  KVMEM_RETURN_IF_ERROR(check_slot(cache, slot));
  const CacheShape& s = cache.shape();
  std::int64_t tokens = 0;
  KVMEM_RETURN_IF_ERROR(cuda::to_status(cudaMemcpyAsync(&tokens, SlotAccess::dev(cache).counter + slot * s.kv_heads,
                                                        sizeof(tokens), cudaMemcpyDeviceToHost, exec.stream),
                                        "truncate position"));
  KVMEM_RETURN_IF_ERROR(cuda::to_status(cudaStreamSynchronize(exec.stream), "truncate sync"));
  // the host's rules and messages, on a one-slot host cache at the same position
  PrunedCache<S> host;
  KVMEM_RETURN_IF_ERROR(PrunedCache<S>::create({1, s.query_heads, s.kv_heads, s.head_dim, 1, s.page_rows}, host));
  host.set_position(0, tokens);
  KVMEM_RETURN_IF_ERROR(truncate(exec, host, 0, n));
  if (n == 0) return Status::ok();
  return cache.reset_sequence(slot, exec.stream);
}

}  // namespace kvmem::ua
