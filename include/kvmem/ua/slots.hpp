// SPDX-License-Identifier: Apache-2.0
#pragma once
// Slot operations of the Universal Attention cache (DESIGN.md 3, core/slots.hpp): reset, copy (fork),
// export / import of one slot as a versioned byte record, and truncate. The same names and argument
// order as KVM's (kvmem::kvm), so an engine drives both mechanisms alike. Every operation validates
// all of its arguments before it changes anything; a refused call leaves the cache bit-identical.
// These are the host cache's operations (ua::PrunedCache); they run on the calling thread, and the
// executor is taken for the common shape of the API. The record's writer and reader (write_record,
// read_record over UaSlotFields) are shared with the other backends, so a slot exported by one imports
// on any other.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kvmem/core/numeric.hpp"
#include "kvmem/core/slots.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/ua/cache.hpp"

namespace kvmem::ua {

namespace detail {

template <class Storage>
Status check_cache(const PrunedCache<Storage>& cache) {
  if (!cache.valid()) return invalid_argument("cache", "a cache made by PrunedCache::create", "an empty cache");
  return Status::ok();
}

template <class Storage>
Status check_slot(const PrunedCache<Storage>& cache, std::int64_t slot, const char* name = "slot") {
  KVMEM_RETURN_IF_ERROR(check_cache(cache));
  if (slot < 0 || slot >= cache.max_slots())
    return {StatusCode::kOutOfRange,
            kvmem::detail::concat(name, ": expected 0 <= slot < max_slots = ", cache.max_slots(), ", got ", slot)};
  return Status::ok();
}

// Slot lists are read through data(): one slot after another.
inline Status check_list_view(TensorView<const std::int32_t, 1> list, const char* name) {
  if (list.extent(0) > 1 && list.stride(0) != 1)
    return invalid_argument(std::string(name) + " stride", 1, list.stride(0));
  return Status::ok();
}

inline constexpr std::uint32_t kUaRecordFields = 11;

// Ok when the pool can give `need` pages once the listed items' `freed` pages are back; else the reason.
template <class Storage>
Status check_pool(const PrunedCache<Storage>& cache, std::int64_t need, std::int64_t freed, const char* what) {
  if (need <= cache.free_pages() + freed) return Status::ok();
  return {StatusCode::kOutOfRange,
          kvmem::detail::concat(what, ": needs ", need, " pages of ", cache.shape().page_rows, " rows, the pool has ",
                                cache.free_pages(), " free (+ ", freed, " the replaced rows return)")};
}

// Copies `n` rows of item (a, ga) to item (b, gb), whose pages are reserved already.
template <class Storage>
void copy_rows(PrunedCache<Storage>& cache, std::int64_t a, std::int64_t ga, std::int64_t b, std::int64_t gb,
               std::int64_t n) {
  const std::int64_t D = cache.shape().head_dim;
  auto from = cache.item_view(a, ga, -1);
  auto to = cache.item_view(b, gb, -1);
  for (std::int64_t e = 0; e < n; ++e) {
    const std::int64_t x = from.map(e), y = to.map(e);
    for (std::int64_t d = 0; d < D; ++d) {
      to.keys[y * D + d] = from.keys[x * D + d];
      to.values[y * D + d] = from.values[x * D + d];
    }
    to.lambda[y] = from.lambda[x];
    to.key_logit[y] = from.key_logit[x];
    to.pos[y] = from.pos[x];
    if constexpr (is_row_scaled_v<Storage>) {
      to.key_scale[y] = from.key_scale[x];
      to.value_scale[y] = from.value_scale[x];
    }
  }
}

// Whether the D values of row x read back unchanged from the cache's storage type (a row-scaled type
// stores the row with one scale: the row's own, core/numeric.hpp quantize_row).
template <class Storage>
bool representable_row(const float* x, std::int64_t D, std::int64_t& bad) {
  if constexpr (is_row_scaled_v<Storage>) {
    std::vector<Storage> q(static_cast<std::size_t>(D));
    const float scale = quantize_row(x, q.data(), D);
    for (bad = 0; bad < D; ++bad)
      if (load_as<float>(q[static_cast<std::size_t>(bad)]) * scale != x[bad]) return false;
  } else {
    for (bad = 0; bad < D; ++bad)
      if (load_as<float>(store_as<Storage>(x[bad])) != x[bad]) return false;
  }
  return true;
}

}  // namespace detail

// Empties the listed slots (every kv head; their pages go back to the pool, an overflow flag is
// cleared) and restarts their position counters. A slot may be listed more than once. slots: [n] slot
// indices.
template <class Exec, class Storage>
Status reset_slots(const Exec& /*exec*/, PrunedCache<Storage>& cache, TensorView<const std::int32_t, 1> slots) {
  KVMEM_RETURN_IF_ERROR(detail::check_cache(cache));
  KVMEM_RETURN_IF_ERROR(detail::check_list_view(slots, "slots"));
  KVMEM_RETURN_IF_ERROR(check_slot_list(slots.data(), slots.extent(0), cache.max_slots(), "slots", false));
  for (std::int64_t i = 0; i < slots.extent(0); ++i) cache.restart(slots(i));
  return Status::ok();
}

// Copies slot src[i] into slot dst[i] for every pair (fork: beam search, n > 1 sampling, a shared
// prefix): entries, λ, key-gate logits, positions and the position counter, so the copy continues bit
// for bit like its source. Pairs are checked by check_copy_pairs (destinations distinct and no source
// of another pair). Each destination's pages go back to the pool and it takes pages for the copied rows;
// a pool that cannot give them refuses the call before anything changes. src, dst: [n] slot indices.
template <class Exec, class Storage>
Status copy_slots(const Exec& /*exec*/, PrunedCache<Storage>& cache, TensorView<const std::int32_t, 1> src,
                  TensorView<const std::int32_t, 1> dst) {
  KVMEM_RETURN_IF_ERROR(detail::check_cache(cache));
  if (src.extent(0) != dst.extent(0)) return invalid_argument("dst count", src.extent(0), dst.extent(0));
  KVMEM_RETURN_IF_ERROR(detail::check_list_view(src, "src"));
  KVMEM_RETURN_IF_ERROR(detail::check_list_view(dst, "dst"));
  KVMEM_RETURN_IF_ERROR(check_copy_pairs(src.data(), dst.data(), src.extent(0), cache.max_slots()));
  const std::int64_t G = cache.shape().kv_heads, pr = cache.shape().page_rows;
  std::int64_t need = 0, freed = 0;
  for (std::int64_t i = 0; i < src.extent(0); ++i)
    if (src(i) != dst(i))
      for (std::int64_t g = 0; g < G; ++g) {
        need += (cache.length(src(i), g) + pr - 1) / pr;
        freed += cache.pages(dst(i), g);
      }
  KVMEM_RETURN_IF_ERROR(detail::check_pool(cache, need, freed, "copy_slots"));
  for (std::int64_t i = 0; i < src.extent(0); ++i) {
    const std::int64_t a = src(i), b = dst(i);
    if (a == b) continue;
    for (std::int64_t g = 0; g < G; ++g) {
      const std::int64_t n = cache.length(a, g), old = cache.length(b, g);
      cache.release_rows(b, g, 0);
      (void)cache.reserve_rows(b, g, n);  // checked above
      detail::copy_rows(cache, a, g, b, g, n);
      // rows of the destination's old list beyond the copy are free now (freed_pages)
      cache.set_length(b, g, n, old > n ? old : n);
    }
    cache.set_position(b, cache.position(a));
    cache.set_overflowed(b, cache.overflowed(a));
  }
  return Status::ok();
}

// ---- export / import ---------------------------------------------------------------------------------
//
// A UA slot record (core/slots.hpp slot_record, mechanism UA) holds these fields, in this order:
//   query_heads  i64      H   } the importing cache must have the same H, G, D and storage type
//   kv_heads     i64      G   }
//   head_dim     i64      D   }
//   storage      i64      0 = float, 1 = bf16, 2 = fp16, 3 = fp8 e4m3 with a scale per row (keys and
//                         values are stored in this type)
//   position     i64      the slot's position counter n (tokens seen, spec UA.md 4.5)
//   length       i64[G]   kept entries per kv head (each <= the importing cache's capacity and <= n)
//   pos          i64[L]   absolute positions of the entries, kv head by kv head (L = Σ length),
//                         ascending within a kv head, each < n
//   key          f32[L*D] keys, as float (exact for every storage type; fp8: the row's scale applied)
//   value        f32[L*D] values, as float
//   lambda       f32[L]   λ_j = Λ_{n-1, pos_j} (spec UA.md 4.4), finite and <= 0
//   key_logit    f32[L]   key-gate logit z_k of each entry
// The pruning threshold and prefill chunk are options of each call, not state, so a record carries no
// parameter. Page bookkeeping (peak rows) and workspaces are not canonical: an import starts them
// afresh. A record's size depends on the slot's kept rows (export_bytes).

namespace detail {

// The canonical fields of one UA slot as host arrays: what a record holds, whichever backend's cache
// they were gathered from or go to. Entries run kv head by kv head (L = Σ length).
struct UaSlotFields {
  std::int64_t position = 0;
  std::vector<std::int64_t> length;      // [G]
  std::vector<std::int64_t> pos;         // [L]
  std::vector<float> key, value;         // [L*D]
  std::vector<float> lambda, key_logit;  // [L]
};

// Writes the record of `f` for a cache of shape `s` and storage type Storage into `out`; with an empty
// `out` it only counts the bytes (then only f.length is read). Returns the record's size.
template <class Storage>
std::size_t write_record(const CacheShape& s, const UaSlotFields& f, std::span<std::byte> out) {
  const std::int64_t G = s.kv_heads, D = s.head_dim;
  std::int64_t L = 0;
  for (const std::int64_t n : f.length) L += n;
  slot_record::Writer w(out, slot_record::Mechanism::kUa, kUaRecordFields);
  w.scalar<std::int64_t>("query_heads", s.query_heads);
  w.scalar<std::int64_t>("kv_heads", G);
  w.scalar<std::int64_t>("head_dim", D);
  w.scalar<std::int64_t>("storage", slot_record::storage_code<Storage>());
  w.scalar<std::int64_t>("position", f.position);
  w.array("length", f.length.data(), G);
  w.array("pos", f.pos.data(), L);
  w.array("key", f.key.data(), L * D);
  w.array("value", f.value.data(), L * D);
  w.array("lambda", f.lambda.data(), L);
  w.array("key_logit", f.key_logit.data(), L);
  return w.size();
}

// Reads a record into `f` and checks it whole against a cache of shape `s` and storage type Storage:
// version, mechanism, shape (H, G, D, storage type), every length against the capacity, positions
// ascending and below the position counter, λ finite and <= 0, keys and values finite and
// representable in the storage type. A mismatch is a Status naming the field.
template <class Storage>
Status read_record(const CacheShape& s, std::span<const std::byte> in, UaSlotFields& f) {
  const std::int64_t G = s.kv_heads, D = s.head_dim;
  slot_record::Reader rd(in, slot_record::Mechanism::kUa, kUaRecordFields);
  KVMEM_RETURN_IF_ERROR(rd.status());
  KVMEM_RETURN_IF_ERROR(rd.expect<std::int64_t>("query_heads", s.query_heads));
  KVMEM_RETURN_IF_ERROR(rd.expect<std::int64_t>("kv_heads", G));
  KVMEM_RETURN_IF_ERROR(rd.expect<std::int64_t>("head_dim", D));
  KVMEM_RETURN_IF_ERROR(rd.expect<std::int64_t>("storage", slot_record::storage_code<Storage>()));
  std::int64_t& position = f.position;
  KVMEM_RETURN_IF_ERROR(rd.scalar("position", position));
  if (position < 0) return invalid_argument("slot record field 'position'", ">= 0", position);
  std::vector<std::int64_t>& length = f.length;
  length.assign(static_cast<std::size_t>(G), 0);
  KVMEM_RETURN_IF_ERROR(rd.array("length", length.data(), G));
  std::int64_t L = 0;
  for (std::int64_t g = 0; g < G; ++g) {
    const std::int64_t n = length[static_cast<std::size_t>(g)];
    const std::string field = "slot record field 'length'[" + std::to_string(g) + "]";
    if (n < 0 || n > position) return invalid_argument(field, kvmem::detail::concat("0..position = ", position), n);
    if (n > s.capacity)
      return {StatusCode::kOutOfRange,
              kvmem::detail::concat(field, ": expected <= the importing cache's capacity ", s.capacity, ", got ", n)};
    L += n;
  }
  std::vector<std::int64_t>& pos = f.pos;
  std::vector<float>&key = f.key, &value = f.value, &lambda = f.lambda, &key_logit = f.key_logit;
  pos.assign(static_cast<std::size_t>(L), 0);
  key.assign(static_cast<std::size_t>(L * D), 0.0f);
  value.assign(key.size(), 0.0f);
  lambda.assign(pos.size(), 0.0f);
  key_logit.assign(pos.size(), 0.0f);
  KVMEM_RETURN_IF_ERROR(rd.array("pos", pos.data(), L));
  KVMEM_RETURN_IF_ERROR(rd.array("key", key.data(), L * D));
  KVMEM_RETURN_IF_ERROR(rd.array("value", value.data(), L * D));
  KVMEM_RETURN_IF_ERROR(rd.array("lambda", lambda.data(), L));
  KVMEM_RETURN_IF_ERROR(rd.array("key_logit", key_logit.data(), L));
  KVMEM_RETURN_IF_ERROR(rd.finish());
  for (std::int64_t g = 0, e0 = 0; g < G; e0 += length[static_cast<std::size_t>(g)], ++g)
    for (std::int64_t e = e0; e < e0 + length[static_cast<std::size_t>(g)]; ++e) {
      const std::int64_t p = pos[static_cast<std::size_t>(e)];
      if (p < 0 || p >= position || (e > e0 && p <= pos[static_cast<std::size_t>(e - 1)]))
        return invalid_argument("slot record field 'pos'[" + std::to_string(e) + "]",
                                "ascending positions per kv head, each below 'position' = " + std::to_string(position),
                                p);
    }
  for (std::int64_t e = 0; e < L; ++e) {
    const float lam = lambda[static_cast<std::size_t>(e)];
    if (!std::isfinite(lam) || lam > 0.0f)
      return invalid_argument("slot record field 'lambda'[" + std::to_string(e) + "]", "a finite value <= 0", lam);
    if (!std::isfinite(key_logit[static_cast<std::size_t>(e)]))
      return invalid_argument("slot record field 'key_logit'[" + std::to_string(e) + "]", "a finite value",
                              key_logit[static_cast<std::size_t>(e)]);
  }
  for (std::size_t x = 0; x < key.size(); ++x)
    for (const auto* field : {&key, &value}) {
      const float v = (*field)[x];
      if (!std::isfinite(v))
        return invalid_argument(
            std::string("slot record field '") + (field == &key ? "key" : "value") + "'[" + std::to_string(x) + "]",
            "a finite value representable in the cache's storage type", v);
    }
  for (std::int64_t e = 0; e < L; ++e)
    for (const auto* field : {&key, &value}) {
      std::int64_t d = 0;
      if (!representable_row<Storage>(field->data() + e * D, D, d)) {
        const std::size_t x = static_cast<std::size_t>(e * D + d);
        return invalid_argument(
            std::string("slot record field '") + (field == &key ? "key" : "value") + "'[" + std::to_string(x) + "]",
            "a finite value representable in the cache's storage type", (*field)[x]);
      }
    }
  return Status::ok();
}

// The fields of a host cache's slot (with `rows` false, only the position and lengths).
template <class Storage>
UaSlotFields gather(const PrunedCache<Storage>& cache, std::int64_t slot, bool rows) {
  const std::int64_t G = cache.shape().kv_heads, D = cache.shape().head_dim;
  UaSlotFields f;
  f.position = cache.position(slot);
  for (std::int64_t g = 0; g < G; ++g) {
    const std::int64_t n = cache.length(slot, g);
    f.length.push_back(n);
    if (!rows) continue;
    // each accessor once: a paged list's rows are gathered per call (ua/cache.hpp)
    const std::int64_t* p = cache.positions(slot, g);
    f.pos.insert(f.pos.end(), p, p + n);
    const float* l = cache.lambda(slot, g);
    f.lambda.insert(f.lambda.end(), l, l + n);
    const float* z = cache.key_logits(slot, g);
    f.key_logit.insert(f.key_logit.end(), z, z + n);
    const Storage* k = cache.keys(slot, g);
    const float* ks = cache.key_scales(slot, g);
    for (std::int64_t e = 0; e < n * D; ++e) f.key.push_back(load_as<float>(k[e]) * (ks ? ks[e / D] : 1.0f));
    const Storage* v = cache.values(slot, g);
    const float* vs = cache.value_scales(slot, g);
    for (std::int64_t e = 0; e < n * D; ++e) f.value.push_back(load_as<float>(v[e]) * (vs ? vs[e / D] : 1.0f));
  }
  return f;
}

}  // namespace detail

// Bytes of the record of `slot` (0 for an empty cache or a slot outside it: export_slot refuses those).
template <class Storage>
std::size_t export_bytes(const PrunedCache<Storage>& cache, std::int32_t slot) {
  if (!detail::check_slot(cache, slot).is_ok()) return 0;
  return detail::write_record<Storage>(cache.shape(), detail::gather(cache, slot, false), {});
}

// Writes the record of `slot` (fields above) into the first export_bytes(cache, slot) bytes of `out`.
template <class Exec, class Storage>
Status export_slot(const Exec& /*exec*/, const PrunedCache<Storage>& cache, std::int32_t slot,
                   std::span<std::byte> out) {
  KVMEM_RETURN_IF_ERROR(detail::check_slot(cache, slot));
  const std::size_t bytes = export_bytes(cache, slot);
  if (out.size() < bytes)
    return {StatusCode::kOutOfRange,
            kvmem::detail::concat("export_slot out: expected at least ", bytes, " bytes, got ", out.size())};
  (void)detail::write_record<Storage>(cache.shape(), detail::gather(cache, slot, true), out.first(bytes));
  return Status::ok();
}

// Replaces the contents of `slot` with a record made by export_slot (any backend's). The record is read
// and checked whole before the slot changes: version, mechanism, shape (H, G, D, storage type), every
// length against this cache's capacity, positions ascending and below the position counter, λ finite
// and <= 0, keys and values finite and representable in the storage type. A mismatch is refused with a
// Status naming the field.
template <class Exec, class Storage>
Status import_slot(const Exec& /*exec*/, PrunedCache<Storage>& cache, std::int32_t slot,
                   std::span<const std::byte> in) {
  KVMEM_RETURN_IF_ERROR(detail::check_slot(cache, slot));
  const CacheShape& s = cache.shape();
  const std::int64_t G = s.kv_heads, D = s.head_dim;
  detail::UaSlotFields f;
  KVMEM_RETURN_IF_ERROR(detail::read_record<Storage>(s, in, f));
  const std::vector<std::int64_t>& length = f.length;
  {  // the pool must give the record's rows their pages once the slot's own pages are back
    std::int64_t need = 0, freed = 0;
    for (std::int64_t g = 0; g < G; ++g) {
      need += (length[static_cast<std::size_t>(g)] + s.page_rows - 1) / s.page_rows;
      freed += cache.pages(slot, g);
    }
    KVMEM_RETURN_IF_ERROR(detail::check_pool(cache, need, freed, "import_slot"));
  }
  // Commit.
  for (std::int64_t g = 0, e0 = 0; g < G; e0 += length[static_cast<std::size_t>(g)], ++g) {
    const std::int64_t n = length[static_cast<std::size_t>(g)], old = cache.length(slot, g);
    cache.release_rows(slot, g, 0);
    (void)cache.reserve_rows(slot, g, n);  // checked above
    auto v = cache.item_view(slot, g, -1);
    for (std::int64_t e = 0; e < n; ++e) {
      const auto src = static_cast<std::size_t>(e0 + e);
      const std::int64_t y = v.map(e);
      v.pos[y] = f.pos[src];
      v.lambda[y] = f.lambda[src];
      v.key_logit[y] = f.key_logit[src];
      const float* key = f.key.data() + src * static_cast<std::size_t>(D);
      const float* value = f.value.data() + src * static_cast<std::size_t>(D);
      if constexpr (is_row_scaled_v<Storage>) {
        v.key_scale[y] = quantize_row(key, v.keys + y * D, D);
        v.value_scale[y] = quantize_row(value, v.values + y * D, D);
      } else {
        for (std::int64_t d = 0; d < D; ++d) {
          v.keys[y * D + d] = store_as<Storage>(key[d]);
          v.values[y * D + d] = store_as<Storage>(value[d]);
        }
      }
    }
    cache.set_length(slot, g, n, old > n ? old : n);
  }
  cache.set_position(slot, f.position);
  cache.set_overflowed(slot, false);
  return Status::ok();
}

// ---- truncate ----------------------------------------------------------------------------------------
//
// Drops the last n tokens of `slot`. UA can do this exactly only in two cases, and refuses every other
// one with a Status that says why, never leaving a state that merely approximates the shorter sequence:
//  - n = 0: nothing changes;
//  - n = position(slot): the whole sequence goes, which is reset_slots of that slot.
// Why not 0 < n < position: every kept entry's λ_j = Σ_{m=j+1..t} A_jm holds one decay term per later
// token (spec UA.md 4.2), each depending on that token's key and query gate. Undoing the last n tokens
// means taking their terms out again. Subtracting them in fp32 does not restore the bits (rounding), and
// adding the remaining terms again from scratch needs the query-gate logits (never stored) and the keys
// of every later token, evicted ones included (gone for good, spec UA.md 4.5). And the entries that the
// dropped tokens' steps evicted cannot come back. So no exact shorter state can be rebuilt from the cache.
// An engine that needs rollback (speculative decoding) keeps a copy: copy_slots before the speculative
// tokens, and copy back (or reset) afterwards.
template <class Exec, class Storage>
Status truncate(const Exec& /*exec*/, PrunedCache<Storage>& cache, std::int32_t slot, std::int64_t n) {
  KVMEM_RETURN_IF_ERROR(detail::check_slot(cache, slot));
  const std::int64_t tokens = cache.position(slot);
  if (n < 0 || n > tokens)
    return {StatusCode::kOutOfRange,
            kvmem::detail::concat("truncate n: expected 0 <= n <= the slot's tokens = ", tokens, ", got ", n)};
  if (n == 0) return Status::ok();
  if (n == tokens) {
    cache.restart(slot);
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
