// SPDX-License-Identifier: Apache-2.0
#pragma once
// Universal Attention on Kokkos: a pruned cache in the space's memory (UaCache) and the ua/
// operations for kokkos::Executor<Space> (prefill with pruning + compaction, decode with pruning,
// dense forward, and the sequence-slot step and slot operations of docs/slots-ua.md), running the
// shared bodies of kernel/ua_*.hpp.
//
// ua::PrunedCache keeps its rows in std::vector (host memory), so the Kokkos backend has its own cache
// with the same layout and semantics (rows [B, G, capacity, D], λ / key-gate logit / position per row,
// length and peak per (sequence, kv head), position counter per sequence) in Kokkos::Views, and
// overloads kvmem::ua::prefill / decode / forward for Executor<Space>:
//
//   kvmem::kokkos::UaCache<float, MemSpace> cache;
//   kvmem::kokkos::create_cache(exec, {B, H, G, D, capacity}, cache);
//   kvmem::ua::prefill(exec, cache, inputs, {.p = 0.05}, out);   // out [B,T,H,D]
//   kvmem::ua::decode(exec, cache, step, {.p = 0.05}, out1);     // out1 [B,1,H,D]
//
// A call runs as a sequence of kernels on exec.space (run_ua), chunk by chunk (spec UA.md 4.5: every
// chunk's eviction depends on the previous one; the launch count follows from the call's padded sizes
// and the chunk size, nothing is read back):
// - begin: each (sequence or row, kv head) item's running entry count and peak from the cache;
// - per chunk, open: a prefill item appends the chunk's tokens (one row per thread); a decode step adds
//   A_{j,t} to every cached λ_j (one entry per thread) and appends t;
// - per query block of kQueryTile rows of the chunk: the decay kernel, a team per (item, piece of
//   kKeyTile entries), computes its entries' decay tile over the threads and each entry's Λ over the
//   block in increasing position on one thread (so every λ is exact and the host's), into the bias
//   workspace; then the rows kernel spreads the block's (row, head) pairs of every item over many teams;
// - close: the entry count grows by the chunk and the prune evictor's entries go, compacted stably by
//   the item's team (decode: before the rows kernel when evict_before_attention, else after);
// - finish: lengths and peaks.
// The rows kernel runs in one of two orders (executor.hpp kHostOrder). Host spaces: a team takes
// kHostRows pairs, one per thread, each through the host's key tiles and online softmax
// (kernel::ua::attend_block's expressions in its order), so results are bitwise equal to the host
// backend's. Device spaces: a team takes one pair and shares its entries (logits one entry per thread,
// pieces of kKeyTile entries reduced by kernel::piece_weights and merged in a fixed order by
// kernel::merge_piece_factors, as KVM's device order), so no bit depends on the team size or on the
// call's other rows (decode == prefill exactly) and results differ from the host order in the last bits
// only (docs/kokkos.md). λ, the bias and eviction are the same in both orders.
//
// Memory: the cache holds the operations' workspace (running counts, the bias of one query block for
// every entry: kQueryTile floats per cached row), so prefill, decode and step allocate nothing. Team
// scratch: the decay tile (8 KB), the device order's row (logits of every entry, piece states: level 0
// up to kScratch0Bytes, level 1 beyond), the compaction's staged rows (about 16 KB). Lengths, positions
// and counters are read inside the kernels. Only with exec.checked does one reduction check finiteness
// and capacity first and its result is read back (validation before any change, DESIGN.md 3).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Kokkos_Core.hpp>

#include "kvmem/backend/kokkos/device_view.hpp"
#include "kvmem/backend/kokkos/executor.hpp"
#include "kvmem/backend/kokkos/slot_lists.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/slots.hpp"
#include "kvmem/core/softmax.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/kernel/attend.hpp"
#include "kvmem/kernel/ua_attend.hpp"
#include "kvmem/kernel/ua_decay.hpp"
#include "kvmem/kernel/ua_evict.hpp"
#include "kvmem/policy/decay.hpp"
#include "kvmem/ua/cache.hpp"
#include "kvmem/ua/ops.hpp"
#include "kvmem/ua/slots.hpp"

namespace kvmem::kokkos {

// The UA pruned cache in MemSpace (spec UA.md 2, 4.4, 4.5). Allocated once by create_cache.
template <class Storage, class MemSpace>
struct UaCache {
  static_assert(!is_row_scaled_v<Storage>,
                "kvmem::kokkos::UaCache: fp8 (kvmem::e4m3) storage runs on the host and CUDA backends; the Kokkos "
                "backend stores float, kvmem::bf16 or kvmem::fp16 (docs/compose.md, Supported combinations)");
  using storage_type = Storage;
  using memory_space = MemSpace;

  ua::CacheShape shape{0, 1, 1, 0, 0, 16};             // empty until create_cache: no slots, a group size of 1
  Kokkos::View<Storage*, MemSpace> keys, values;       // [B, G, capacity, D]
  Kokkos::View<float*, MemSpace> lambda, key_logit;    // [B, G, capacity]
  Kokkos::View<std::int64_t*, MemSpace> pos;           // [B, G, capacity]
  Kokkos::View<std::int64_t*, MemSpace> length, peak;  // [B, G]
  Kokkos::View<std::int64_t*, MemSpace> counter;       // [B] next absolute position
  Kokkos::View<std::int64_t*, MemSpace> admit;         // [B] step workspace: 1 when a row may advance the slot
  // Workspace of the operations, allocated here so that no operation allocates (DESIGN.md 3): each
  // item's entry count and peak between the kernels of a call, and Λ of one block of kQueryTile query
  // rows for every entry (the decay kernel writes it, the rows kernel reads it).
  Kokkos::View<std::int64_t*, MemSpace> live, top;  // [B, G]
  Kokkos::View<float*, MemSpace> bias;              // [B, G, kQueryTile, capacity]

  UaCache() = default;
  // A copy shares the Views (Kokkos semantics). A move leaves `o` empty (DESIGN.md 3): its shape says
  // "no slots" and it holds no View, so an operation on it is refused instead of running on the new
  // owner's memory.
  UaCache(const UaCache&) = default;
  UaCache& operator=(const UaCache&) = default;
  UaCache(UaCache&& o) noexcept { swap(o); }
  UaCache& operator=(UaCache&& o) noexcept {
    if (this != &o) {
      UaCache taken;
      taken.swap(o);
      swap(taken);
    }
    return *this;
  }
  void swap(UaCache& o) noexcept {
    std::swap(shape, o.shape);
    std::swap(keys, o.keys);
    std::swap(values, o.values);
    std::swap(lambda, o.lambda);
    std::swap(key_logit, o.key_logit);
    std::swap(pos, o.pos);
    std::swap(length, o.length);
    std::swap(peak, o.peak);
    std::swap(counter, o.counter);
    std::swap(admit, o.admit);
    std::swap(live, o.live);
    std::swap(top, o.top);
    std::swap(bias, o.bias);
  }

  // Allocates every View for shape s (as create_cache, which names the executor).
  static Status create(const ua::CacheShape& s, UaCache& out);

  [[nodiscard]] bool valid() const { return shape.capacity > 0 && counter.extent(0) == std::size_t(shape.batch); }
  // Sequence slots (CacheShape::batch); 0 for an empty cache.
  [[nodiscard]] std::int64_t max_slots() const { return valid() ? shape.batch : 0; }
  [[nodiscard]] std::int64_t group_size() const { return shape.query_heads / shape.kv_heads; }
};

template <class Storage, class MemSpace>
Status UaCache<Storage, MemSpace>::create(const ua::CacheShape& s, UaCache& out) {
  KVMEM_RETURN_IF_ERROR(ua::PrunedCache<Storage>::validate_shape(s));
  UaCache c;
  c.shape = s;
  const auto items = static_cast<std::size_t>(s.batch * s.kv_heads);
  const auto rows = items * static_cast<std::size_t>(s.capacity);
  const auto elems = rows * static_cast<std::size_t>(s.head_dim);
  c.keys = decltype(c.keys)("kvmem ua keys", elems);
  c.values = decltype(c.values)("kvmem ua values", elems);
  c.lambda = decltype(c.lambda)("kvmem ua lambda", rows);
  c.key_logit = decltype(c.key_logit)("kvmem ua key logit", rows);
  c.pos = decltype(c.pos)("kvmem ua positions", rows);
  c.length = decltype(c.length)("kvmem ua length", items);
  c.peak = decltype(c.peak)("kvmem ua peak", items);
  c.counter = decltype(c.counter)("kvmem ua counter", static_cast<std::size_t>(s.batch));
  c.admit = decltype(c.admit)("kvmem ua step admit", static_cast<std::size_t>(s.batch));
  c.live = decltype(c.live)("kvmem ua live entries", items);
  c.top = decltype(c.top)("kvmem ua call peak", items);
  c.bias = decltype(c.bias)("kvmem ua block bias", rows * static_cast<std::size_t>(kernel::ua::kQueryTile));
  out = std::move(c);
  return Status::ok();
}

template <class Storage = float, class Space, class MemSpace = typename Executor<Space>::memory_space>
Status create_cache(const Executor<Space>& /*exec*/, const ua::CacheShape& s, UaCache<Storage, MemSpace>& out) {
  static_assert(Kokkos::SpaceAccessibility<Space, MemSpace>::accessible,
                "kvmem::kokkos::create_cache: the execution space cannot access MemSpace");
  return UaCache<Storage, MemSpace>::create(s, out);
}

// Host copy of a UA cache's bookkeeping and rows (reports, tests, page reclamation): one device-to-host
// copy, outside prefill/decode.
struct UaCacheSnapshot {
  ua::CacheShape shape{};
  std::vector<std::int64_t> length, peak, counter, pos;  // [B*G], [B*G], [B], [B*G*capacity]
  std::vector<float> lambda;                             // [B*G*capacity]

  [[nodiscard]] std::int64_t item(std::int64_t b, std::int64_t g) const { return b * shape.kv_heads + g; }
  // Whether (b, g) is an item of the snapshot (false for every index of an empty cache's snapshot).
  [[nodiscard]] bool has(std::int64_t b, std::int64_t g) const {
    return b >= 0 && b < shape.batch && g >= 0 && g < shape.kv_heads && std::size_t(item(b, g)) < length.size();
  }
  // 0 / nullptr for an index outside the snapshot.
  [[nodiscard]] std::int64_t length_of(std::int64_t b, std::int64_t g) const {
    return has(b, g) ? length[std::size_t(item(b, g))] : 0;
  }
  [[nodiscard]] const std::int64_t* positions(std::int64_t b, std::int64_t g) const {
    return has(b, g) ? pos.data() + item(b, g) * shape.capacity : nullptr;
  }
  // Pages of (b, g) freed by the last operation, as ua::PrunedCache::freed_pages.
  [[nodiscard]] ua::PageRange freed_pages(std::int64_t b, std::int64_t g) const {
    if (!has(b, g)) return {};
    const std::int64_t pr = shape.page_rows;
    const std::int64_t first = (length_of(b, g) + pr - 1) / pr;
    const std::int64_t end = (peak[std::size_t(item(b, g))] + pr - 1) / pr;
    return {first, end > first ? end - first : 0};
  }
};

template <class Storage, class MemSpace>
UaCacheSnapshot snapshot(const UaCache<Storage, MemSpace>& cache) {
  UaCacheSnapshot s;
  s.shape = cache.shape;
  const auto copy = [](const auto& view, auto& vec) {
    auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), view);
    vec.assign(host.data(), host.data() + host.span());
  };
  copy(cache.length, s.length);
  copy(cache.peak, s.peak);
  copy(cache.counter, s.counter);
  copy(cache.pos, s.pos);
  copy(cache.lambda, s.lambda);
  return s;
}

namespace detail {

// The inputs of one prefill / decode / forward call as kernel-indexable views (ua::Inputs, float).
struct UaViews {
  DeviceView<const float, 4> q;    // [B,H,T,D]
  DeviceView<const float, 4> k;    // [B,G,T,D]
  DeviceView<const float, 4> v;    // [B,G,T,D]
  DeviceView<const float, 3> z_k;  // [B,G,T]
  DeviceView<const float, 3> z_q;  // [B,G,T]
  DeviceView<const float, 4> z_o;  // [B,T,H,D] (data == nullptr: no output gate)
  DeviceView<float, 4> out;        // [B,T,H,D]

  UaViews(const ua::Inputs& in, TensorView<float, 4> o) : q(in.q), k(in.k), v(in.v), z_k(in.z_k), z_q(in.z_q), out(o) {
    if (!in.z_o.empty()) z_o = DeviceView<const float, 4>(in.z_o);
  }
};

// One work item of a call as every kernel sees it: a (sequence or row, kv head) pair, the cache slot it
// runs on, its tokens and its kind. Each kernel derives it again from the call's inputs and the cache's
// lengths (which change only in the last kernel), so no flag passes between launches.
struct UaItemRef {
  std::int64_t slot = -1;  // the cache's sequence slot
  std::int64_t g = 0;      // kv head
  std::int64_t T = 0;      // tokens of the item in this call
  std::int64_t x0 = 0;     // first packed token (step) or 0
  bool runs = false;       // the item runs (sizes in range, room in the cache)
  bool decode = false;     // one decode step (spec UA.md 4.4) instead of chunked prefill (4.5)
};

// prefill / decode / forward: sequence b is batch row b of q [B,H,T,D], k, v [B,G,T,D], z_k, z_q [B,G,T],
// z_o and out [B,T,H,D]; lse [B,H,T] (forward; data nullptr: not written).
struct UaBatchIo {
  UaViews in;
  DeviceView<float, 3> lse;
  std::int64_t B = 0, G = 1, r = 1, T = 0;
  bool decode = false;

  KOKKOS_INLINE_FUNCTION std::int64_t items() const { return B * G; }
  // Unchecked calls skip an item without room for T more rows (it stays as it was).
  KOKKOS_INLINE_FUNCTION UaItemRef item(std::int64_t x, const std::int64_t* length, std::int64_t capacity) const {
    UaItemRef w;
    w.slot = x / G;
    w.g = x % G;
    w.T = T;
    w.decode = decode;
    w.runs = T > 0 && length[x] + T <= capacity;
    return w;
  }
  template <class Member>
  KOKKOS_INLINE_FUNCTION void zero_padding(const Member&, std::int64_t) const {}
  KOKKOS_INLINE_FUNCTION const float* q(const UaItemRef& w, std::int64_t h, std::int64_t t) const {
    return &in.q(w.slot, w.g * r + h, t, 0);
  }
  KOKKOS_INLINE_FUNCTION const float* k(const UaItemRef& w, std::int64_t t) const { return &in.k(w.slot, w.g, t, 0); }
  KOKKOS_INLINE_FUNCTION const float* v(const UaItemRef& w, std::int64_t t) const { return &in.v(w.slot, w.g, t, 0); }
  KOKKOS_INLINE_FUNCTION float z_k(const UaItemRef& w, std::int64_t t) const { return in.z_k(w.slot, w.g, t); }
  KOKKOS_INLINE_FUNCTION float z_q(const UaItemRef& w, std::int64_t t) const { return in.z_q(w.slot, w.g, t); }
  KOKKOS_INLINE_FUNCTION const float* z_o(const UaItemRef& w, std::int64_t h, std::int64_t t) const {
    return in.z_o.data != nullptr ? &in.z_o(w.slot, t, w.g * r + h, 0) : nullptr;
  }
  KOKKOS_INLINE_FUNCTION float* out(const UaItemRef& w, std::int64_t h, std::int64_t t) const {
    return &in.out(w.slot, t, w.g * r + h, 0);
  }
  KOKKOS_INLINE_FUNCTION float* lse_at(const UaItemRef& w, std::int64_t h, std::int64_t t) const {
    return lse.data != nullptr ? &lse(w.slot, w.g * r + h, t) : nullptr;
  }
};

// Packed inputs of one step as kernel views: q [tokens,H,D], k, v [tokens,G,D], z_k, z_q [tokens,G],
// z_o [tokens,H,D] (data nullptr: no output gate), out [tokens,H,D], lse [tokens,H] (data nullptr: not
// written), and the rows slot [rows], query_start [rows + 1] with their bound max_len on the tokens of a
// row naming a slot (Rows::max_query_len; 0: none).
struct UaPackedViews {
  DeviceView<const std::int32_t, 1> slot, query_start;
  DeviceView<const float, 3> q, k, v, z_o;
  DeviceView<const float, 2> z_k, z_q;
  DeviceView<float, 3> out;
  DeviceView<float, 2> lse;
  std::int64_t max_len = 0;
};

// One row of a step as the kernels see it: its slot (-1 padding), first packed token and token count.
struct UaRow {
  std::int64_t slot = -1, x0 = 0, T = 0;
  bool first = false;  // no earlier row names this slot (a later one is skipped: two rows would race)
  bool fits = false;   // sizes in range: starts within the tokens, slot within the cache, tokens within max_len
};

// ua::step: row x of the packed batch, kv head g, is work item x G + g; a row of one token is a decode
// step, a longer row a chunked prefill continuing its slot (as the host's ua::step).
struct UaStepIo {
  UaPackedViews in;
  const std::int64_t* admit = nullptr;  // [B] set by the admit kernel: 1 when the slot's row may run
  std::int64_t B = 0, G = 1, r = 1, R = 0;

  KOKKOS_INLINE_FUNCTION std::int64_t items() const { return R * G; }
  KOKKOS_INLINE_FUNCTION UaRow row(std::int64_t x) const {
    UaRow w;
    w.slot = in.slot(x);
    w.x0 = in.query_start(x);
    w.T = in.query_start(x + 1) - w.x0;
    w.fits = w.slot >= -1 && w.slot < B && w.T >= 0 && w.x0 >= 0 && w.x0 + w.T <= in.q.extent[0] &&
             (w.slot < 0 || in.max_len == 0 || w.T <= in.max_len);
    w.first = true;
    for (std::int64_t e = 0; e < x && w.slot >= 0; ++e)
      if (in.slot(e) == w.slot) w.first = false;
    return w;
  }
  // Whether row w may advance its slot: decided by the admit kernel before any item runs, from the
  // slot's lengths (room for T rows in every kv head, the conservative bound of ua::step).
  KOKKOS_INLINE_FUNCTION bool room(const UaRow& w, const std::int64_t* length, std::int64_t capacity) const {
    for (std::int64_t g = 0; g < G; ++g)
      if (length[w.slot * G + g] + w.T > capacity) return false;
    return true;
  }
  KOKKOS_INLINE_FUNCTION bool runs(const UaRow& w) const {
    return w.slot >= 0 && w.fits && w.first && w.T > 0 && admit[w.slot] != 0;
  }
  KOKKOS_INLINE_FUNCTION UaItemRef item(std::int64_t x, const std::int64_t*, std::int64_t) const {
    const UaRow w = row(x / G);
    UaItemRef it;
    it.slot = w.slot;
    it.g = x % G;
    it.T = w.T;
    it.x0 = w.x0;
    it.runs = runs(w);
    it.decode = w.T == 1;
    return it;
  }
  // Padding rows: inputs unread, the kv group's output (and lse) rows zeroed.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void zero_padding(const Member& team, std::int64_t x) const {
    const UaRow w = row(x / G);
    if (w.slot != -1 || !w.fits) return;
    const std::int64_t g = x % G, D = in.q.extent[2];
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, w.T * r * D), [&](const std::int64_t y) {
      const std::int64_t t = w.x0 + y / (r * D), h = g * r + (y / D) % r, d = y % D;
      in.out(t, h, d) = 0.0f;
      if (d == 0 && in.lse.data != nullptr) in.lse(t, h) = 0.0f;
    });
  }
  KOKKOS_INLINE_FUNCTION const float* q(const UaItemRef& w, std::int64_t h, std::int64_t t) const {
    return &in.q(w.x0 + t, w.g * r + h, 0);
  }
  KOKKOS_INLINE_FUNCTION const float* k(const UaItemRef& w, std::int64_t t) const { return &in.k(w.x0 + t, w.g, 0); }
  KOKKOS_INLINE_FUNCTION const float* v(const UaItemRef& w, std::int64_t t) const { return &in.v(w.x0 + t, w.g, 0); }
  KOKKOS_INLINE_FUNCTION float z_k(const UaItemRef& w, std::int64_t t) const { return in.z_k(w.x0 + t, w.g); }
  KOKKOS_INLINE_FUNCTION float z_q(const UaItemRef& w, std::int64_t t) const { return in.z_q(w.x0 + t, w.g); }
  KOKKOS_INLINE_FUNCTION const float* z_o(const UaItemRef& w, std::int64_t h, std::int64_t t) const {
    return in.z_o.data != nullptr ? &in.z_o(w.x0 + t, w.g * r + h, 0) : nullptr;
  }
  KOKKOS_INLINE_FUNCTION float* out(const UaItemRef& w, std::int64_t h, std::int64_t t) const {
    return &in.out(w.x0 + t, w.g * r + h, 0);
  }
  KOKKOS_INLINE_FUNCTION float* lse_at(const UaItemRef& w, std::int64_t h, std::int64_t t) const {
    return in.lse.data != nullptr ? &in.lse(w.x0 + t, w.g * r + h) : nullptr;
  }
};

// Entries per decay team and per softmax piece, and query rows per block (the host body's key and query
// tiles, kernel/ua_attend.hpp, so the host order visits the same tiles).
inline constexpr std::int64_t kUaPiece = kernel::ua::kKeyTile;
// Pieces whose per-element sums a device-order row team keeps in scratch at once ([kUaRowPieces, D]:
// 4 KB at D = 128 fp32), so the sums of many pieces run on the team's lanes at the same time.
inline constexpr std::int64_t kUaRowPieces = 8;
inline constexpr std::int64_t kUaBlock = kernel::ua::kQueryTile;

// The kernels of one call (UaRun), each a tagged operator().
struct UaBeginTag {};
struct UaOpenTag {};
struct UaDecayTag {};
struct UaRowsTag {};
struct UaCloseTag {};
struct UaFinishTag {};

// One prefill / decode / step call over a UaCache as a sequence of kernels on one execution space
// instance (launched by run_ua, spec UA.md 4.4, 4.5). Ev: the prune policy's evictor
// (policy/prune.hpp), or ua::detail::NoEvictor (prune::None: no eviction is compiled). Io: UaBatchIo or
// UaStepIo. An item's running entry count and peak live in the cache's `live` and `top` between the
// kernels; the bias workspace holds Λ of one query block (kQueryTile rows) for every entry.
template <class Set, class Storage, class Ev, class Io>
struct UaRun {
  Io io;
  Storage* keys;          // [B*G*capacity, D]
  Storage* values;        // [B*G*capacity, D]
  float* lambda;          // [B*G*capacity]
  float* key_logit;       // [B*G*capacity]
  std::int64_t* pos;      // [B*G*capacity]
  std::int64_t* length;   // [B*G]
  std::int64_t* peak;     // [B*G]
  std::int64_t* counter;  // [B]
  std::int64_t* live;     // [B*G] the item's entries between kernels
  std::int64_t* top;      // [B*G] the item's peak entries in this call
  float* bias;            // [B*G, kQueryTile, capacity]
  std::int64_t G = 1, r = 1, D = 0, capacity = 0, chunk = 1;
  Ev ev;
  bool prune = false;  // whether the evictor can evict (prune::active, decided on the host)
  bool evict_before_attention = true;
  // Launch choices (run_ua): the chunk c and query block s the kernels run, the close phase, the row
  // order (executor.hpp kHostOrder), the query rows per item of a rows launch, the (row, head) pairs of a
  // host-order team, the entries a compaction step moves.
  std::int64_t c = 0, s = 0;
  bool before = false;
  bool host_order = true;
  std::int64_t block_rows = kernel::ua::kQueryTile, host_rows = kHostRows, move_rows = 16;
  // Threads of a device-order row team (each with kRowLanes lanes and its own dot partials in scratch).
  std::int64_t row_threads = 1;

  KOKKOS_INLINE_FUNCTION std::int64_t item_of(const UaItemRef& w) const { return w.slot * G + w.g; }
  KOKKOS_INLINE_FUNCTION std::int64_t row0(std::int64_t i) const { return i * capacity; }
  // Local tokens [t0, t1) of chunk c of item w (empty when the item has fewer tokens).
  KOKKOS_INLINE_FUNCTION std::int64_t chunk_begin() const { return c * chunk; }
  KOKKOS_INLINE_FUNCTION std::int64_t chunk_end(const UaItemRef& w) const {
    return (c + 1) * chunk < w.T ? (c + 1) * chunk : w.T;
  }
  // Whether item w has work in chunk c (decode items only in chunk 0).
  KOKKOS_INLINE_FUNCTION bool active(const UaItemRef& w) const {
    return w.runs && (w.decode ? c == 0 : chunk_begin() < w.T);
  }
  // Entries the chunk adds: its tokens, or the decode step's one.
  KOKKOS_INLINE_FUNCTION std::int64_t added(const UaItemRef& w) const {
    return w.decode ? 1 : chunk_end(w) - chunk_begin();
  }

  // Start of the call: the running count and peak from the cache; padding rows zeroed.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(UaBeginTag, const Member& team) const {
    const std::int64_t x = team.league_rank();
    io.zero_padding(team, x);
    const UaItemRef w = io.item(x, length, capacity);
    if (!w.runs) return;
    const std::int64_t i = item_of(w);
    Kokkos::single(Kokkos::PerTeam(team), [&]() { live[i] = top[i] = length[i]; });
  }

  // Chunk c opens: a prefill item appends the chunk's tokens (spec UA.md 4.5 step 1) with λ = 0, one row
  // per thread; a decode item adds A_{j,t} to every cached λ_j (spec 4.4 step 1) and appends t (step 2).
  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(UaOpenTag, const Member& team) const {
    const UaItemRef w = io.item(team.league_rank(), length, capacity);
    if (!active(w)) return;
    const std::int64_t i = item_of(w), n = live[i], first = counter[w.slot], o = row0(i);
    Storage* K = keys + o * D;
    Storage* V = values + o * D;
    float* lam = lambda + o;
    float* zk = key_logit + o;
    std::int64_t* ps = pos + o;
    if (w.decode) {
      const float* k_t = io.k(w, 0);
      const float z_q = io.z_q(w, 0);
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n + 1), [&](const std::int64_t e) {
        if (e < n)
          kernel::ua::lambda_update<Set, float>(K + e * D, D, zk + e, ps + e, lam + e, 1, k_t, z_q, first, D);
        else
          kernel::ua::append_entry(K, V, lam, zk, ps, n, k_t, io.v(w, 0), io.z_k(w, 0), first, D);
      });
      return;
    }
    const std::int64_t t0 = chunk_begin();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, chunk_end(w) - t0), [&](const std::int64_t x) {
      kernel::ua::append_entry(K, V, lam, zk, ps, n + x, io.k(w, t0 + x), io.v(w, t0 + x), io.z_k(w, t0 + x),
                               first + t0 + x, D);
    });
  }

  // Query block s of chunk c of the prefill items (spec UA.md 4.2, 4.5 step 1): a team per (item, piece
  // of kUaPiece entries) computes the decay tile A_{e,m} of its entries and the block's positions (pairs
  // over the threads), then each entry's Λ_{m,e} over the block in increasing m on one thread
  // (kernel::ua::cumulative_decay), into the bias workspace, and moves λ_e to the block's last row. So
  // every λ and bias value is the host's, bit for bit, whatever the team size.
  KOKKOS_INLINE_FUNCTION std::size_t decay_scratch_bytes() const {
    return sizeof(float) * (kUaPiece * kUaBlock + kUaBlock);
  }

  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(UaDecayTag, const Member& team) const {
    const std::int64_t pieces = (capacity + kUaPiece - 1) / kUaPiece;
    const UaItemRef w = io.item(team.league_rank() / pieces, length, capacity);
    if (!active(w) || w.decode) return;
    const std::int64_t t0 = chunk_begin(), t1 = chunk_end(w), b0 = t0 + s * kUaBlock;
    if (b0 >= t1) return;
    const std::int64_t i = item_of(w), n = live[i] + (t1 - t0), e0 = (team.league_rank() % pieces) * kUaPiece;
    if (e0 >= n) return;
    const std::int64_t nr = t1 - b0 < kUaBlock ? t1 - b0 : kUaBlock, ne = n - e0 < kUaPiece ? n - e0 : kUaPiece;
    const std::int64_t m0 = counter[w.slot] + b0, m_last = m0 + nr - 1, o = row0(i);
    const Storage* K = keys + o * D;
    const float* zk = key_logit + o;
    const std::int64_t* ps = pos + o;
    if (ps[e0] > m_last) return;  // positions ascend: no entry of the piece is visible to the block
    float* decay = static_cast<float*>(team.team_scratch(0).get_shmem(decay_scratch_bytes()));  // [kUaPiece, kUaBlock]
    float* query_part = decay + kUaPiece * kUaBlock;                                            // [kUaBlock]
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nr),
                         [&](const std::int64_t x) { query_part[x] = kernel::ua::query_gate_part(io.z_q(w, b0 + x)); });
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, ne * nr), [&](const std::int64_t x) {
      const std::int64_t e = e0 + x / nr, y = x % nr, p = ps[e], m = m0 + y;
      if (p > m_last) return;  // not visible to the block: its bias is never read
      decay[(x / nr) * kUaBlock + y] =
          m > p ? kernel::ua::pair_decay<Set, float>(K + e * D, zk[e], kernel::ua::key_gate_part(zk[e]), p,
                                                     io.k(w, b0 + y), io.z_q(w, b0 + y), query_part[y], m, D)
                : 0.0f;
    });
    team.team_barrier();
    float* b = bias + i * kUaBlock * capacity;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, ne), [&](const std::int64_t x) {
      const std::int64_t e = e0 + x, p = ps[e];
      if (p > m_last) return;
      lambda[o + e] = kernel::ua::cumulative_decay(lambda[o + e], p, m0, decay + x * kUaBlock, nr, b + e, capacity);
    });
  }

  // The query row (local token t, head h) of item w: its entries [0, n) (ascending positions, every one
  // visible to the row) and their bias Λ_{t,e} (the decay workspace's row, or λ for a decode step).
  struct RowTask {
    UaItemRef w;
    std::int64_t i = 0, t = 0, h = 0, n = 0;
    const float* bias = nullptr;
    bool ok = false;
  };
  // Pair p of a rows launch for work item x: query row p / r of query block s of chunk c, head p % r.
  KOKKOS_INLINE_FUNCTION RowTask row_task(std::int64_t x, std::int64_t p) const {
    RowTask k;
    k.w = io.item(x, length, capacity);
    if (!active(k.w) || p >= r * block_rows) return k;
    const std::int64_t y = p / r;
    k.i = item_of(k.w);
    k.h = p % r;
    if (k.w.decode) {
      if (s != 0 || y != 0) return k;
      k.t = 0;
      k.n = live[k.i] + (evict_before_attention ? 0 : 1);  // a closed step already counts its entry
      k.bias = lambda + row0(k.i);                         // λ includes A_{., t} (spec 4.4 step 4)
    } else {
      const std::int64_t t0 = chunk_begin();
      k.t = t0 + s * kUaBlock + y;
      if (y >= kUaBlock || k.t >= chunk_end(k.w)) return k;
      k.n = live[k.i] + (k.t - t0) + 1;  // the survivors and the chunk's keys up to t
      k.bias = bias + (k.i * kUaBlock + y) * capacity;
    }
    k.ok = true;
    return k;
  }

  // A row in the host backend's order (kernel::ua::attend_block for one (head, row)): key tiles of kUaPiece
  // entries from entry 0 through one online softmax, the same expressions in the same order, so the row
  // is bitwise the host's where the host compiler builds it. acc: [D] of the thread's scratch.
  KOKKOS_INLINE_FUNCTION void row_in_host_order(const RowTask& k, float* acc) const {
    const std::int64_t o = row0(k.i);
    const Storage* K = keys + o * D;
    const Storage* V = values + o * D;
    const float* qrow = io.q(k.w, k.h, k.t);
    for (std::int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
    OnlineSoftmax<float> sm;
    float logits[kUaPiece];
    for (std::int64_t e0 = 0; e0 < k.n; e0 += kUaPiece) {
      const std::int64_t ne = k.n - e0 < kUaPiece ? k.n - e0 : kUaPiece;
      float block_max = negative_infinity<float>();
      for (std::int64_t e = 0; e < ne; ++e) {
        const float qk = kernel::ua::dot8<float>(qrow, K + (e0 + e) * D, D), b = k.bias[e0 + e];
        logits[e] = b == negative_infinity<float>() ? negative_infinity<float>() : qk + b;  // scale 1
        if (logits[e] > block_max) block_max = logits[e];
      }
      if (block_max == negative_infinity<float>()) continue;
      const float rescale = sm.raise_max(block_max);
      if (rescale != 1.0f)
        for (std::int64_t d = 0; d < D; ++d) acc[d] *= rescale;
      for (std::int64_t e = 0; e < ne; ++e) {
        const float wgt = sm.accumulate(logits[e]);
        if (wgt == 0.0f) continue;
        const Storage* vrow = V + (e0 + e) * D;
        for (std::int64_t d = 0; d < D; ++d) acc[d] += wgt * load_as<float>(vrow[d]);
      }
    }
    kernel::ua::finish_output_row(sm, acc, D, io.z_o(k.w, k.h, k.t), io.out(k.w, k.h, k.t), io.lse_at(k.w, k.h, k.t));
  }

  // The team scratch of a row in the device order: piece states [pieces + 1], logits (then weights)
  // [capacity], merge factors [pieces], the row's accumulator [D], one group's piece sums
  // [kUaRowPieces, D] and kRowLanes dot partials per thread.
  KOKKOS_INLINE_FUNCTION std::int64_t pieces_cap() const { return (capacity + kUaPiece - 1) / kUaPiece; }
  KOKKOS_INLINE_FUNCTION std::size_t row_scratch_bytes() const {
    return sizeof(kernel::PieceSoftmax<float>) * static_cast<std::size_t>(pieces_cap() + 1) +
           sizeof(float) *
               static_cast<std::size_t>(capacity + pieces_cap() + (1 + kUaRowPieces) * D + row_threads * kRowLanes);
  }
  KOKKOS_INLINE_FUNCTION int row_scratch_level() const { return row_scratch_bytes() <= kScratch0Bytes ? 0 : 1; }

  // A row in the device order, by the whole team: logits one entry per thread, its dot8 on the thread's
  // lanes in dot8's order (lane_dot) plus the bias as in the host order; pieces of kUaPiece entries
  // reduced one per thread (kernel::piece_weights), merged in increasing order
  // (kernel::merge_piece_factors); then groups of kUaRowPieces pieces: each (piece, element) sum over
  // the piece's entries in increasing order on a lane, and each element adds its group's pieces in
  // increasing order (the KVM device order's readout). No sum's order depends on the team size or on
  // other rows.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void row_in_device_order(const Member& team, const RowTask& k) const {
    using kernel::PieceSoftmax;
    auto* piece = static_cast<PieceSoftmax<float>*>(
        team.team_scratch(row_scratch_level()).get_shmem(row_scratch_bytes()));  // [pieces + 1]
    float* logit = reinterpret_cast<float*>(piece + pieces_cap() + 1);           // [capacity]
    float* factor = logit + capacity;                                            // [pieces]
    float* acc = factor + pieces_cap();                                          // [D]
    float* group = acc + D;                                                      // [kUaRowPieces, D]
    float* partial = group + kUaRowPieces * D + team.team_rank() * kRowLanes;    // [kRowLanes]
    PieceSoftmax<float>* whole = piece + pieces_cap();
    const std::int64_t o = row0(k.i), n = k.n, pieces = (n + kUaPiece - 1) / kUaPiece;
    const std::int64_t blocks = (D + kRowLanes - 1) / kRowLanes;
    const Storage* K = keys + o * D;
    const Storage* V = values + o * D;
    const float* qrow = io.q(k.w, k.h, k.t);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](const std::int64_t e) {
      lane_dot<float>(team, partial, qrow, K + e * D, D, [&](const float qk) {
        const float b = k.bias[e];
        logit[e] = b == negative_infinity<float>() ? negative_infinity<float>() : qk + b;  // scale 1
      });
    });
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blocks), [&](const std::int64_t x) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, kRowLanes), [&](const int l) {
        if (x * kRowLanes + l < D) acc[x * kRowLanes + l] = 0.0f;
      });
    });
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, pieces), [&](const std::int64_t p) {
      Kokkos::single(Kokkos::PerThread(team), [&]() {
        const std::int64_t j0 = p * kUaPiece;
        piece[p] = kernel::piece_weights(logit + j0, n - j0 < kUaPiece ? n - j0 : kUaPiece);
      });
    });
    team.team_barrier();
    Kokkos::single(Kokkos::PerTeam(team), [&]() { *whole = kernel::merge_piece_factors(piece, pieces, factor); });
    for (std::int64_t p0 = 0; p0 < pieces; p0 += kUaRowPieces) {
      const std::int64_t g = pieces - p0 < kUaRowPieces ? pieces - p0 : kUaRowPieces;
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, g * blocks), [&](const std::int64_t x) {
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, kRowLanes), [&](const int l) {
          const std::int64_t q = x / blocks, d = x % blocks * kRowLanes + l, j0 = (p0 + q) * kUaPiece;
          if (d >= D) return;
          const std::int64_t j1 = n < j0 + kUaPiece ? n : j0 + kUaPiece;
          float part = 0.0f;
          for (std::int64_t j = j0; j < j1; ++j) part += logit[j] * load_as<float>(V[j * D + d]);
          group[q * D + d] = part;
        });
      });
      team.team_barrier();  // also orders the merge's factors before their first use
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blocks), [&](const std::int64_t x) {
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, kRowLanes), [&](const int l) {
          const std::int64_t d = x * kRowLanes + l;
          if (d >= D) return;
          float a = acc[d];
          for (std::int64_t q = 0; q < g; ++q) a += factor[p0 + q] * group[q * D + d];
          acc[d] = a;
        });
      });
      team.team_barrier();
    }
    team.team_barrier();
    OnlineSoftmax<float> sm;
    sm.max = whole->max;
    sm.sum = whole->sum;
    const float inv = sm.normaliser();
    const float* zrow = io.z_o(k.w, k.h, k.t);
    float* orow = io.out(k.w, k.h, k.t);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blocks), [&](const std::int64_t x) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, kRowLanes), [&](const int l) {
        const std::int64_t d = x * kRowLanes + l;
        if (d >= D) return;
        float y = acc[d] * inv;
        if (zrow) y *= sigmoid(load_as<float>(zrow[d]));
        orow[d] = y;
      });
    });
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      if (float* l = io.lse_at(k.w, k.h, k.t)) *l = sm.lse();
    });
  }

  // Query block s of chunk c (or the decode step's row): host order, a team takes host_rows (row, head)
  // pairs of one item, one per thread; device order, a team takes one pair.
  KOKKOS_INLINE_FUNCTION std::int64_t row_teams_per_item() const {
    return host_order ? (r * block_rows + host_rows - 1) / host_rows : r * block_rows;
  }
  KOKKOS_INLINE_FUNCTION std::size_t host_row_scratch_bytes() const {
    return sizeof(float) * static_cast<std::size_t>(host_rows * D);
  }

  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(UaRowsTag, const Member& team) const {
    const std::int64_t per = row_teams_per_item();
    const std::int64_t x = team.league_rank() / per, block = team.league_rank() % per;
    if (!host_order) {
      const RowTask k = row_task(x, block);
      if (k.ok) row_in_device_order(team, k);
      return;
    }
    float* acc = static_cast<float*>(team.team_scratch(0).get_shmem(host_row_scratch_bytes()));  // [host_rows, D]
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, host_rows), [&](const std::int64_t y) {
      const RowTask k = row_task(x, block * host_rows + y);
      if (k.ok) row_in_host_order(k, acc + y * D);
    });
  }

  // The scratch of a compaction: the cut, destinations [move_rows], the kept count, and the staged rows
  // (positions, λ, key logits [move_rows]; keys and values [move_rows, D]).
  KOKKOS_INLINE_FUNCTION std::size_t close_scratch_bytes() const {
    const auto m = static_cast<std::size_t>(move_rows);
    return sizeof(prune::Cut) + sizeof(std::int64_t) * (2 * m + 1) + sizeof(float) * 2 * m +
           sizeof(Storage) * 2 * m * static_cast<std::size_t>(D);
  }
  KOKKOS_INLINE_FUNCTION int close_scratch_level() const { return close_scratch_bytes() <= kScratch0Bytes ? 0 : 1; }

  // Evicts what the evictor's cut removes from item i's n entries (spec UA.md 4.5; the test of
  // kernel::ua::evicts) and compacts the survivors stably, as kernel::ua::evict_by: the cut on one
  // thread, then blocks of move_rows entries in order, each block's destinations on one thread and its
  // moving rows staged in scratch before they are written (a destination may be a row of the same block).
  // Returns the survivors.
  template <class Member>
  KOKKOS_INLINE_FUNCTION std::int64_t compact(const Member& team, std::int64_t i, std::int64_t n) const {
    const std::int64_t M = move_rows, o = row0(i);
    auto* cut = static_cast<prune::Cut*>(team.team_scratch(close_scratch_level()).get_shmem(close_scratch_bytes()));
    auto* dst = reinterpret_cast<std::int64_t*>(cut + 1);  // [M]
    std::int64_t* kept = dst + M;                          // [1]
    std::int64_t* spos = kept + 1;                         // [M]
    auto* slam = reinterpret_cast<float*>(spos + M);       // [M]
    float* slogit = slam + M;                              // [M]
    auto* skey = reinterpret_cast<Storage*>(slogit + M);   // [M, D]
    Storage* sval = skey + M * D;                          // [M, D]
    Storage* K = keys + o * D;
    Storage* V = values + o * D;
    float* lam = lambda + o;
    float* zk = key_logit + o;
    std::int64_t* ps = pos + o;
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      *cut = ev.cut(kernel::ua::EntryList<float>{kernel::ua::RowMap{}, lam, ps, n});
      *kept = 0;
    });
    team.team_barrier();
    const std::int64_t width = 2 * D + 1;  // a row's key, value and scalars
    for (std::int64_t b0 = 0; b0 < n; b0 += M) {
      const std::int64_t nb = n - b0 < M ? n - b0 : M;
      Kokkos::single(Kokkos::PerTeam(team), [&]() {
        std::int64_t to = *kept;
        for (std::int64_t e = 0; e < nb; ++e) dst[e] = kernel::ua::evicts(lam[b0 + e], ps[b0 + e], *cut) ? -1 : to++;
        *kept = to;
      });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nb * width), [&](const std::int64_t x) {
        const std::int64_t e = x / width, col = x % width, from = b0 + e;
        if (dst[e] < 0 || dst[e] == from) return;
        if (col < D)
          skey[e * D + col] = K[from * D + col];
        else if (col < 2 * D)
          sval[e * D + col - D] = V[from * D + col - D];
        else {
          spos[e] = ps[from];
          slam[e] = lam[from];
          slogit[e] = zk[from];
        }
      });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nb * width), [&](const std::int64_t x) {
        const std::int64_t e = x / width, col = x % width, to = dst[e];
        if (to < 0 || to == b0 + e) return;
        if (col < D)
          K[to * D + col] = skey[e * D + col];
        else if (col < 2 * D)
          V[to * D + col - D] = sval[e * D + col - D];
        else {
          ps[to] = spos[e];
          lam[to] = slam[e];
          zk[to] = slogit[e];
        }
      });
      team.team_barrier();
    }
    return *kept;
  }

  // Chunk c closes (spec UA.md 4.5 step 2: λ is at the chunk end, evict, chunk keys included), or a
  // decode step evicts (before attention in the `before` phase when evict_before_attention, else after):
  // the entry count grows by the chunk's rows, the peak follows, and the prune evictor's entries go.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(UaCloseTag, const Member& team) const {
    const UaItemRef w = io.item(team.league_rank(), length, capacity);
    if (!active(w)) return;
    if (w.decode ? before != evict_before_attention : before) return;
    const std::int64_t i = item_of(w), n = live[i] + added(w);
    std::int64_t kept = n;
    if constexpr (ua::detail::kEvicts<Ev>)
      if (prune) kept = compact(team, i, n);
    team.team_barrier();  // every thread has read live[i]
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      top[i] = top[i] > n ? top[i] : n;
      live[i] = kept;
    });
  }

  // End of the call: the item's length and peak (page accounting) from the running values.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(UaFinishTag, const Member& team) const {
    const UaItemRef w = io.item(team.league_rank(), length, capacity);
    if (!w.runs) return;
    const std::int64_t i = item_of(w);
    team.team_barrier();  // every thread has read length[i] (io.item) before it changes
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      length[i] = live[i];
      peak[i] = top[i];
    });
  }
};

// Entries moved per compaction step: the staged rows (keys and values) fill about 16 KB of scratch.
template <class Storage>
std::int64_t ua_move_rows(std::int64_t D) {
  const std::int64_t row = 2 * D * static_cast<std::int64_t>(sizeof(Storage)) + 24;
  const std::int64_t m = 16384 / row;
  return m < 1 ? 1 : (m > 64 ? 64 : m);
}

// The kernels of one call on exec.space, in order, with no host round trip: begin; per chunk of
// `chunk` tokens: open (appends, decode's λ update), [decode: close before attention], per query block
// of kQueryTile rows: the decay teams (prefill items) and the row teams, then close (eviction and
// compaction, the entry count); finish (lengths and peaks). The launch count follows from max_tokens
// (the most tokens an item can have: T, or a step's packed tokens) and the chunk size alone.
template <class Space, class Set, class Storage, class Ev, class Io>
void run_ua(const Executor<Space>& exec, UaRun<Set, Storage, Ev, Io> call, std::int64_t max_tokens, bool any_prefill,
            bool any_decode) {
  const std::int64_t items = call.io.items();
  if (items <= 0 || max_tokens <= 0) return;
  const std::int64_t P = call.chunk, Q = kernel::ua::kQueryTile;
  const std::int64_t chunks = any_prefill ? (max_tokens + P - 1) / P : 1;
  const std::int64_t span = max_tokens < P ? max_tokens : P;
  const std::int64_t blocks = any_prefill ? (span + Q - 1) / Q : 1;
  call.host_order = kHostOrder<Space>;
  call.block_rows = any_prefill ? Q : 1;
  call.host_rows = kHostRows;
  call.move_rows = ua_move_rows<Storage>(call.D);
  const std::int64_t decay_teams = items * ((call.capacity + kUaPiece - 1) / kUaPiece);
  const std::int64_t row_teams = items * call.row_teams_per_item();

  auto begin = team_policy<Space, UaBeginTag>(exec, items);
  auto open = team_policy<Space, UaOpenTag>(exec, items);
  auto decay = team_policy<Space, UaDecayTag>(exec, decay_teams);
  auto rows = team_policy<Space, UaRowsTag>(exec, row_teams, call.host_order ? 1 : kRowLanes);
  auto close = team_policy<Space, UaCloseTag>(exec, items);
  auto finish = team_policy<Space, UaFinishTag>(exec, items);
  if (!call.host_order && exec.team_size == 0) {  // device order: wide teams, where they fit
    const auto widen = [&](auto& policy, int wanted = kDeviceTeam, int lanes = 1) {
      using Policy = std::remove_reference_t<decltype(policy)>;
      const int most = policy.team_size_max(call, Kokkos::ParallelForTag());
      policy = Policy(exec.space, policy.league_size(), most < wanted ? most : wanted, lanes);
    };
    widen(open);
    widen(decay);
    widen(rows, kDeviceTeam / kRowLanes, kRowLanes);  // a row's entries, D on the lanes
    widen(close);
  } else if (!call.host_order) {  // the executor's threads, each with kRowLanes lanes, where they fit
    using Policy = decltype(rows);
    const int most = rows.team_size_max(call, Kokkos::ParallelForTag());
    rows = Policy(exec.space, rows.league_size(), most < exec.team_size ? most : exec.team_size, kRowLanes);
  }
  call.row_threads = rows.team_size();
  decay.set_scratch_size(0, Kokkos::PerTeam(call.decay_scratch_bytes()));
  if (call.host_order)
    rows.set_scratch_size(0, Kokkos::PerTeam(call.host_row_scratch_bytes()));
  else
    rows.set_scratch_size(call.row_scratch_level(), Kokkos::PerTeam(call.row_scratch_bytes()));
  close.set_scratch_size(call.close_scratch_level(), Kokkos::PerTeam(call.close_scratch_bytes()));

  Kokkos::parallel_for("kvmem::kokkos::ua::begin", begin, call);
  for (std::int64_t c = 0; c < chunks; ++c) {
    call.c = c;
    call.s = 0;
    Kokkos::parallel_for("kvmem::kokkos::ua::open", open, call);
    if (any_decode && c == 0 && call.evict_before_attention) {
      call.before = true;
      Kokkos::parallel_for("kvmem::kokkos::ua::close", close, call);
      call.before = false;
    }
    for (std::int64_t s = 0; s < blocks; ++s) {
      call.s = s;
      if (any_prefill) Kokkos::parallel_for("kvmem::kokkos::ua::decay", decay, call);
      Kokkos::parallel_for("kvmem::kokkos::ua::rows", rows, call);
    }
    Kokkos::parallel_for("kvmem::kokkos::ua::close", close, call);
  }
  Kokkos::parallel_for("kvmem::kokkos::ua::finish", finish, call);
}

// Finiteness of one call's inputs and (for cache calls) room for T rows. The reduction keeps the
// largest failure code (Kokkos::Max): 1 q, 2 k, 3 v, 4 z_k, 5 z_q, 6 z_o, 7 capacity.
template <class Space>
Status ua_check(const Executor<Space>& exec, const UaViews& in, std::int64_t B, std::int64_t G, std::int64_t H,
                std::int64_t T, std::int64_t D, const std::int64_t* length, std::int64_t capacity) {
  std::int64_t found = 0;
  const bool has_z_o = in.z_o.data != nullptr;
  Kokkos::parallel_reduce(
      "kvmem::kokkos::ua::check", ::kvmem::kokkos::detail::range_policy(exec, 0, B * G),
      KOKKOS_LAMBDA(const std::int64_t i, std::int64_t& code) {
        const std::int64_t b = i / G, g = i % G, r = H / G;
        auto fail = [&](std::int64_t c) {
          if (c > code) code = c;
        };
        if (length != nullptr && length[i] + T > capacity) fail(7);
        for (std::int64_t t = 0; t < T; ++t) {
          for (std::int64_t d = 0; d < D; ++d) {
            for (std::int64_t h = g * r; h < (g + 1) * r; ++h) {
              if (!finite(in.q(b, h, t, d))) fail(1);
              if (has_z_o && !finite(in.z_o(b, t, h, d))) fail(6);
            }
            if (!finite(in.k(b, g, t, d))) fail(2);
            if (!finite(in.v(b, g, t, d))) fail(3);
          }
          if (!finite(in.z_k(b, g, t))) fail(4);
          if (!finite(in.z_q(b, g, t))) fail(5);
        }
      },
      Kokkos::Max<std::int64_t>(found));
  if (found <= 0) return Status::ok();  // the identity of Max is the lowest int64: nothing failed
  if (found == 7)
    return {StatusCode::kOutOfRange,
            kvmem::detail::concat("cache capacity: expected room for ", T,
                                  " more rows per (sequence, kv head), got capacity ", capacity)};
  static const char* const kNames[] = {"", "q", "k", "v", "z_k", "z_q", "z_o"};
  return invalid_argument(kNames[found], "finite values", "NaN or Inf");
}

// Shapes and strides of one call, on the host (no data read): the same checks as the host backend.
inline Status ua_shapes(const ua::Inputs& in, TensorView<float, 4> out, std::int64_t B, std::int64_t H, std::int64_t G,
                        std::int64_t D) {
  return ua::detail::check_call_shapes(in, out, B, H, G, D);
}

// The UaRun of a call over `cache`: its pointers and shape; the caller fills io, chunk and the prune
// choices.
template <class Set, class Storage, class MemSpace, class Ev, class Io>
UaRun<Set, Storage, Ev, Io> ua_run(UaCache<Storage, MemSpace>& cache, const Io& io, std::int64_t chunk, const Ev& ev,
                                   bool evict_before_attention) {
  const ua::CacheShape& s = cache.shape;
  UaRun<Set, Storage, Ev, Io> call{.io = io,
                                   .keys = cache.keys.data(),
                                   .values = cache.values.data(),
                                   .lambda = cache.lambda.data(),
                                   .key_logit = cache.key_logit.data(),
                                   .pos = cache.pos.data(),
                                   .length = cache.length.data(),
                                   .peak = cache.peak.data(),
                                   .counter = cache.counter.data(),
                                   .live = cache.live.data(),
                                   .top = cache.top.data(),
                                   .bias = cache.bias.data(),
                                   .G = s.kv_heads,
                                   .r = s.query_heads / s.kv_heads,
                                   .D = s.head_dim,
                                   .capacity = s.capacity,
                                   .chunk = chunk,
                                   .ev = ev};
  if constexpr (ua::detail::kEvicts<Ev>) call.prune = prune::active(ev);
  call.evict_before_attention = evict_before_attention;
  return call;
}

template <class Set, class Space, class Storage, class MemSpace, class Ev>
Status ua_cache_call(const Executor<Space>& exec, UaCache<Storage, MemSpace>& cache, const ua::Inputs& in,
                     const ua::Options& opt, const Ev& ev, TensorView<float, 4> out, bool decode) {
  const ua::CacheShape& s = cache.shape;
  if (!cache.valid()) return invalid_argument("cache", "a cache made by kokkos::create_cache", "an empty cache");
  KVMEM_RETURN_IF_ERROR(ua::detail::validate_options(opt));
  KVMEM_RETURN_IF_ERROR(ua_shapes(in, out, s.batch, s.query_heads, s.kv_heads, s.head_dim));
  const std::int64_t T = in.q.extent(2);
  if (decode && T != 1) return invalid_argument("decode tokens (q dim 2)", 1, T);
  if (T > s.capacity)
    return {StatusCode::kOutOfRange,
            kvmem::detail::concat("cache capacity: expected room for ", T, " new tokens, got capacity ", s.capacity)};
  const UaViews views(in, out);
  if (exec.checked)
    KVMEM_RETURN_IF_ERROR(
        ua_check(exec, views, s.batch, s.kv_heads, s.query_heads, T, s.head_dim, cache.length.data(), s.capacity));
  UaBatchIo io{views, {}, s.batch, s.kv_heads, s.query_heads / s.kv_heads, T, decode};
  run_ua(exec, ua_run<Set>(cache, io, opt.prefill_chunk, ev, opt.evict_before_attention), T, !decode, decode);
  std::int64_t* counter = cache.counter.data();
  Kokkos::parallel_for(
      "kvmem::kokkos::ua::advance", ::kvmem::kokkos::detail::range_policy(exec, 0, s.batch),
      KOKKOS_LAMBDA(const std::int64_t b) { counter[b] += T; });
  return Status::ok();
}

// The checked reduction of a step over rows: the smallest code * rows + row, or kNoFailure.
enum class UaStepCheck : std::int64_t { kStart = 1, kSlot, kDuplicate, kBound, kCapacity, kQ, kK, kV, kZk, kZq, kZo };

template <class Space>
Status ua_step_check(const Executor<Space>& exec, const UaStepIo& io, const std::int64_t* length, std::int64_t capacity,
                     std::int64_t D, std::int64_t tokens, std::int64_t H) {
  std::int64_t found = kNoFailure;
  const bool has_z_o = io.in.z_o.data != nullptr;
  const std::int64_t R = io.R;
  Kokkos::parallel_reduce(
      "kvmem::kokkos::ua::step_check", ::kvmem::kokkos::detail::range_policy(exec, 0, R),
      KOKKOS_LAMBDA(const std::int64_t x, std::int64_t& first) {
        auto fail = [&](UaStepCheck code) {
          const std::int64_t c = static_cast<std::int64_t>(code) * R + x;
          if (c < first) first = c;
        };
        const UaRow w = io.row(x);
        const std::int64_t x1 = w.x0 + w.T;
        if ((x == 0 && w.x0 != 0) || w.T < 0 || (x == R - 1 && x1 != tokens)) return fail(UaStepCheck::kStart);
        if (w.slot < -1 || w.slot >= io.B) return fail(UaStepCheck::kSlot);
        if (!w.first) return fail(UaStepCheck::kDuplicate);
        if (w.slot >= 0 && io.in.max_len > 0 && w.T > io.in.max_len) return fail(UaStepCheck::kBound);
        if (w.x0 < 0 || x1 > tokens) return;  // another row's start is wrong and reported there
        if (w.slot >= 0 && !io.room(w, length, capacity)) fail(UaStepCheck::kCapacity);
        const std::int64_t G = io.G;
        for (std::int64_t t = w.x0; t < x1; ++t) {  // every token, padding included (as the host step)
          for (std::int64_t h = 0; h < H; ++h)
            for (std::int64_t d = 0; d < D; ++d) {
              if (!finite(io.in.q(t, h, d))) fail(UaStepCheck::kQ);
              if (has_z_o && !finite(io.in.z_o(t, h, d))) fail(UaStepCheck::kZo);
            }
          for (std::int64_t g = 0; g < G; ++g) {
            for (std::int64_t d = 0; d < D; ++d) {
              if (!finite(io.in.k(t, g, d))) fail(UaStepCheck::kK);
              if (!finite(io.in.v(t, g, d))) fail(UaStepCheck::kV);
            }
            if (!finite(io.in.z_k(t, g))) fail(UaStepCheck::kZk);
            if (!finite(io.in.z_q(t, g))) fail(UaStepCheck::kZq);
          }
        }
      },
      Kokkos::Min<std::int64_t>(found));
  if (found == kNoFailure) return Status::ok();
  const std::int64_t x = found % R;
  switch (static_cast<UaStepCheck>(found / R)) {
    case UaStepCheck::kStart:
      return invalid_argument(
          kvmem::detail::concat("query_start[", x, "], query_start[", x + 1, "]"),
          kvmem::detail::concat("query_start[0] = 0, non-decreasing starts, query_start[rows] = tokens = ", tokens),
          kvmem::detail::concat("a violation at row ", x, " (read on the device)"));
    case UaStepCheck::kSlot:
      return {StatusCode::kOutOfRange, kvmem::detail::concat("slot[", x, "]: expected -1 (padding) or 0 <= slot < ",
                                                             "max_slots = ", io.B, ", got a value outside")};
    case UaStepCheck::kDuplicate:
      return invalid_argument(kvmem::detail::indexed("slot", x), "a slot used by no earlier row of this step",
                              "a slot an earlier row names");
    case UaStepCheck::kBound:
      return invalid_argument("max_query_len",
                              kvmem::detail::concat("at least the tokens of every row that names a slot (row ", x,
                                                    ": more, read on the device)"),
                              io.in.max_len);
    case UaStepCheck::kCapacity:
      return {StatusCode::kOutOfRange,
              kvmem::detail::concat("cache capacity: row ", x, " needs room for its tokens in every kv head of its ",
                                    "slot (kept + new tokens), over capacity ", capacity)};
    default:
      break;
  }
  static const char* const kNames[] = {"q", "k", "v", "z_k", "z_q", "z_o"};
  return invalid_argument(kNames[found / R - static_cast<std::int64_t>(UaStepCheck::kQ)], "finite values",
                          kvmem::detail::concat("NaN or Inf in row ", x));
}

template <class Storage, class MemSpace>
Status check_cache(const UaCache<Storage, MemSpace>& cache) {
  if (!cache.valid()) return invalid_argument("cache", "a cache made by kokkos::create_cache", "an empty cache");
  return Status::ok();
}

template <class Storage, class MemSpace>
Status check_slot(const UaCache<Storage, MemSpace>& cache, std::int64_t slot) {
  KVMEM_RETURN_IF_ERROR(check_cache(cache));
  if (slot < 0 || slot >= cache.max_slots())
    return {StatusCode::kOutOfRange,
            kvmem::detail::concat("slot: expected 0 <= slot < max_slots = ", cache.max_slots(), ", got ", slot)};
  return Status::ok();
}

// A host copy of elements [first, first + n) of a View (one device-to-host copy).
template <class View>
std::vector<typename View::non_const_value_type> host_range(const View& view, std::int64_t first, std::int64_t n) {
  const auto part = Kokkos::subview(view, Kokkos::make_pair(std::size_t(first), std::size_t(first + n)));
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), part);
  std::vector<typename View::non_const_value_type> out(static_cast<std::size_t>(n));
  for (std::int64_t e = 0; e < n; ++e) out[std::size_t(e)] = host(e);
  return out;
}

// The record fields of slot b (with `rows` false, only the position and lengths), copied back.
template <class Storage, class MemSpace>
ua::detail::UaSlotFields gather(const UaCache<Storage, MemSpace>& cache, std::int64_t b, bool rows) {
  const std::int64_t G = cache.shape.kv_heads, D = cache.shape.head_dim, cap = cache.shape.capacity;
  ua::detail::UaSlotFields f;
  f.position = host_range(cache.counter, b, 1)[0];
  f.length = host_range(cache.length, b * G, G);
  if (!rows) return f;
  const auto keys = host_range(cache.keys, b * G * cap * D, G * cap * D);
  const auto values = host_range(cache.values, b * G * cap * D, G * cap * D);
  const auto lambda = host_range(cache.lambda, b * G * cap, G * cap);
  const auto key_logit = host_range(cache.key_logit, b * G * cap, G * cap);
  const auto pos = host_range(cache.pos, b * G * cap, G * cap);
  for (std::int64_t g = 0; g < G; ++g) {
    const std::int64_t n = f.length[std::size_t(g)], row0 = g * cap;
    for (std::int64_t e = row0; e < row0 + n; ++e) {
      f.pos.push_back(pos[std::size_t(e)]);
      f.lambda.push_back(lambda[std::size_t(e)]);
      f.key_logit.push_back(key_logit[std::size_t(e)]);
      for (std::int64_t d = 0; d < D; ++d) {
        f.key.push_back(load_as<float>(keys[std::size_t(e * D + d)]));
        f.value.push_back(load_as<float>(values[std::size_t(e * D + d)]));
      }
    }
  }
  return f;
}

// A host vector in a new View of MemSpace (staging for import_slot).
template <class MemSpace, class T>
Kokkos::View<T*, MemSpace> staged(const std::vector<T>& host, const char* label) {
  Kokkos::View<T*, MemSpace> view(std::string(label), host.size());
  auto mirror = Kokkos::create_mirror_view(view);
  for (std::size_t e = 0; e < host.size(); ++e) mirror(e) = host[e];
  Kokkos::deep_copy(view, mirror);
  return view;
}

}  // namespace detail
}  // namespace kvmem::kokkos

namespace kvmem::ua {

template <class Space>
struct Backend<kokkos::Executor<Space>> {
  template <class S>
  using cache_type = kokkos::UaCache<S, typename kokkos::Executor<Space>::memory_space>;
};

// ua::prefill on a Kokkos cache (spec UA.md 4.5). out: [B,T,H,D]
template <DecaySet Set = decay::Universal, class Space, class Storage, class MemSpace>
Status prefill(const kokkos::Executor<Space>& exec, kokkos::UaCache<Storage, MemSpace>& cache, const Inputs& in,
               const Options& opt, TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_options(opt));
  return kokkos::detail::ua_cache_call<Set>(exec, cache, in, opt, prune::Threshold{opt.p}.evictor(opt.layer), out,
                                            false);
}
// With a prune policy in place of Options::p (which must then be 0), as on the host (ua/ops.hpp).
template <DecaySet Set = decay::Universal, PrunePolicy Rule, class Space, class Storage, class MemSpace>
Status prefill(const kokkos::Executor<Space>& exec, kokkos::UaCache<Storage, MemSpace>& cache, const Inputs& in,
               const Options& opt, const Rule& rule, TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_rule(rule, opt));
  return kokkos::detail::ua_cache_call<Set>(exec, cache, in, opt, detail::evictor_of(rule, opt), out, false);
}

// ua::decode on a Kokkos cache (spec UA.md 4.4, 4.5). out: [B,1,H,D]
template <DecaySet Set = decay::Universal, class Space, class Storage, class MemSpace>
Status decode(const kokkos::Executor<Space>& exec, kokkos::UaCache<Storage, MemSpace>& cache, const Inputs& in,
              const Options& opt, TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_options(opt));
  return kokkos::detail::ua_cache_call<Set>(exec, cache, in, opt, prune::Threshold{opt.p}.evictor(opt.layer), out,
                                            true);
}
template <DecaySet Set = decay::Universal, PrunePolicy Rule, class Space, class Storage, class MemSpace>
Status decode(const kokkos::Executor<Space>& exec, kokkos::UaCache<Storage, MemSpace>& cache, const Inputs& in,
              const Options& opt, const Rule& rule, TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_rule(rule, opt));
  return kokkos::detail::ua_cache_call<Set>(exec, cache, in, opt, detail::evictor_of(rule, opt), out, true);
}

// ua::forward on Kokkos (dense, no cache). out: [B,T,H,D]; lse: [B,H,T] or empty; lambda_last: [B,G,T] or empty
template <DecaySet Set = decay::Universal, class Space>
Status forward(const kokkos::Executor<Space>& exec, const Inputs& in, TensorView<float, 4> out,
               TensorView<float, 3> lse = {}, TensorView<float, 3> lambda_last = {}) {
  const std::int64_t B = in.q.extent(0), H = in.q.extent(1), T = in.q.extent(2), D = in.q.extent(3);
  const std::int64_t G = in.k.extent(1);
  if (B <= 0 || H <= 0 || G <= 0 || D <= 0)
    return invalid_argument("q/k extents", "positive B, H, G, D", kvmem::detail::concat(B, ",", H, ",", G, ",", D));
  if (H % G != 0) return invalid_argument("H % G (q dim 1, k dim 1)", 0, H % G);
  KVMEM_RETURN_IF_ERROR(kokkos::detail::ua_shapes(in, out, B, H, G, D));
  if (!lse.empty()) KVMEM_RETURN_IF_ERROR(check_shape(TensorView<const float, 3>(lse), {B, H, T}, "lse [B,H,T]"));
  if (!lambda_last.empty())
    KVMEM_RETURN_IF_ERROR(check_shape(TensorView<const float, 3>(lambda_last), {B, G, T}, "lambda_last [B,G,T]"));
  const kokkos::detail::UaViews views(in, out);
  if (exec.checked) KVMEM_RETURN_IF_ERROR(kokkos::detail::ua_check(exec, views, B, G, H, T, D, nullptr, 0));
  if (T == 0) return Status::ok();
  // A per-call cache of T rows per item runs the prefill kernels over one chunk of every token: the
  // same decay, bias and rows as the host's single block (spec UA.md 4.2, 4.3).
  kokkos::UaCache<float, typename Space::memory_space> cache;
  KVMEM_RETURN_IF_ERROR(cache.create(CacheShape{B, H, G, D, T, 16}, cache));
  kokkos::detail::UaBatchIo io{views, {}, B, G, H / G, T, false};
  if (!lse.empty()) io.lse = kokkos::detail::DeviceView<float, 3>(lse);
  kokkos::detail::run_ua(exec, kokkos::detail::ua_run<Set>(cache, io, T, detail::NoEvictor{}, true), T, true, false);
  if (!lambda_last.empty()) {
    const kokkos::detail::DeviceView<float, 3> last(lambda_last);
    const float* lambda = cache.lambda.data();
    Kokkos::parallel_for(
        "kvmem::kokkos::ua::lambda_last", ::kvmem::kokkos::detail::range_policy(exec, 0, B * G * T),
        KOKKOS_LAMBDA(const std::int64_t x) {
          const std::int64_t i = x / T;
          last(i / G, i % G, x % T) = lambda[x];  // Λ_{T-1, t}: the entries stay in position order
        });
  }
  exec.space.fence();  // the per-call cache is released on return
  return Status::ok();
}

// ---- sequence slots on a Kokkos cache (docs/slots-ua.md): the host operations' names, argument order
// and semantics, with the cache in the space's memory ---------------------------------------------------

namespace detail {
template <DecaySet Set, class Space, class Storage, class MemSpace, class Ev>
Status kokkos_step(const kokkos::Executor<Space>& exec, kokkos::UaCache<Storage, MemSpace>& cache, const Rows& rows,
                   const PackedInputs& in, const Options& opt, const Ev& ev, TensorView<float, 3> out,
                   TensorView<float, 2> lse) {
  using namespace kokkos::detail;
  KVMEM_RETURN_IF_ERROR(kokkos::detail::check_cache(cache));
  KVMEM_RETURN_IF_ERROR(detail::validate_options(opt));
  const CacheShape& s = cache.shape;
  const std::int64_t N = in.tokens(), H = s.query_heads, G = s.kv_heads, D = s.head_dim, R = rows.count();
  KVMEM_RETURN_IF_ERROR(detail::check_packed_step(s, in, out, lse));
  if (rows.query_start.extent(0) != R + 1)
    return invalid_argument("query_start shape", kvmem::detail::concat("[rows + 1] = [", R + 1, "]"),
                            shape_string(rows.query_start.extents()));
  if (R == 0) return N == 0 ? Status::ok() : invalid_argument("tokens", "0 for an empty batch", N);
  if (rows.max_query_len < 0) return invalid_argument("max_query_len", ">= 0 (0: no bound)", rows.max_query_len);
  UaPackedViews views{DeviceView<const std::int32_t, 1>(rows.slot),
                      DeviceView<const std::int32_t, 1>(rows.query_start),
                      DeviceView<const float, 3>(in.q),
                      DeviceView<const float, 3>(in.k),
                      DeviceView<const float, 3>(in.v),
                      {},
                      DeviceView<const float, 2>(in.z_k),
                      DeviceView<const float, 2>(in.z_q),
                      DeviceView<float, 3>(out),
                      {}};
  if (!in.z_o.empty()) views.z_o = DeviceView<const float, 3>(in.z_o);
  if (!lse.empty()) views.lse = DeviceView<float, 2>(lse);
  views.max_len = rows.max_query_len;
  const UaStepIo io{views, cache.admit.data(), s.batch, G, H / G, R};
  std::int64_t* length = cache.length.data();
  std::int64_t* admit = cache.admit.data();
  std::int64_t* counter = cache.counter.data();
  const std::int64_t capacity = s.capacity;
  if (exec.checked) KVMEM_RETURN_IF_ERROR(ua_step_check(exec, io, length, capacity, D, N, H));
  Kokkos::parallel_for(
      "kvmem::kokkos::ua::step_admit", ::kvmem::kokkos::detail::range_policy(exec, 0, R),
      KOKKOS_LAMBDA(const std::int64_t x) {
        const UaRow w = io.row(x);
        if (w.slot >= 0 && w.fits && w.first) admit[w.slot] = io.room(w, length, capacity) ? 1 : 0;
      });
  // A row of one token is a decode step; a row of more (any row when N >= 2) a chunked prefill.
  run_ua(exec, ua_run<Set>(cache, io, opt.prefill_chunk, ev, opt.evict_before_attention), N, N >= 2, true);
  Kokkos::parallel_for(
      "kvmem::kokkos::ua::step_advance", ::kvmem::kokkos::detail::range_policy(exec, 0, R),
      KOKKOS_LAMBDA(const std::int64_t x) {
        const UaRow w = io.row(x);
        if (io.runs(w)) counter[w.slot] += w.T;
      });
  return Status::ok();
}
}  // namespace detail

// ua::step on a Kokkos cache: one team per (row, kv head). Launches, in order on exec.space: [checked]
// one reduction over rows (rows, capacity, finite inputs) read back; the admit kernel (per row, from
// the slot's lengths: may it advance?); the item teams, each reading its row's slot, query_start,
// position counter and lengths itself; the counter advance. A row equals ua::step of the host on the
// same sequence alone, bitwise (the same kernel bodies in the same order).
template <DecaySet Set = decay::Universal, class Space, class Storage, class MemSpace>
Status step(const kokkos::Executor<Space>& exec, kokkos::UaCache<Storage, MemSpace>& cache, const Rows& rows,
            const PackedInputs& in, const Options& opt, TensorView<float, 3> out,  // [tokens,H,D]
            TensorView<float, 2> lse = {}) {                                       // [tokens,H] or empty
  KVMEM_RETURN_IF_ERROR(detail::validate_options(opt));
  return detail::kokkos_step<Set>(exec, cache, rows, in, opt, prune::Threshold{opt.p}.evictor(opt.layer), out, lse);
}
// With a prune policy in place of Options::p (which must then be 0), as on the host (ua/ops.hpp).
template <DecaySet Set = decay::Universal, PrunePolicy Rule, class Space, class Storage, class MemSpace>
Status step(const kokkos::Executor<Space>& exec, kokkos::UaCache<Storage, MemSpace>& cache, const Rows& rows,
            const PackedInputs& in, const Options& opt, const Rule& rule, TensorView<float, 3> out,
            TensorView<float, 2> lse = {}) {
  KVMEM_RETURN_IF_ERROR(detail::validate_rule(rule, opt));
  return detail::kokkos_step<Set>(exec, cache, rows, in, opt, detail::evictor_of(rule, opt), out, lse);
}

// Empties the listed slots (every kv head) and restarts their position counters; a slot may be listed
// more than once. slots: [n] in memory Space can read.
template <class Space, class Storage, class MemSpace>
Status reset_slots(const kokkos::Executor<Space>& exec, kokkos::UaCache<Storage, MemSpace>& cache,
                   TensorView<const std::int32_t, 1> slots) {
  using namespace kokkos::detail;
  KVMEM_RETURN_IF_ERROR(check_cache(cache));
  const SlotLists lists{DeviceView<const std::int32_t, 1>(slots), {}, cache.max_slots()};
  const std::int64_t n = slots.extent(0), G = cache.shape.kv_heads;
  if (exec.checked && n > 0) KVMEM_RETURN_IF_ERROR(slot_list_status(first_failure(exec, lists), n, lists.B, "slots"));
  std::int64_t* length = cache.length.data();
  std::int64_t* peak = cache.peak.data();
  std::int64_t* counter = cache.counter.data();
  Kokkos::parallel_for(
      "kvmem::kokkos::ua::reset_slots", ::kvmem::kokkos::detail::range_policy(exec, 0, n),
      KOKKOS_LAMBDA(const std::int64_t i) {
        if (lists.failure(i) != 0) return;
        const std::int64_t b = lists.src(i);
        for (std::int64_t g = 0; g < G; ++g) length[b * G + g] = peak[b * G + g] = 0;
        counter[b] = 0;
      });
  return Status::ok();
}

// Slot dst[i] becomes a copy of slot src[i] (entries, λ, key-gate logits, positions, position
// counter), so it continues bit for bit like its source. src, dst: [n] (core/slots.hpp check_copy_pairs).
template <class Space, class Storage, class MemSpace>
Status copy_slots(const kokkos::Executor<Space>& exec, kokkos::UaCache<Storage, MemSpace>& cache,
                  TensorView<const std::int32_t, 1> src, TensorView<const std::int32_t, 1> dst) {
  using namespace kokkos::detail;
  KVMEM_RETURN_IF_ERROR(check_cache(cache));
  if (src.extent(0) != dst.extent(0)) return invalid_argument("dst count", src.extent(0), dst.extent(0));
  const SlotLists lists{DeviceView<const std::int32_t, 1>(src), DeviceView<const std::int32_t, 1>(dst),
                        cache.max_slots()};
  const std::int64_t n = src.extent(0), G = cache.shape.kv_heads, D = cache.shape.head_dim, cap = cache.shape.capacity;
  if (exec.checked && n > 0) KVMEM_RETURN_IF_ERROR(slot_list_status(first_failure(exec, lists), n, lists.B, "src"));
  Storage* keys = cache.keys.data();
  Storage* values = cache.values.data();
  float* lambda = cache.lambda.data();
  float* key_logit = cache.key_logit.data();
  std::int64_t* pos = cache.pos.data();
  std::int64_t* length = cache.length.data();
  std::int64_t* peak = cache.peak.data();
  std::int64_t* counter = cache.counter.data();
  Kokkos::parallel_for(
      "kvmem::kokkos::ua::copy_slots", ::kvmem::kokkos::detail::range_policy(exec, 0, n * G),
      KOKKOS_LAMBDA(const std::int64_t x) {
        const std::int64_t i = x / G, g = x % G;
        if (lists.failure(i) != 0) return;
        const std::int64_t a = lists.src(i) * G + g, b = lists.dst(i) * G + g;
        if (a == b) return;
        const std::int64_t m = length[a];
        for (std::int64_t e = 0; e < m * D; ++e) {
          keys[b * cap * D + e] = keys[a * cap * D + e];
          values[b * cap * D + e] = values[a * cap * D + e];
        }
        for (std::int64_t e = 0; e < m; ++e) {
          lambda[b * cap + e] = lambda[a * cap + e];
          key_logit[b * cap + e] = key_logit[a * cap + e];
          pos[b * cap + e] = pos[a * cap + e];
        }
        peak[b] = length[b] > m ? length[b] : m;  // the destination's old rows beyond the copy are free
        length[b] = m;
      });
  Kokkos::parallel_for(
      "kvmem::kokkos::ua::copy_counters", ::kvmem::kokkos::detail::range_policy(exec, 0, n),
      KOKKOS_LAMBDA(const std::int64_t i) {
        if (lists.failure(i) == 0) counter[lists.dst(i)] = counter[lists.src(i)];
      });
  return Status::ok();
}

// Bytes of the record of `slot` (0 for an empty cache or a slot outside it). Reads the slot's lengths
// back from the space's memory (a blocking copy).
template <class Storage, class MemSpace>
std::size_t export_bytes(const kokkos::UaCache<Storage, MemSpace>& cache, std::int32_t slot) {
  if (!kokkos::detail::check_slot(cache, slot).is_ok()) return 0;
  return detail::write_record<Storage>(cache.shape, kokkos::detail::gather(cache, slot, false), {});
}

// Writes the record of `slot` (ua/slots.hpp's format and writer) into the first export_bytes(cache,
// slot) bytes of `out`, after the work queued on exec.space has finished.
template <class Space, class Storage, class MemSpace>
Status export_slot(const kokkos::Executor<Space>& exec, const kokkos::UaCache<Storage, MemSpace>& cache,
                   std::int32_t slot, std::span<std::byte> out) {
  KVMEM_RETURN_IF_ERROR(kokkos::detail::check_slot(cache, slot));
  exec.space.fence();
  const detail::UaSlotFields f = kokkos::detail::gather(cache, slot, true);
  const std::size_t bytes = detail::write_record<Storage>(cache.shape, f, {});
  if (out.size() < bytes)
    return {StatusCode::kOutOfRange,
            kvmem::detail::concat("export_slot out: expected at least ", bytes, " bytes, got ", out.size())};
  (void)detail::write_record<Storage>(cache.shape, f, out.first(bytes));
  return Status::ok();
}

// Replaces `slot` with a record (any backend's): read and checked whole on the host (ua/slots.hpp)
// before anything changes, then staged into the space's memory and written by a kernel on exec.space.
template <class Space, class Storage, class MemSpace>
Status import_slot(const kokkos::Executor<Space>& exec, kokkos::UaCache<Storage, MemSpace>& cache, std::int32_t slot,
                   std::span<const std::byte> in) {
  KVMEM_RETURN_IF_ERROR(kokkos::detail::check_slot(cache, slot));
  detail::UaSlotFields f;
  KVMEM_RETURN_IF_ERROR(detail::read_record<Storage>(cache.shape, in, f));
  const std::int64_t G = cache.shape.kv_heads, D = cache.shape.head_dim, cap = cache.shape.capacity;
  const auto length_v = kokkos::detail::staged<MemSpace>(f.length, "kvmem ua import length");
  const auto pos_v = kokkos::detail::staged<MemSpace>(f.pos, "kvmem ua import pos");
  const auto key_v = kokkos::detail::staged<MemSpace>(f.key, "kvmem ua import key");
  const auto value_v = kokkos::detail::staged<MemSpace>(f.value, "kvmem ua import value");
  const auto lambda_v = kokkos::detail::staged<MemSpace>(f.lambda, "kvmem ua import lambda");
  const auto logit_v = kokkos::detail::staged<MemSpace>(f.key_logit, "kvmem ua import key logit");
  const std::int64_t* n_in = length_v.data();
  const std::int64_t* p_in = pos_v.data();
  const float* k_in = key_v.data();
  const float* v_in = value_v.data();
  const float* l_in = lambda_v.data();
  const float* z_in = logit_v.data();
  Storage* keys = cache.keys.data();
  Storage* values = cache.values.data();
  float* lambda = cache.lambda.data();
  float* key_logit = cache.key_logit.data();
  std::int64_t* pos = cache.pos.data();
  std::int64_t* length = cache.length.data();
  std::int64_t* peak = cache.peak.data();
  std::int64_t* counter = cache.counter.data();
  const std::int64_t b0 = std::int64_t(slot) * G, position = f.position;
  Kokkos::parallel_for(
      "kvmem::kokkos::ua::import_slot", ::kvmem::kokkos::detail::range_policy(exec, 0, G),
      KOKKOS_LAMBDA(const std::int64_t g) {
        std::int64_t e0 = 0;
        for (std::int64_t h = 0; h < g; ++h) e0 += n_in[h];
        const std::int64_t i = b0 + g, n = n_in[g];
        for (std::int64_t e = 0; e < n; ++e) {
          pos[i * cap + e] = p_in[e0 + e];
          lambda[i * cap + e] = l_in[e0 + e];
          key_logit[i * cap + e] = z_in[e0 + e];
          for (std::int64_t d = 0; d < D; ++d) {
            keys[(i * cap + e) * D + d] = store_as<Storage>(k_in[(e0 + e) * D + d]);
            values[(i * cap + e) * D + d] = store_as<Storage>(v_in[(e0 + e) * D + d]);
          }
        }
        peak[i] = length[i] > n ? length[i] : n;
        length[i] = n;
        if (g == 0) counter[b0 / G] = position;
      });
  exec.space.fence();  // the staging Views are released on return
  return Status::ok();
}

// Drops the last n tokens of `slot` where that is exact (n = 0, or n = all: a reset), as the host's
// ua::truncate; every other n is refused with kUnsupported (docs/slots-ua.md says why). Reads the
// slot's position counter back after the queued work has finished.
template <class Space, class Storage, class MemSpace>
Status truncate(const kokkos::Executor<Space>& exec, kokkos::UaCache<Storage, MemSpace>& cache, std::int32_t slot,
                std::int64_t n) {
  KVMEM_RETURN_IF_ERROR(kokkos::detail::check_slot(cache, slot));
  exec.space.fence();
  const std::int64_t tokens = kokkos::detail::host_range(cache.counter, slot, 1)[0];
  if (n < 0 || n > tokens)
    return {StatusCode::kOutOfRange,
            kvmem::detail::concat("truncate n: expected 0 <= n <= the slot's tokens = ", tokens, ", got ", n)};
  if (n == 0) return Status::ok();
  if (n == tokens) {
    const std::int32_t* one = nullptr;
    Kokkos::View<std::int32_t*, MemSpace> list("kvmem ua truncate slot", 1);
    Kokkos::deep_copy(list, slot);
    one = list.data();
    KVMEM_RETURN_IF_ERROR(reset_slots(exec, cache, TensorView<const std::int32_t, 1>(one, {1})));
    exec.space.fence();
    return Status::ok();
  }
  return {StatusCode::kUnsupported,
          kvmem::detail::concat("truncate n: UA drops tokens exactly only for n = 0 or n = all ", tokens,
                                " tokens of the slot, got ", n,
                                ": every kept key's λ holds one fp32 decay term per later token (spec UA.md 4.2), "
                                "which cannot be taken out bit-exactly, and keys evicted by the dropped tokens' steps "
                                "are gone; copy the slot before tokens that may be rolled back")};
}

}  // namespace kvmem::ua
