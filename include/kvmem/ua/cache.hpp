// SPDX-License-Identifier: Apache-2.0
#pragma once
// PrunedCache: the Universal Attention inference cache (spec UA.md 2, 4.4, 4.5). Per (sequence, kv
// head) a variable-length list of entries (key, value, λ, key-gate logit, absolute position) in
// ascending position order; per sequence an absolute position counter n_b that advances by one per
// token whatever the cache length (spec UA.md 4.5, "Storage order and positions"; the caller rotates
// the next token at position(b)).
//
// Memory is allocated once, at construction, for `capacity` rows per (sequence, kv head); prefill and
// decode never allocate. Rows are grouped in pages of `page_rows` rows; after each operation the cache
// tells which pages of each (sequence, kv head) became free (eviction compacts the survivors to the
// front, so the freed rows are always the tail [length, peak)), so an engine that maps pages to
// physical blocks can reclaim them.
//
// Keys and values are stored in `Storage` (float, bf16 or fp16); λ and the key-gate logit in fp32.
//
// Sequence slots (DESIGN.md 3, core/slots.hpp): the cache holds max_slots() = CacheShape::batch
// sequence slots, fixed at creation. Each slot has its own position counter and its own entry list per
// kv head, so slots join, advance (ua::step), fork (ua::copy_slots), restart (ua::reset_slots) and
// travel (ua::export_slot / import_slot) independently of one another.
//
// Safety (DESIGN.md 3): a default-constructed or moved-from cache is empty (max_slots() == 0); every
// operation of ua/ops.hpp refuses it with a Status, and the accessors below return 0 / nullptr for an
// empty cache or an index outside the shape instead of reading out of bounds.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvmem/core/numeric.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/kernel/ua_attend.hpp"

namespace kvmem::ua {

struct CacheShape {
  std::int64_t batch = 1;        // B sequences
  std::int64_t query_heads = 1;  // H
  std::int64_t kv_heads = 1;     // G, H % G == 0
  std::int64_t head_dim = 1;     // D (keys and values)
  std::int64_t capacity = 0;     // rows per (sequence, kv head)
  std::int64_t page_rows = 16;   // rows per page for reclamation reports
};

// A contiguous run of pages [first, first + count) of one (sequence, kv head).
struct PageRange {
  std::int64_t first = 0;
  std::int64_t count = 0;
};

template <class Storage = float>
class PrunedCache {
  static_assert(is_storage_type_v<Storage> && !std::is_same_v<Storage, double>,
                "kvmem::ua::PrunedCache: Storage must be float, kvmem::bf16 or kvmem::fp16 (fp32 accumulation)");

 public:
  using storage_type = Storage;

  PrunedCache() = default;
  PrunedCache(const PrunedCache&) = default;
  PrunedCache& operator=(const PrunedCache&) = default;
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
    if (s.page_rows <= 0) return invalid_argument("CacheShape page_rows", "> 0", s.page_rows);
    return Status::ok();
  }

  // Checked construction; on failure `out` is unchanged.
  static Status create(const CacheShape& s, PrunedCache& out) {
    KVMEM_RETURN_IF_ERROR(validate_shape(s));
    PrunedCache c;
    c.shape_ = s;
    const std::size_t items = static_cast<std::size_t>(s.batch * s.kv_heads);
    const std::size_t rows = items * static_cast<std::size_t>(s.capacity);
    c.keys_.assign(rows * static_cast<std::size_t>(s.head_dim), Storage{});
    c.values_.assign(rows * static_cast<std::size_t>(s.head_dim), Storage{});
    c.lambda_.assign(rows, 0.0f);
    c.key_logit_.assign(rows, 0.0f);
    c.pos_.assign(rows, 0);
    c.length_.assign(items, 0);
    c.peak_.assign(items, 0);
    c.counter_.assign(static_cast<std::size_t>(s.batch), 0);
    c.workspace_.assign(
        items * static_cast<std::size_t>(kernel::ua::block_workspace_elems(s.query_heads / s.kv_heads, s.head_dim)),
        0.0f);
    out = std::move(c);
    return Status::ok();
  }
  // Throwing convenience constructor.
  explicit PrunedCache(const CacheShape& s) { throw_if_error(create(s, *this)); }

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
    return has(b, g) ? length_[idx(item(b, g))] : 0;
  }
  [[nodiscard]] std::int64_t position(std::int64_t b) const { return has(b) ? counter_[idx(b)] : 0; }
  [[nodiscard]] std::int64_t max_length() const {
    std::int64_t m = 0;
    for (auto l : length_) m = l > m ? l : m;
    return m;
  }

  // Row views of one (b, g): positions, λ and key-gate logits [length], keys/values [length, D];
  // nullptr for an index outside the cache.
  [[nodiscard]] const std::int64_t* positions(std::int64_t b, std::int64_t g) const {
    return has(b, g) ? pos_.data() + row0(b, g) : nullptr;
  }
  [[nodiscard]] const float* lambda(std::int64_t b, std::int64_t g) const {
    return has(b, g) ? lambda_.data() + row0(b, g) : nullptr;
  }
  [[nodiscard]] const float* key_logits(std::int64_t b, std::int64_t g) const {
    return has(b, g) ? key_logit_.data() + row0(b, g) : nullptr;
  }
  [[nodiscard]] const Storage* keys(std::int64_t b, std::int64_t g) const {
    return has(b, g) ? keys_.data() + row0(b, g) * shape_.head_dim : nullptr;
  }
  [[nodiscard]] const Storage* values(std::int64_t b, std::int64_t g) const {
    return has(b, g) ? values_.data() + row0(b, g) * shape_.head_dim : nullptr;
  }

  // Pages of (b, g) freed by the last operation on slot b: rows [length, peak) were in use during the
  // operation and are free now; the pages wholly inside that tail are returned.
  [[nodiscard]] PageRange freed_pages(std::int64_t b, std::int64_t g) const {
    if (!has(b, g)) return {};
    const std::int64_t pr = shape_.page_rows;
    const std::int64_t first = (length(b, g) + pr - 1) / pr;
    const std::int64_t end = (peak_[idx(item(b, g))] + pr - 1) / pr;
    return {first, end > first ? end - first : 0};
  }
  [[nodiscard]] std::int64_t freed_rows(std::int64_t b, std::int64_t g) const {
    return has(b, g) ? peak_[idx(item(b, g))] - length(b, g) : 0;
  }

  // Empties sequence b (all its kv heads) and restarts its position counter, e.g. to reuse a slot
  // (the batched form is ua::reset_slots). A bad b or an empty cache is refused, the cache untouched.
  Status reset_sequence(std::int64_t b) {
    if (!valid()) return invalid_argument("cache", "a cache made by PrunedCache::create", "an empty cache");
    if (!has(b))
      return {StatusCode::kOutOfRange,
              kvmem::detail::concat("reset_sequence b: expected 0 <= b < max_slots = ", shape_.batch, ", got ", b)};
    restart(b);
    return Status::ok();
  }

  // ---- access for the operations in ua/ops.hpp (one (b, g) item per worker) ----
  struct ItemView {
    Storage* keys;      // [capacity, D]
    Storage* values;    // [capacity, D]
    float* lambda;      // [capacity]
    float* key_logit;   // [capacity]
    std::int64_t* pos;  // [capacity]
    std::int64_t* length;
    std::int64_t* peak;
    float* workspace;  // [block_workspace_elems(r, D)]
  };
  ItemView item_view(std::int64_t b, std::int64_t g) {
    const std::int64_t it = item(b, g);
    const std::int64_t r0 = row0(b, g);
    return {keys_.data() + r0 * shape_.head_dim,
            values_.data() + r0 * shape_.head_dim,
            lambda_.data() + r0,
            key_logit_.data() + r0,
            pos_.data() + r0,
            &length_[idx(it)],
            &peak_[idx(it)],
            workspace_.data() + it * kernel::ua::block_workspace_elems(group_size(), shape_.head_dim)};
  }
  void advance(std::int64_t b, std::int64_t tokens) { counter_[idx(b)] += tokens; }
  void set_position(std::int64_t b, std::int64_t position) { counter_[idx(b)] = position; }
  // Unchecked reset of slot b (callers check b first).
  void restart(std::int64_t b) {
    for (std::int64_t g = 0; g < shape_.kv_heads; ++g) {
      length_[idx(item(b, g))] = 0;
      peak_[idx(item(b, g))] = 0;
    }
    counter_[idx(b)] = 0;
  }

  void swap(PrunedCache& o) noexcept {
    std::swap(shape_, o.shape_);
    keys_.swap(o.keys_);
    values_.swap(o.values_);
    lambda_.swap(o.lambda_);
    key_logit_.swap(o.key_logit_);
    pos_.swap(o.pos_);
    length_.swap(o.length_);
    peak_.swap(o.peak_);
    counter_.swap(o.counter_);
    workspace_.swap(o.workspace_);
  }

 private:
  static std::size_t idx(std::int64_t i) { return static_cast<std::size_t>(i); }
  [[nodiscard]] std::int64_t row0(std::int64_t b, std::int64_t g) const { return item(b, g) * shape_.capacity; }

  // An empty cache: no slots, and a group size of 1 so that no accessor divides by zero.
  CacheShape shape_{0, 1, 1, 0, 0, 16};
  std::vector<Storage> keys_, values_;       // [B, G, capacity, D]
  std::vector<float> lambda_, key_logit_;    // [B, G, capacity]
  std::vector<std::int64_t> pos_;            // [B, G, capacity]
  std::vector<std::int64_t> length_, peak_;  // [B, G]
  std::vector<std::int64_t> counter_;        // [B]
  std::vector<float> workspace_;             // [B, G, block_workspace_elems]
};

// ---- report: kept keys, bytes and compression per (layer, sequence, kv head) -------------------
// In the vocabulary of KV-compression tools: compression ratio = fraction of the dense cache removed
// (0 = nothing evicted, 0.9 = 10x smaller). Bytes count keys + values (spec UA.md 4.5 "Reporting");
// the per-key scalars (λ, key-gate logit: fp32, position: int64) are reported separately.
struct CacheReportRow {
  std::int64_t layer = 0, batch = 0, kv_head = 0;
  std::int64_t kept = 0;      // entries in the cache
  std::int64_t dense = 0;     // entries a dense cache would hold (tokens seen, n_b)
  std::int64_t kv_bytes = 0;  // kept * 2 * D * sizeof(storage)
  std::int64_t dense_kv_bytes = 0;
  std::int64_t scalar_bytes = 0;   // kept * (4 + 4 + 8)
  double compression_ratio = 0.0;  // 1 - kept / dense (0 when dense == 0)
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
      const auto per_row = static_cast<std::int64_t>(2 * s.head_dim * sizeof(Storage));
      r.kv_bytes = r.kept * per_row;
      r.dense_kv_bytes = r.dense * per_row;
      r.scalar_bytes = r.kept * 16;
      r.compression_ratio = r.dense > 0 ? 1.0 - static_cast<double>(r.kept) / static_cast<double>(r.dense) : 0.0;
      rows.push_back(r);
    }
  return rows;
}

}  // namespace kvmem::ua
