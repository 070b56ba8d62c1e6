// SPDX-License-Identifier: Apache-2.0
#pragma once
// Universal Attention on the host backend: the ua/ operations run one (sequence, kv head) item per
// task through host::parallel_for; each item runs start to finish on one thread (its chunks and
// evictions are sequential, spec UA.md 4.5), so results do not depend on the thread count.
//
//   #include <kvmem/backend/host/ua.hpp>
//   kvmem::ua::PrunedCache<float> cache({B, H, G, D, capacity});
//   kvmem::ua::prefill(kvmem::host::Executor{}, cache, inputs, {.p = 0.05}, out);   // out [B,T,H,D]
//   kvmem::ua::decode(kvmem::host::Executor{}, cache, step, {.p = 0.05}, out1);     // out1 [B,1,H,D]
//   kvmem::ua::step(kvmem::host::Executor{}, cache, rows, packed, {.p = 0.05}, out, lse);  // slots, [tokens,H,D]
//
// Caller-owned memory (docs/memory.md): PrunedCache::place over ua::cache_layout(shape).bytes, then
// attach_workspace over ua::workspace_bytes(shape, limits).

#include <cstdint>
#include <utility>

#include "kvmem/backend/host/executor.hpp"
#include "kvmem/ua/cache.hpp"
#include "kvmem/ua/ops.hpp"

namespace kvmem::ua {

template <>
struct Backend<host::Executor> {
  template <class S>
  using cache_type = PrunedCache<S>;
};

template <>
struct Launcher<host::Executor> {
  // Below about this many multiply-adds a call runs on the calling thread: waking the pool's threads
  // costs more than the work (a decode step over a pruned cache is a few microseconds).
  static constexpr std::int64_t kInlineWork = std::int64_t(1) << 18;

  template <class Body>
  static void for_each(const host::Executor& exec, std::int64_t items, std::int64_t work, Body&& body) {
    if (work < kInlineWork) {
      for (std::int64_t i = 0; i < items; ++i) body(i);
      return;
    }
    host::parallel_for(exec, items, std::forward<Body>(body));
  }
};

}  // namespace kvmem::ua
