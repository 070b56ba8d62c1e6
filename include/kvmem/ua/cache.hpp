// SPDX-License-Identifier: Apache-2.0
#pragma once
// PrunedCache: the Universal Attention inference cache (spec UA.md 2, 4.4, 4.5). Per (sequence, kv
// head) a variable-length list of entries (key, value, λ, key-gate logit, absolute position) in
// ascending position order; per sequence an absolute position counter n_b that advances by one per
// token whatever the cache length (spec UA.md 4.5, "Storage order and positions"; the caller rotates
// the next token at position(b)).
//
// Memory (DESIGN.md 3). Entries live in fixed-size pages of `page_rows` rows (a power of two) taken
// from one pool per cache (one layer): the pool holds keys and values in `Storage` (float, bf16, fp16
// or fp8 e4m3, whose key and value rows carry one fp32 scale each: core/numeric.hpp) and λ, key-gate
// logit (fp32) and position (int64) per row, field by field. Each (slot, kv
// head) has a page table of ceil(capacity / page_rows) entries; logical row e sits in page
// table[e / page_rows] at row e % page_rows (kernel/ua_rows.hpp). A step takes a page from the free
// list when an append crosses into a new page, and eviction, which compacts the survivors to the
// front, returns every page past the survivors at once, so the pool holds exactly
// Σ ceil(length / page_rows) pages between operations. `pool_pages` sizes the pool. With 0, every
// (slot, kv head) owns the ceil(capacity / page_rows) consecutive pages it can fill, so its rows are
// contiguous (the kernels' plain path), nothing is shared and nothing runs dry; the page counts and
// freed_pages are kept all the same. When a shared pool is dry, the (slot, kv head)
// that asks for a page sets its slot's overflow flag: that slot's outputs are zeroed, its pages go
// back to the pool, and later rows naming it are skipped (outputs zeroed) until ua::reset_slots; every
// other slot goes on working. Which slot overflows when several ask at once depends on the order their
// items run in. Occupancy (pages_in_use, free_pages, the cumulative pages_taken / pages_returned) is a
// plain read.
//
// Sizes are closed-form (cache_layout, workspace_bytes). An owning cache (create, the constructor)
// makes one allocation holding the cache and a workspace for max_slots rows; place puts the cache over
// caller memory and attach_workspace gives it a per-step workspace sized by ua::Limits. No operation
// allocates. The row accessors below (positions, keys, ...) return contiguous rows: the pages
// themselves when they are consecutive in the pool, else a gathered copy in the cache's inspection
// buffer (allocated there; valid until the next call of that accessor or operation on the cache).
//
// Sequence slots (DESIGN.md 3, core/slots.hpp): the cache holds max_slots() = CacheShape::batch
// sequence slots, fixed at creation. Each slot has its own position counter and its own entry list per
// kv head, so slots join, advance (ua::step), fork (ua::copy_slots), restart (ua::reset_slots) and
// travel (ua::export_slot / import_slot) independently of one another.
//
// Safety (DESIGN.md 3): a default-constructed or moved-from cache is empty (max_slots() == 0); every
// operation of ua/ops.hpp refuses it with a Status, and the accessors below return 0 / nullptr for an
// empty cache or an index outside the shape instead of reading out of bounds.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "kvmem/core/arena.hpp"
#include "kvmem/core/memory.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/kernel/ua_attend.hpp"
#include "kvmem/kernel/ua_rows.hpp"

namespace kvmem::ua {

struct CacheShape {
  std::int64_t batch = 1;        // B sequence slots
  std::int64_t query_heads = 1;  // H
  std::int64_t kv_heads = 1;     // G, H % G == 0
  std::int64_t head_dim = 1;     // D (keys and values)
  std::int64_t capacity = 0;     // most rows one (slot, kv head) may hold
  std::int64_t page_rows = 16;   // rows per page, a power of two
  std::int64_t pool_pages = 0;   // pages in the pool; 0 = batch * kv_heads * ceil(capacity / page_rows)

  [[nodiscard]] constexpr std::int64_t pages_per_item() const { return (capacity + page_rows - 1) / page_rows; }
  [[nodiscard]] constexpr std::int64_t pages() const {
    return pool_pages > 0 ? pool_pages : batch * kv_heads * pages_per_item();
  }
};

// A contiguous run of pages [first, first + count) of one (sequence, kv head).
struct PageRange {
  std::int64_t first = 0;
  std::int64_t count = 0;
};

// Bytes of a cache (DESIGN.md 3): page_bytes per pool page (keys and values in the storage type, λ and
// key-gate logit fp32, position int64, fp8: two fp32 row scales), item_bytes per (slot, kv head) (its page table, page
// count, length and peak), slot_bytes per slot beyond its items (position counter, overflow flag), and bytes for the
// whole cache (pool, tables, counters, free list), each array aligned to `alignment`.
struct CacheLayout {
  std::size_t page_bytes = 0;
  std::size_t item_bytes = 0;
  std::size_t slot_bytes = 0;
  std::int64_t pages = 0;
  std::size_t bytes = 0;
  std::size_t alignment = kMemoryAlign;
};

namespace cache_detail {

struct Offsets {
  std::size_t keys, values, lambda, key_logit, pos, key_scale, value_scale, table, held, length, peak, counter,
      overflow, free_list, stats, total;
};

// Bytes of one pool row: key and value in the storage type, λ and key-gate logit fp32, position int64,
// and with row-scaled storage (fp8) the key's and the value's fp32 scale.
template <class Storage>
constexpr std::size_t row_bytes(std::int64_t D) {
  return 2 * std::size_t(D) * sizeof(Storage) + 2 * sizeof(float) + sizeof(std::int64_t) +
         (is_row_scaled_v<Storage> ? 2 * sizeof(float) : 0);
}

template <class Storage>
Offsets offsets(const CacheShape& s) {
  const auto rows = std::size_t(s.pages() * s.page_rows), D = std::size_t(s.head_dim);
  const auto items = std::size_t(s.batch * s.kv_heads), B = std::size_t(s.batch);
  ArenaLayout a(kMemoryAlign);
  Offsets o{};
  o.keys = a.take(rows * D * sizeof(Storage));
  o.values = a.take(rows * D * sizeof(Storage));
  o.lambda = a.take(rows * sizeof(float));
  o.key_logit = a.take(rows * sizeof(float));
  o.pos = a.take(rows * sizeof(std::int64_t));
  o.key_scale = a.take(is_row_scaled_v<Storage> ? rows * sizeof(float) : 0);
  o.value_scale = a.take(is_row_scaled_v<Storage> ? rows * sizeof(float) : 0);
  o.table = a.take(items * std::size_t(s.pages_per_item()) * sizeof(std::int32_t));
  o.held = a.take(items * sizeof(std::int64_t));
  o.length = a.take(items * sizeof(std::int64_t));
  o.peak = a.take(items * sizeof(std::int64_t));
  o.counter = a.take(B * sizeof(std::int64_t));
  o.overflow = a.take(B * sizeof(std::int64_t));
  o.free_list = a.take(std::size_t(s.pages()) * sizeof(std::int32_t));
  o.stats = a.take(3 * sizeof(std::int64_t));  // free count, pages taken, pages returned
  o.total = a.total();
  return o;
}

// Workspace: the step's row list [rows], then per work item the attend block's scratch.
struct WorkLayout {
  std::size_t row_list, items, item_bytes, total;
  std::int64_t count;
};
inline WorkLayout work_layout(const CacheShape& s, std::int64_t rows) {
  ArenaLayout a(kMemoryAlign);
  WorkLayout l{};
  l.row_list = a.take(std::size_t(rows) * sizeof(std::int64_t));
  l.item_bytes =
      align_up(std::size_t(kernel::ua::block_workspace_elems(s.query_heads / s.kv_heads, s.head_dim)) * sizeof(float));
  l.count = rows * s.kv_heads;
  l.items = a.take(std::size_t(l.count) * l.item_bytes);
  l.total = a.total();
  return l;
}

inline int log2_exact(std::int64_t x) {
  int k = 0;
  while ((std::int64_t(1) << k) < x) ++k;
  return k;
}

}  // namespace cache_detail

template <class Storage = float>
class PrunedCache {
  static_assert(is_storage_type_v<Storage> && !std::is_same_v<Storage, double>,
                "kvmem::ua::PrunedCache: Storage must be float, kvmem::bf16, kvmem::fp16 or kvmem::e4m3 (fp32 "
                "accumulation)");

 public:
  using storage_type = Storage;

  PrunedCache() = default;
  // A copy is an owning cache with the same contents (pool, page tables, counters) and its own
  // workspace for max_slots rows.
  PrunedCache(const PrunedCache& o) { copy_from(o); }
  PrunedCache& operator=(const PrunedCache& o) {
    if (this != &o) {
      PrunedCache c(o);
      swap(c);
    }
    return *this;
  }
  // A move leaves `o` empty (no slots), never a shape without rows.
  PrunedCache(PrunedCache&& o) noexcept { swap(o); }
  PrunedCache& operator=(PrunedCache&& o) noexcept {
    if (this != &o) {
      PrunedCache taken;
      taken.swap(o);
      swap(taken);
    }
    return *this;
  }

  static Status validate_shape(const CacheShape& s) {
    if (s.batch <= 0) return invalid_argument("CacheShape batch", "> 0", s.batch);
    if (s.query_heads <= 0) return invalid_argument("CacheShape query_heads", "> 0", s.query_heads);
    if (s.kv_heads <= 0) return invalid_argument("CacheShape kv_heads", "> 0", s.kv_heads);
    if (s.query_heads % s.kv_heads != 0)
      return invalid_argument("CacheShape query_heads % kv_heads", "0 (GQA groups of equal size)",
                              s.query_heads % s.kv_heads);
    if (s.head_dim <= 0) return invalid_argument("CacheShape head_dim", "> 0", s.head_dim);
    if (s.capacity <= 0) return invalid_argument("CacheShape capacity", "> 0 rows per (sequence, kv head)", s.capacity);
    if (s.page_rows <= 0 || (s.page_rows & (s.page_rows - 1)) != 0)
      return invalid_argument("CacheShape page_rows", "a power of two (rows per page)", s.page_rows);
    if (s.pool_pages < 0 || s.pool_pages > std::int64_t(0x7fffffff))
      return invalid_argument("CacheShape pool_pages", "0 (room for every slot at capacity) or a page count < 2^31",
                              s.pool_pages);
    if (s.pool_pages == 0 && s.batch * s.kv_heads * s.pages_per_item() > std::int64_t(0x7fffffff))
      return invalid_argument("CacheShape batch * kv_heads * pages per item", "< 2^31 pages",
                              s.batch * s.kv_heads * s.pages_per_item());
    return Status::ok();
  }

  // Checked construction of an owning cache (cache and a workspace for max_slots rows in one
  // allocation); on failure `out` is unchanged.
  static Status create(const CacheShape& s, PrunedCache& out) {
    KVMEM_RETURN_IF_ERROR(validate_shape(s));
    const std::size_t cb = cache_detail::offsets<Storage>(s).total, wb = cache_detail::work_layout(s, s.batch).total;
    PrunedCache c;
    c.owned_.reset(new (std::align_val_t(kMemoryAlign)) std::byte[cb + wb]);
    c.bind(c.owned_.get(), s);
    c.bind_workspace(c.owned_.get() + cb, s.batch);
    c.reset_all();
    out = std::move(c);
    return Status::ok();
  }
  // Throwing convenience constructor.
  explicit PrunedCache(const CacheShape& s) { throw_if_error(create(s, *this)); }

  // A cache over caller memory (at least cache_layout(s).bytes, 64-byte aligned, not owned): every
  // slot empty, every page free. Steps need a workspace (attach_workspace).
  static Status place(void* memory, std::size_t bytes, const CacheShape& s, PrunedCache& out) {
    KVMEM_RETURN_IF_ERROR(validate_shape(s));
    KVMEM_RETURN_IF_ERROR(check_placement(memory, bytes, cache_detail::offsets<Storage>(s).total, "cache memory"));
    PrunedCache c;
    c.bind(static_cast<std::byte*>(memory), s);
    c.reset_all();
    out = std::move(c);
    return Status::ok();
  }
  // Uses `memory` (at least ua::workspace_bytes(shape, limits), 64-byte aligned, not owned) as the
  // scratch of every later call with at most limits.max_rows rows that name a slot (0 = max_slots);
  // prefill and decode take max_slots rows. Nothing is written here; states never stepped at the same
  // time may share one workspace.
  Status attach_workspace(void* memory, std::size_t bytes, const Limits& limits = {}) {
    if (!valid()) return invalid_argument("cache", "a cache made by PrunedCache::create or place", "an empty cache");
    if (limits.max_rows < 0) return invalid_argument("limits max_rows", ">= 0", limits.max_rows);
    const std::int64_t rows = limits.max_rows > 0 ? limits.max_rows : shape_.batch;
    KVMEM_RETURN_IF_ERROR(
        check_placement(memory, bytes, cache_detail::work_layout(shape_, rows).total, "workspace memory"));
    bind_workspace(static_cast<std::byte*>(memory), rows);
    return Status::ok();
  }
  // Ok when a call of `rows` rows that name a slot has workspace; else the reason.
  [[nodiscard]] Status check_workspace(std::int64_t rows) const {
    return check_workspace_rows(ws_ != nullptr, rows, ws_rows_, "PrunedCache");
  }

  [[nodiscard]] const CacheShape& shape() const { return shape_; }
  // False for a default-constructed or moved-from cache, which holds no slots.
  [[nodiscard]] bool valid() const { return shape_.capacity > 0; }
  // Sequence slots (CacheShape::batch): slot b is the sequence b of prefill / decode.
  [[nodiscard]] std::int64_t max_slots() const { return shape_.batch; }
  [[nodiscard]] std::int64_t group_size() const { return shape_.query_heads / shape_.kv_heads; }
  [[nodiscard]] std::int64_t item(std::int64_t b, std::int64_t g) const { return b * shape_.kv_heads + g; }
  // Whether (b, g) names an item of this cache (false for every index of an empty cache).
  [[nodiscard]] bool has(std::int64_t b, std::int64_t g = 0) const {
    return b >= 0 && b < shape_.batch && g >= 0 && g < shape_.kv_heads && valid();
  }

  // Entries of (b, g) and the next absolute position of sequence b (= tokens seen, spec UA.md 6.10);
  // 0 for an index outside the cache.
  [[nodiscard]] std::int64_t length(std::int64_t b, std::int64_t g) const {
    return has(b, g) ? length_[item(b, g)] : 0;
  }
  [[nodiscard]] std::int64_t position(std::int64_t b) const { return has(b) ? counter_[b] : 0; }
  [[nodiscard]] std::int64_t max_length() const {
    std::int64_t m = 0;
    for (std::int64_t i = 0; valid() && i < shape_.batch * shape_.kv_heads; ++i) m = std::max(m, length_[i]);
    return m;
  }
  // Whether slot b's (slot, kv head) items found the pool dry; cleared by reset_slots.
  [[nodiscard]] bool overflowed(std::int64_t b) const {
    return has(b) && std::atomic_ref<std::int64_t>(overflow_[b]).load(std::memory_order_relaxed) != 0;
  }

  // ---- occupancy (plain reads, DESIGN.md 3: an engine's admission control) ----
  [[nodiscard]] std::int64_t pool_pages() const { return valid() ? shape_.pages() : 0; }
  [[nodiscard]] std::int64_t free_pages() const { return valid() ? stats_[0] : 0; }
  [[nodiscard]] std::int64_t pages_in_use() const { return pool_pages() - free_pages(); }
  // Pages (b, g) holds now.
  [[nodiscard]] std::int64_t pages(std::int64_t b, std::int64_t g) const { return has(b, g) ? held_[item(b, g)] : 0; }
  // Pages taken from and returned to the free list since creation (pages_taken - pages_returned ==
  // pages_in_use).
  [[nodiscard]] std::int64_t pages_taken() const { return valid() ? stats_[1] : 0; }
  [[nodiscard]] std::int64_t pages_returned() const { return valid() ? stats_[2] : 0; }
  // Bytes of the cache proper (cache_layout(shape()).bytes) and of its workspace.
  [[nodiscard]] std::size_t cache_bytes() const { return valid() ? cache_total_ : 0; }
  [[nodiscard]] std::size_t workspace_bytes() const { return ws_ ? ws_total_ : 0; }
  [[nodiscard]] std::size_t page_bytes() const {
    return valid() ? std::size_t(shape_.page_rows) * cache_detail::row_bytes<Storage>(shape_.head_dim) : 0;
  }

  // Row views of one (b, g): positions, λ and key-gate logits [length], keys/values [length, D];
  // nullptr for an index outside the cache. See the header comment for their lifetime.
  [[nodiscard]] const std::int64_t* positions(std::int64_t b, std::int64_t g) const {
    return has(b, g) ? rows_of(pos_, 1, b, g, gather_pos_) : nullptr;
  }
  [[nodiscard]] const float* lambda(std::int64_t b, std::int64_t g) const {
    return has(b, g) ? rows_of(lambda_, 1, b, g, gather_lambda_) : nullptr;
  }
  [[nodiscard]] const float* key_logits(std::int64_t b, std::int64_t g) const {
    return has(b, g) ? rows_of(key_logit_, 1, b, g, gather_key_logit_) : nullptr;
  }
  [[nodiscard]] const Storage* keys(std::int64_t b, std::int64_t g) const {
    return has(b, g) ? rows_of(keys_, shape_.head_dim, b, g, gather_keys_) : nullptr;
  }
  [[nodiscard]] const Storage* values(std::int64_t b, std::int64_t g) const {
    return has(b, g) ? rows_of(values_, shape_.head_dim, b, g, gather_values_) : nullptr;
  }
  // The scales of the key and value rows [length] (row-scaled storage: a stored row reads as scale *
  // row); nullptr for other storage types or an index outside the cache.
  [[nodiscard]] const float* key_scales(std::int64_t b, std::int64_t g) const {
    return has(b, g) && key_scale_ ? rows_of(key_scale_, 1, b, g, gather_key_scale_) : nullptr;
  }
  [[nodiscard]] const float* value_scales(std::int64_t b, std::int64_t g) const {
    return has(b, g) && value_scale_ ? rows_of(value_scale_, 1, b, g, gather_value_scale_) : nullptr;
  }

  // Pages of (b, g) freed by the last operation on slot b: rows [length, peak) were in use during the
  // operation and are free now; the logical pages wholly inside that tail went back to the pool.
  [[nodiscard]] PageRange freed_pages(std::int64_t b, std::int64_t g) const {
    if (!has(b, g)) return {};
    const std::int64_t pr = shape_.page_rows;
    const std::int64_t first = (length(b, g) + pr - 1) / pr;
    const std::int64_t end = (peak_[item(b, g)] + pr - 1) / pr;
    return {first, end > first ? end - first : 0};
  }
  [[nodiscard]] std::int64_t freed_rows(std::int64_t b, std::int64_t g) const {
    return has(b, g) ? peak_[item(b, g)] - length(b, g) : 0;
  }

  // Empties sequence b (all its kv heads, pages back to the pool, overflow flag cleared) and restarts
  // its position counter, e.g. to reuse a slot (the batched form is ua::reset_slots). A bad b or an
  // empty cache is refused, the cache untouched.
  Status reset_sequence(std::int64_t b) {
    if (!valid()) return invalid_argument("cache", "a cache made by PrunedCache::create", "an empty cache");
    if (!has(b))
      return {StatusCode::kOutOfRange,
              kvmem::detail::concat("reset_sequence b: expected 0 <= b < max_slots = ", shape_.batch, ", got ", b)};
    restart(b);
    return Status::ok();
  }

  // ---- access for the operations in ua/ops.hpp and ua/slots.hpp (one (b, g) item per worker) ----
  struct ItemView {
    Storage* keys;      // pool rows [pages * page_rows, D]; entry e at row map(e)
    Storage* values;    // pool rows [pages * page_rows, D]
    float* lambda;      // pool rows [pages * page_rows]
    float* key_logit;   // pool rows [pages * page_rows]
    std::int64_t* pos;  // pool rows [pages * page_rows]
    kernel::ua::RowMap map;
    std::int64_t* length;
    std::int64_t* peak;
    float* workspace;    // [block_workspace_elems(r, D)], of the work item the view was taken for
    float* key_scale;    // pool rows: row-scaled storage only (else nullptr)
    float* value_scale;  // pool rows
  };
  // Item (b, g) with the workspace of work item w (prefill/decode use b * G + g, a step row * G + g).
  ItemView item_view(std::int64_t b, std::int64_t g, std::int64_t w) {
    const std::int64_t it = item(b, g);
    float* ws = (ws_ != nullptr && w >= 0 && w < wl_.count)
                    ? reinterpret_cast<float*>(ws_ + wl_.items + std::size_t(w) * wl_.item_bytes)
                    : nullptr;
    if (static_) {  // the item's own pages, consecutive: contiguous rows from its first page
      const std::int64_t r0 = it * shape_.pages_per_item() * shape_.page_rows, D = shape_.head_dim;
      return {keys_ + r0 * D,
              values_ + r0 * D,
              lambda_ + r0,
              key_logit_ + r0,
              pos_ + r0,
              kernel::ua::RowMap{},
              &length_[it],
              &peak_[it],
              ws,
              key_scale_ ? key_scale_ + r0 : nullptr,
              value_scale_ ? value_scale_ + r0 : nullptr};
    }
    return {keys_,        values_,    lambda_, key_logit_, pos_,        map_of(it),
            &length_[it], &peak_[it], ws,      key_scale_, value_scale_};
  }
  ItemView item_view(std::int64_t b, std::int64_t g) { return item_view(b, g, item(b, g)); }
  // The step's row list in the workspace [workspace rows].
  std::int64_t* row_list() const { return ws_ ? reinterpret_cast<std::int64_t*>(ws_ + wl_.row_list) : nullptr; }
  [[nodiscard]] std::int64_t workspace_rows() const { return ws_ ? ws_rows_ : 0; }

  // Makes (b, g) hold pages for `rows` rows, taking pages from the free list; false (pages held so far
  // kept) when the pool runs dry. Safe to call from the workers of one operation at once.
  bool reserve_rows(std::int64_t b, std::int64_t g, std::int64_t rows) {
    const std::int64_t it = item(b, g), need = (rows + shape_.page_rows - 1) / shape_.page_rows;
    std::int64_t& held = held_[it];
    if (held >= need) return true;
    const Lock lock(free_lock_);
    if (static_) {  // the item's own pages: only the counts move
      stats_[0] -= need - held;
      stats_[1] += need - held;
      held = need;
      return true;
    }
    std::int32_t* table = table_ + it * shape_.pages_per_item();
    while (held < need) {
      if (stats_[0] == 0) return false;
      table[held++] = free_list_[--stats_[0]];
      ++stats_[1];
    }
    return true;
  }
  // Returns the pages of (b, g) past its first `rows` rows to the free list.
  void release_rows(std::int64_t b, std::int64_t g, std::int64_t rows) {
    const std::int64_t it = item(b, g), keep = (rows + shape_.page_rows - 1) / shape_.page_rows;
    std::int64_t& held = held_[it];
    if (held <= keep) return;
    const Lock lock(free_lock_);
    if (static_) {
      stats_[0] += held - keep;
      stats_[2] += held - keep;
      held = keep;
      return;
    }
    const std::int32_t* table = table_ + it * shape_.pages_per_item();
    while (held > keep) {
      free_list_[stats_[0]++] = table[--held];
      ++stats_[2];
    }
  }
  // Set by the worker whose page request failed (several may race: an atomic store).
  void set_overflow(std::int64_t b) { std::atomic_ref<std::int64_t>(overflow_[b]).store(1); }
  void set_overflowed(std::int64_t b, bool flag) { overflow_[b] = flag ? 1 : 0; }

  void advance(std::int64_t b, std::int64_t tokens) { counter_[b] += tokens; }
  void set_position(std::int64_t b, std::int64_t position) { counter_[b] = position; }
  void set_length(std::int64_t b, std::int64_t g, std::int64_t length, std::int64_t peak) {
    length_[item(b, g)] = length;
    peak_[item(b, g)] = peak;
  }
  // Unchecked reset of slot b (callers check b first): lengths 0, pages back to the pool, overflow
  // flag and position counter cleared.
  void restart(std::int64_t b) {
    for (std::int64_t g = 0; g < shape_.kv_heads; ++g) {
      release_rows(b, g, 0);
      length_[item(b, g)] = 0;
      peak_[item(b, g)] = 0;
    }
    counter_[b] = 0;
    overflow_[b] = 0;
  }

  void swap(PrunedCache& o) noexcept {
    std::swap(shape_, o.shape_);
    owned_.swap(o.owned_);
    std::swap(base_, o.base_);
    std::swap(ws_, o.ws_);
    std::swap(off_, o.off_);
    std::swap(wl_, o.wl_);
    std::swap(cache_total_, o.cache_total_);
    std::swap(ws_total_, o.ws_total_);
    std::swap(ws_rows_, o.ws_rows_);
    std::swap(shift_, o.shift_);
    std::swap(static_, o.static_);
    std::swap(keys_, o.keys_);
    std::swap(values_, o.values_);
    std::swap(lambda_, o.lambda_);
    std::swap(key_logit_, o.key_logit_);
    std::swap(pos_, o.pos_);
    std::swap(key_scale_, o.key_scale_);
    std::swap(value_scale_, o.value_scale_);
    std::swap(table_, o.table_);
    std::swap(held_, o.held_);
    std::swap(length_, o.length_);
    std::swap(peak_, o.peak_);
    std::swap(counter_, o.counter_);
    std::swap(overflow_, o.overflow_);
    std::swap(free_list_, o.free_list_);
    std::swap(stats_, o.stats_);
    gather_keys_.swap(o.gather_keys_);
    gather_values_.swap(o.gather_values_);
    gather_lambda_.swap(o.gather_lambda_);
    gather_key_logit_.swap(o.gather_key_logit_);
    gather_pos_.swap(o.gather_pos_);
    gather_key_scale_.swap(o.gather_key_scale_);
    gather_value_scale_.swap(o.gather_value_scale_);
  }

 private:
  // A spin lock around the free list: held for a few pointer moves per page, by at most one worker per
  // (slot, kv head) of an operation.
  struct SpinLock {
    std::atomic<bool> locked{false};
    SpinLock() = default;
    SpinLock(const SpinLock&) {}
    SpinLock& operator=(const SpinLock&) { return *this; }
  };
  struct Lock {
    SpinLock& l;
    explicit Lock(SpinLock& s) : l(s) {
      while (l.locked.exchange(true, std::memory_order_acquire)) {
      }
    }
    ~Lock() { l.locked.store(false, std::memory_order_release); }
    Lock(const Lock&) = delete;
    Lock& operator=(const Lock&) = delete;
  };

  [[nodiscard]] kernel::ua::RowMap map_of(std::int64_t it) const {
    return {table_ + it * shape_.pages_per_item(), shift_};
  }

  // The rows [0, length) of one field of (b, g), `width` elements each: the pool's own rows when the
  // item's pages are consecutive, else a copy in `buf`.
  template <class T>
  const T* rows_of(T* field, std::int64_t width, std::int64_t b, std::int64_t g, std::vector<T>& buf) const {
    const std::int64_t it = item(b, g), n = length_[it], pr = shape_.page_rows;
    if (static_) return field + it * shape_.pages_per_item() * pr * width;
    const std::int32_t* table = table_ + it * shape_.pages_per_item();
    bool consecutive = true;
    for (std::int64_t p = 1; p < (n + pr - 1) / pr && consecutive; ++p) consecutive = table[p] == table[0] + p;
    if (n == 0 || consecutive) return field + (n == 0 ? 0 : std::int64_t(table[0]) * pr * width);
    buf.resize(std::size_t(n * width));
    const kernel::ua::RowMap map = map_of(it);
    for (std::int64_t e = 0; e < n; ++e) std::copy_n(field + map(e) * width, width, buf.data() + e * width);
    return buf.data();
  }

  void bind(std::byte* base, const CacheShape& s) {
    shape_ = s;
    base_ = base;
    off_ = cache_detail::offsets<Storage>(s);
    cache_total_ = off_.total;
    shift_ = cache_detail::log2_exact(s.page_rows);
    static_ = s.pool_pages == 0;
    keys_ = reinterpret_cast<Storage*>(base + off_.keys);
    values_ = reinterpret_cast<Storage*>(base + off_.values);
    lambda_ = reinterpret_cast<float*>(base + off_.lambda);
    key_logit_ = reinterpret_cast<float*>(base + off_.key_logit);
    pos_ = reinterpret_cast<std::int64_t*>(base + off_.pos);
    key_scale_ = is_row_scaled_v<Storage> ? reinterpret_cast<float*>(base + off_.key_scale) : nullptr;
    value_scale_ = is_row_scaled_v<Storage> ? reinterpret_cast<float*>(base + off_.value_scale) : nullptr;
    table_ = reinterpret_cast<std::int32_t*>(base + off_.table);
    held_ = reinterpret_cast<std::int64_t*>(base + off_.held);
    length_ = reinterpret_cast<std::int64_t*>(base + off_.length);
    peak_ = reinterpret_cast<std::int64_t*>(base + off_.peak);
    counter_ = reinterpret_cast<std::int64_t*>(base + off_.counter);
    overflow_ = reinterpret_cast<std::int64_t*>(base + off_.overflow);
    free_list_ = reinterpret_cast<std::int32_t*>(base + off_.free_list);
    stats_ = reinterpret_cast<std::int64_t*>(base + off_.stats);
  }
  void bind_workspace(std::byte* ws, std::int64_t rows) {
    ws_ = ws;
    ws_rows_ = rows;
    wl_ = cache_detail::work_layout(shape_, rows);
    ws_total_ = wl_.total;
  }
  // Every slot empty, every page free (taken in increasing order: page p is the (P-1-p)-th popped).
  void reset_all() {
    const std::int64_t items = shape_.batch * shape_.kv_heads, P = shape_.pages();
    for (std::int64_t i = 0; i < items; ++i) held_[i] = length_[i] = peak_[i] = 0;
    for (std::int64_t b = 0; b < shape_.batch; ++b) counter_[b] = overflow_[b] = 0;
    for (std::int64_t p = 0; p < P; ++p) free_list_[p] = std::int32_t(P - 1 - p);
    if (static_)  // item i owns pages [i * pages_per_item, (i + 1) * pages_per_item)
      for (std::int64_t p = 0; p < P; ++p) table_[p] = std::int32_t(p);
    stats_[0] = P;
    stats_[1] = stats_[2] = 0;
  }
  void copy_from(const PrunedCache& o) {
    if (!o.valid()) return;
    const std::size_t wb = cache_detail::work_layout(o.shape_, o.shape_.batch).total;
    owned_.reset(new (std::align_val_t(kMemoryAlign)) std::byte[o.cache_total_ + wb]);
    std::memcpy(owned_.get(), o.base_, o.cache_total_);
    bind(owned_.get(), o.shape_);
    bind_workspace(owned_.get() + o.cache_total_, o.shape_.batch);
  }

  struct AlignedDelete {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t(kMemoryAlign)); }
  };

  // An empty cache: no slots, and a group size of 1 so that no accessor divides by zero.
  CacheShape shape_{0, 1, 1, 0, 0, 16, 0};
  std::unique_ptr<std::byte[], AlignedDelete> owned_;
  std::byte* base_ = nullptr;
  std::byte* ws_ = nullptr;
  cache_detail::Offsets off_{};
  cache_detail::WorkLayout wl_{};
  std::size_t cache_total_ = 0, ws_total_ = 0;
  std::int64_t ws_rows_ = 0;
  int shift_ = 0;
  bool static_ = false;                // pool_pages == 0: every item owns its pages (contiguous rows, no free list)
  Storage* keys_ = nullptr;            // pool [pages * page_rows, D]
  Storage* values_ = nullptr;          // pool [pages * page_rows, D]
  float* lambda_ = nullptr;            // pool [pages * page_rows]
  float* key_logit_ = nullptr;         // pool [pages * page_rows]
  std::int64_t* pos_ = nullptr;        // pool [pages * page_rows]
  float* key_scale_ = nullptr;         // pool [pages * page_rows], row-scaled storage only
  float* value_scale_ = nullptr;       // pool [pages * page_rows], row-scaled storage only
  std::int32_t* table_ = nullptr;      // [B, G, pages_per_item]
  std::int64_t* held_ = nullptr;       // [B, G] pages held
  std::int64_t* length_ = nullptr;     // [B, G]
  std::int64_t* peak_ = nullptr;       // [B, G]
  std::int64_t* counter_ = nullptr;    // [B]
  std::int64_t* overflow_ = nullptr;   // [B] 0/1
  std::int32_t* free_list_ = nullptr;  // [pages], a stack: free pages at [0, free count)
  std::int64_t* stats_ = nullptr;      // free count, pages taken, pages returned
  SpinLock free_lock_;
  // Inspection copies of non-consecutive rows (accessors only, never an operation).
  mutable std::vector<Storage> gather_keys_, gather_values_;
  mutable std::vector<float> gather_lambda_, gather_key_logit_;
  mutable std::vector<std::int64_t> gather_pos_;
  mutable std::vector<float> gather_key_scale_, gather_value_scale_;
};

// Closed-form bytes of a PrunedCache<Storage> of shape s (all zero when s is invalid).
template <class Storage = float>
CacheLayout cache_layout(const CacheShape& s) {
  if (!PrunedCache<Storage>::validate_shape(s).is_ok()) return {};
  CacheLayout l;
  l.page_bytes = std::size_t(s.page_rows) * cache_detail::row_bytes<Storage>(s.head_dim);
  l.item_bytes = std::size_t(s.pages_per_item()) * sizeof(std::int32_t) + 3 * sizeof(std::int64_t);
  l.slot_bytes = 2 * sizeof(std::int64_t);
  l.pages = s.pages();
  l.bytes = cache_detail::offsets<Storage>(s).total;
  return l;
}
// Workspace bytes of one call of at most limits.max_rows rows that name a slot (0 = max_slots) on the
// host backend (0 when s is invalid or max_rows < 0). It does not grow with the call's token count: the
// attend body works in tiles.
template <class Storage = float>
std::size_t workspace_bytes(const CacheShape& s, const Limits& limits = {}) {
  if (!PrunedCache<Storage>::validate_shape(s).is_ok() || limits.max_rows < 0) return 0;
  return cache_detail::work_layout(s, limits.max_rows > 0 ? limits.max_rows : s.batch).total;
}

// ---- report: kept keys, bytes and compression per (layer, sequence, kv head) -------------------
// In the vocabulary of KV-compression tools: compression ratio = fraction of the dense cache removed
// (0 = nothing evicted, 0.9 = 10x smaller). Bytes count keys + values (spec UA.md 4.5 "Reporting");
// the per-key scalars (λ, key-gate logit: fp32, position: int64) are reported separately. What the
// cache really holds for the item is allocated_bytes: its pool pages (kept rows rounded up to pages,
// every field) plus its page table and counters; the pool's free pages and the workspace are the
// cache's, not an item's (PrunedCache::cache_bytes, workspace_bytes).
struct CacheReportRow {
  std::int64_t layer = 0, batch = 0, kv_head = 0;
  std::int64_t kept = 0;      // entries in the cache
  std::int64_t dense = 0;     // entries a dense cache would hold (tokens seen, n_b)
  std::int64_t kv_bytes = 0;  // kept * 2 * D * sizeof(storage), + 2 fp32 row scales per entry for fp8
  std::int64_t dense_kv_bytes = 0;
  std::int64_t scalar_bytes = 0;     // kept * (4 + 4 + 8)
  std::int64_t pages = 0;            // pool pages the item holds
  std::int64_t allocated_bytes = 0;  // pages * page_bytes + the item's page table and counters
  double compression_ratio = 0.0;    // 1 - kept / dense (0 when dense == 0)
};

template <class Storage>
std::vector<CacheReportRow> report(const PrunedCache<Storage>& cache, std::int64_t layer = 0) {
  std::vector<CacheReportRow> rows;
  const auto& s = cache.shape();
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t g = 0; g < s.kv_heads; ++g) {
      CacheReportRow r;
      r.layer = layer;
      r.batch = b;
      r.kv_head = g;
      r.kept = cache.length(b, g);
      r.dense = cache.position(b);
      const auto per_row = static_cast<std::int64_t>(2 * s.head_dim * sizeof(Storage) +
                                                     (is_row_scaled_v<Storage> ? 2 * sizeof(float) : 0));
      r.kv_bytes = r.kept * per_row;
      r.dense_kv_bytes = r.dense * per_row;
      r.scalar_bytes = r.kept * 16;
      r.pages = cache.pages(b, g);
      r.allocated_bytes = r.pages * static_cast<std::int64_t>(cache.page_bytes()) +
                          static_cast<std::int64_t>(cache_layout<Storage>(s).item_bytes);
      r.compression_ratio = r.dense > 0 ? 1.0 - static_cast<double>(r.kept) / static_cast<double>(r.dense) : 0.0;
      rows.push_back(r);
    }
  return rows;
}

}  // namespace kvmem::ua
