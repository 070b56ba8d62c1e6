// SPDX-License-Identifier: Apache-2.0
#pragma once
// Where the entries of one (sequence, kv head) live. Contiguous: entry e at row e. Paged (the page pool
// of ua::PrunedCache, DESIGN.md 3): the item's page table maps logical page e / page_rows to a physical
// page of the pool, and entries keep their order inside a page, so physical row =
// page_table[e / page_rows] * page_rows + e % page_rows. Rows per page are a power of two, so the map is
// a load, a shift and a mask. Every body that walks entries in order (attend, λ update, eviction) reads
// them through a RowMap and does the same arithmetic in the same order either way, so a paged cache
// gives the bits of a contiguous one.
//
// Backend-neutral: KVMEM_HOST_DEVICE, no allocation.

#include <cstdint>

#include "kvmem/core/config.hpp"

namespace kvmem::kernel::ua {

struct RowMap {
  const std::int32_t* pages = nullptr;  // [pages of the item]; nullptr = contiguous rows
  int shift = 0;                        // log2(rows per page)

  KVMEM_HOST_DEVICE std::int64_t operator()(std::int64_t e) const {
    if (pages == nullptr) return e;
    return (static_cast<std::int64_t>(pages[e >> shift]) << shift) | (e & ((std::int64_t(1) << shift) - 1));
  }
  // Entries [e, e + run(e, end)) are physically consecutive (the rest of e's page, at most end - e).
  KVMEM_HOST_DEVICE std::int64_t run(std::int64_t e, std::int64_t end) const {
    if (pages == nullptr) return end - e;
    const std::int64_t page_end = ((e >> shift) + 1) << shift;
    return (page_end < end ? page_end : end) - e;
  }
};

}  // namespace kvmem::kernel::ua
