// SPDX-License-Identifier: Apache-2.0
#pragma once
// Universal Attention entry bodies shared by the host and Kokkos backends (spec UA.md 4.4, 4.5): append
// a new entry, and evict the entries of one (sequence, kv head) that the prune policy's cut removes
// (policy/prune.hpp; the paper's rule: λ strictly below ln p), compacting the survivors stably, so they
// stay in ascending position order (this fixes the summation order the goldens assume). Rows [kept, n)
// are free afterwards; the caller reports them for reclamation. (The CUDA backend evicts and compacts in
// its own kernels, backend/cuda/ua_kernels.cuh and ua_prune.cuh, with the same eviction test.)
//
// Backend-neutral: KVMEM_HOST_DEVICE, no allocation, no containers, no exceptions.

#include <cstdint>

#include "kvmem/core/config.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/kernel/ua_rows.hpp"
#include "kvmem/policy/prune.hpp"

namespace kvmem::kernel::ua {

// Spec UA.md 4.4 step 2: the new token's entry at `row`, with λ = Λ_tt = 0 and its absolute position.
// Row-scaled storage (fp8) stores each row with its scale (core/numeric.hpp quantize_row).
// keys, values: [.., D] rows D apart; lambda, key_logit, pos, key_scale, value_scale: [..]; key, value: [D]
template <class KS, class In>
KVMEM_HOST_DEVICE inline void append_entry(KS* keys, KS* values, float* lambda, float* key_logit, std::int64_t* pos,
                                           std::int64_t row, const In* key, const In* value, float z_k,
                                           std::int64_t position, std::int64_t D, float* key_scale = nullptr,
                                           float* value_scale = nullptr) {
  if constexpr (is_row_scaled_v<KS>) {
    key_scale[row] = quantize_row(key, keys + row * D, D);
    value_scale[row] = quantize_row(value, values + row * D, D);
  } else {
    for (std::int64_t d = 0; d < D; ++d) {
      keys[row * D + d] = store_as<KS>(load_as<float>(key[d]));
      values[row * D + d] = store_as<KS>(load_as<float>(value[d]));
    }
  }
  lambda[row] = 0.0f;
  key_logit[row] = z_k;
  pos[row] = position;
}

// The eviction rule of spec UA.md 4.5, in one place for every backend (host, Kokkos, CUDA): an entry
// goes iff λ < ln p, strictly, compared in double exactly as prune::Threshold::evicts does it. Strict
// matters at the boundary: with p = 1 (ln p = 0) a key that has not decayed (λ = 0, the new token
// included) stays (spec UA.md 4.6). log_p = -inf (p = 0) never evicts.
template <class Lambda>
KVMEM_HOST_DEVICE inline bool evicts(Lambda lambda, double log_p) {
  return static_cast<double>(lambda) < log_p;
}

// A prune rule's cut (policy/prune.hpp): what the threshold rule above evicts at cut.log_p goes; a
// ranked cut also evicts entries ordering below (cut.lambda, cut.pos), λ first, then position. A
// threshold cut decides exactly as evicts(lambda, log_p). Every backend's eviction test is this one.
template <class Lambda>
KVMEM_HOST_DEVICE inline bool evicts(Lambda lambda, std::int64_t pos, const prune::Cut& cut) {
  if (evicts(lambda, cut.log_p)) return true;
  const double l = static_cast<double>(lambda);
  return cut.ranked && (l < cut.lambda || (l == cut.lambda && pos < cut.pos));
}

// The entries of one item as a prune evictor reads them (entry e at row map(e)).
template <class Acc>
struct EntryList {
  RowMap map;
  const Acc* lambda_rows;
  const std::int64_t* pos_rows;
  std::int64_t n;
  KVMEM_HOST_DEVICE std::int64_t size() const { return n; }
  KVMEM_HOST_DEVICE double lambda(std::int64_t e) const { return static_cast<double>(lambda_rows[map(e)]); }
  KVMEM_HOST_DEVICE std::int64_t pos(std::int64_t e) const { return pos_rows[map(e)]; }
};

// Evicts with a prune evictor (policy/prune.hpp): its cut over the item's entries, then a stable
// compaction (the survivors move down to the lowest logical rows, in order, row-scaled storage with
// its scales). Returns the survivors.
template <class Evictor, class KS, class Acc>
KVMEM_HOST_DEVICE inline std::int64_t evict_by(const Evictor& evictor, const RowMap& map, KS* keys, KS* values,
                                               std::int64_t row_stride, Acc* lambda, Acc* key_logit, std::int64_t* pos,
                                               std::int64_t n, std::int64_t D, float* key_scale = nullptr,
                                               float* value_scale = nullptr) {
  const prune::Cut cut = evictor.cut(EntryList<Acc>{map, lambda, pos, n});
  std::int64_t kept = 0;
  for (std::int64_t e = 0; e < n; ++e) {
    const std::int64_t x = map(e);
    if (evicts(lambda[x], pos[x], cut)) continue;  // evicted for good
    if (kept != e) {
      const std::int64_t y = map(kept);
      for (std::int64_t d = 0; d < D; ++d) {
        keys[y * row_stride + d] = keys[x * row_stride + d];
        values[y * row_stride + d] = values[x * row_stride + d];
      }
      lambda[y] = lambda[x];
      key_logit[y] = key_logit[x];
      pos[y] = pos[x];
      if constexpr (is_row_scaled_v<KS>) {
        key_scale[y] = key_scale[x];
        value_scale[y] = value_scale[x];
      }
    }
    ++kept;
  }
  return kept;
}

}  // namespace kvmem::kernel::ua
