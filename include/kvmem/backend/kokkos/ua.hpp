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
// One team per (sequence, kv head) item runs the item's chunks, evictions and compaction in order
// (spec UA.md 4.5: every chunk's eviction depends on the previous one). Inside an item the team's
// threads share the work: the chunk's rows are appended one per thread, each block is attended by
// team_attend_block (entries over the threads for the decay and bias tiles and λ, (head, row) pairs for
// the online softmax, with the shared bodies of kernel/ua_*.hpp, bitwise equal to the host on host
// spaces, docs/kokkos.md), decode's λ update runs one entry per thread, and the in-order eviction scan
// runs on one thread. The block
// workspace (accumulators, running max/sum, decay and bias tiles) lives in team scratch: level 0 when it
// fits the ~40 KB CUDA cap (DESIGN.md 4), else level 1. Lengths, positions and counters are read inside
// the kernels. Only with exec.checked does one reduction check finiteness and capacity first and its
// result is read back (validation before any change, DESIGN.md 3).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <Kokkos_Core.hpp>

#include "kvmem/backend/kokkos/device_view.hpp"
#include "kvmem/backend/kokkos/executor.hpp"
#include "kvmem/backend/kokkos/slot_lists.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/slots.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"
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

// The inputs of one call as kernel-indexable views (ua::Inputs, float).
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

  // BlockArgs for query tokens [t0, t1) of item (b, g) (as ua::detail::block_args on the host).
  template <class KS>
  KOKKOS_INLINE_FUNCTION kernel::ua::BlockArgs<KS, float, float, float> block(std::int64_t b, std::int64_t g,
                                                                              std::int64_t r, std::int64_t t0,
                                                                              std::int64_t t1) const {
    kernel::ua::BlockArgs<KS, float, float, float> a;
    a.D = q.extent[3];
    a.heads = r;
    a.rows = t1 - t0;
    a.new_keys = &k(b, g, t0, 0);
    a.new_key_stride = k.stride[2];
    a.query_logit = &z_q(b, g, t0);
    a.query_logit_stride = z_q.stride[2];
    a.q = &q(b, g * r, t0, 0);
    a.q_head_stride = q.stride[1];
    a.q_row_stride = q.stride[2];
    if (z_o.data != nullptr) {
      a.z_o = &z_o(b, t0, g * r, 0);
      a.z_o_row_stride = z_o.stride[1];
      a.z_o_head_stride = z_o.stride[2];
    }
    a.out = &out(b, t0, g * r, 0);
    a.out_row_stride = out.stride[1];
    a.out_head_stride = out.stride[2];
    return a;
  }
};

// kernel::ua::attend_block run by a whole team: per query tile, the tile's (head, row) accumulators are
// reset over the threads; per key tile, the entries are spread over the threads (decay row, bias column
// and the entry's λ move to the tile's last row: each entry's values depend on that entry only), then
// the (head, row) pairs (each its own online softmax over the tile, logits in thread-local memory);
// finally the (head, row) pairs are normalised and written. Every value is computed by the same
// expressions in the same order as the one-thread body (kernel/ua_attend.hpp, kernel/ua_decay.hpp), so
// results are bitwise equal to it. Workspace layout as block_workspace_elems (the logits row unused).
template <class Set, class Member, class KS, class QS, class OS>
KOKKOS_INLINE_FUNCTION void team_attend_block(const Member& team, const kernel::ua::BlockArgs<KS, QS, OS, float>& a) {
  using Acc = float;
  using kernel::ua::kKeyTile;
  using kernel::ua::kQueryTile;
  const std::int64_t D = a.D, H = a.heads;
  Acc* acc = a.workspace;                                     // [heads, kQueryTile, D]
  Acc* row_max = acc + H * kQueryTile * D;                    // [heads, kQueryTile]
  Acc* row_sum = row_max + H * kQueryTile;                    // [heads, kQueryTile]
  Acc* decay = row_sum + H * kQueryTile;                      // [kKeyTile, kQueryTile]
  Acc* bias = decay + kKeyTile * kQueryTile;                  // [kQueryTile, kKeyTile]
  Acc* query_part = bias + kKeyTile * kQueryTile + kKeyTile;  // [kQueryTile] (after the unused logits row)

  for (std::int64_t r0 = 0; r0 < a.rows; r0 += kQueryTile) {
    const std::int64_t nr = (a.rows - r0) < kQueryTile ? (a.rows - r0) : kQueryTile;
    const std::int64_t m0 = a.first + r0, m_last = m0 + nr - 1;
    const std::int64_t through = a.through > m0 - 1 ? a.through : m0 - 1;  // λ holds Λ_{through, .}
    const std::int64_t skip = through + 1 > m0 ? through + 1 - m0 : 0;     // rows already in λ (decode)
    const std::int64_t fresh = nr > skip ? nr - skip : 0;                  // rows whose decay is new
    const QS* new_keys = a.new_keys + (r0 + skip) * a.new_key_stride;
    const QS* query_logit = a.query_logit + (r0 + skip) * a.query_logit_stride;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, H * kQueryTile), [&](const std::int64_t x) {
      const std::int64_t i = x % kQueryTile;
      if (i < nr)
        for (std::int64_t d = 0; d < D; ++d) acc[x * D + d] = Acc(0);
      row_max[x] = negative_infinity<Acc>();
      row_sum[x] = Acc(0);
      if (x < fresh) query_part[x] = kernel::ua::query_gate_part(load_as<Acc>(query_logit[x * a.query_logit_stride]));
    });
    team.team_barrier();

    for (std::int64_t e0 = 0; e0 < a.n && a.pos[a.map(e0)] <= m_last; e0 += kKeyTile) {
      std::int64_t ne = (a.n - e0) < kKeyTile ? (a.n - e0) : kKeyTile;
      while (ne > 0 && a.pos[a.map(e0 + ne - 1)] > m_last) --ne;  // entries beyond the tile are all masked

      // Entry e: its decay row A_{e, m} (kernel::ua::decay_tile), its bias column Λ_{m, pos_e} and λ_e.
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, ne), [&](const std::int64_t e) {
        const std::int64_t x = a.map(e0 + e), p = a.pos[x];
        Acc* row = decay + e * kQueryTile;
        if (fresh > 0) {
          const KS* key = a.keys + x * a.key_stride;
          const Acc key_part = kernel::ua::key_gate_part(a.key_logit[x]);
          for (std::int64_t i = 0; i < fresh; ++i) {
            const std::int64_t m = m0 + skip + i;
            row[i] = m > p ? kernel::ua::pair_decay<Set, Acc>(
                                 key, a.key_logit[x], key_part, p, new_keys + i * a.new_key_stride,
                                 load_as<Acc>(query_logit[i * a.query_logit_stride]), query_part[i], m, D)
                           : Acc(0);
          }
        }
        Acc lam = a.lambda[x];
        for (std::int64_t i = 0; i < skip && i < nr; ++i)
          bias[i * kKeyTile + e] = (m0 + i < p) ? negative_infinity<Acc>() : lam;
        if (fresh > 0) {
          lam = kernel::ua::cumulative_decay(lam, p, m0 + skip, row, fresh, bias + skip * kKeyTile + e, kKeyTile);
          if (p <= m_last) a.lambda[x] = lam;  // Λ_{m_last, p}
        }
      });
      team.team_barrier();

      // (head h, row i): online softmax over this key tile; the r heads share the bias tile.
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, H * nr), [&](const std::int64_t hx) {
        const std::int64_t h = hx / nr, i = hx % nr;
        Acc logits[kKeyTile];
        const QS* qrow = a.q + h * a.q_head_stride + (r0 + i) * a.q_row_stride;
        const Acc* brow = bias + i * kKeyTile;
        Acc block_max = negative_infinity<Acc>();
        for (std::int64_t e = 0; e < ne; ++e) {
          const KS* krow = a.keys + a.map(e0 + e) * a.key_stride;
          logits[e] = brow[e] == negative_infinity<Acc>() ? negative_infinity<Acc>()
                                                          : kernel::ua::dot8<Acc>(qrow, krow, D) + brow[e];  // scale 1
          if (logits[e] > block_max) block_max = logits[e];
        }
        if (block_max == negative_infinity<Acc>()) return;
        OnlineSoftmax<Acc> sm;
        sm.max = row_max[h * kQueryTile + i];
        sm.sum = row_sum[h * kQueryTile + i];
        Acc* arow = acc + (h * kQueryTile + i) * D;
        const Acc rescale = sm.raise_max(block_max);
        if (rescale != Acc(1))
          for (std::int64_t d = 0; d < D; ++d) arow[d] *= rescale;
        for (std::int64_t e = 0; e < ne; ++e) {
          const Acc w = sm.accumulate(logits[e]);
          if (w == Acc(0)) continue;
          const KS* vrow = a.values + a.map(e0 + e) * a.value_stride;
          for (std::int64_t d = 0; d < D; ++d) arow[d] += w * load_as<Acc>(vrow[d]);
        }
        row_max[h * kQueryTile + i] = sm.max;
        row_sum[h * kQueryTile + i] = sm.sum;
      });
      team.team_barrier();
    }

    // Normalise, apply the optional output gate, write out and lse: one (head, row) per thread.
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, H * nr), [&](const std::int64_t hx) {
      kernel::ua::finish_row(a, acc, row_max, row_sum, r0, hx / nr, hx % nr);
    });
    team.team_barrier();
  }
}

// Row pointers of one (sequence, kv head) item of a UaCache.
template <class Storage>
struct UaItem {
  Storage* keys;
  Storage* values;
  float* lambda;
  float* key_logit;
  std::int64_t* pos;

  // The block arguments `a` of the kernel bodies, pointed at this item's n kept entries (rows of D).
  KOKKOS_INLINE_FUNCTION kernel::ua::BlockArgs<Storage, float, float, float> block(
      kernel::ua::BlockArgs<Storage, float, float, float> a, std::int64_t n, std::int64_t D, float* workspace) const {
    a.keys = keys;
    a.values = values;
    a.key_stride = a.value_stride = D;
    a.lambda = lambda;
    a.key_logit = key_logit;
    a.pos = pos;
    a.n = n;
    a.workspace = workspace;
    return a;
  }
  // Evicts the entries the prune evictor's cut removes (spec UA.md 4.5; policy/prune.hpp) and compacts
  // the rest; returns the kept count.
  template <class Ev>
  KOKKOS_INLINE_FUNCTION std::int64_t evict(std::int64_t n, std::int64_t D, const Ev& ev) const {
    return kernel::ua::evict_by(ev, kernel::ua::RowMap{}, keys, values, D, lambda, key_logit, pos, n, D);
  }
  // evict() on one thread of the team (the cut and the compaction are in-order scans) when `prune` (the
  // evictor can evict, decided on the host); the kept count on every thread after a team barrier.
  // ua::detail::NoEvictor (prune::None) compiles no eviction.
  template <class Member, class Ev>
  KOKKOS_INLINE_FUNCTION std::int64_t team_evict(const Member& team, std::int64_t n, std::int64_t D, const Ev& ev,
                                                 bool prune) const {
    std::int64_t kept = n;
    Kokkos::single(
        Kokkos::PerTeam(team),
        [&](std::int64_t& k) {
          if constexpr (ua::detail::kEvicts<Ev>)
            k = prune ? evict(n, D, ev) : n;
          else
            k = n;
        },
        kept);
    team.team_barrier();  // the compacted rows are visible to every thread
    return kept;
  }
  // Decode step 1 (spec UA.md 4.4): λ_e += A(e, t) of kernel::ua::lambda_update, entries over the team.
  template <class Set, class Member, class In>
  KOKKOS_INLINE_FUNCTION void team_lambda_update(const Member& team, std::int64_t n, std::int64_t D, const In* new_key,
                                                 float query_logit, std::int64_t t) const {
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, n), [&](const std::int64_t e) {
      kernel::ua::lambda_update<Set, float>(keys + e * D, D, key_logit + e, pos + e, lambda + e, 1, new_key,
                                            query_logit, t, D);
    });
    team.team_barrier();
  }
};

// The team's chunked prefill of one item (spec UA.md 4.5, as ua::detail::prefill_item): `tokens` tokens
// from position `first`; each chunk's rows appended over the threads by append(at, t, position), its
// block (block_of(t0, t1): the block arguments of those tokens' queries) attended by team_attend_block,
// then eviction on one thread. n: the item's kept count, in and out; returns the peak count.
template <class Set, class Member, class Storage, class Ev, class Append, class BlockOf>
KOKKOS_INLINE_FUNCTION std::int64_t team_prefill(const Member& team, const UaItem<Storage>& it, std::int64_t& n,
                                                 std::int64_t first, std::int64_t tokens, std::int64_t chunk,
                                                 std::int64_t D, const Ev& ev, bool prune, float* workspace,
                                                 const Append& append, const BlockOf& block_of) {
  std::int64_t top = n;
  for (std::int64_t t0 = 0; t0 < tokens; t0 += chunk) {
    const std::int64_t t1 = t0 + chunk < tokens ? t0 + chunk : tokens;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, t1 - t0),
                         [&](const std::int64_t x) { append(n + x, t0 + x, first + t0 + x); });
    team.team_barrier();
    n += t1 - t0;
    top = n > top ? n : top;
    auto a = it.block(block_of(t0, t1), n, D, workspace);
    a.through = first + t0 - 1;  // survivors hold Λ_{first+t0-1}; the chunk keys hold 0
    a.first = first + t0;
    team_attend_block<Set>(team, a);
    n = it.team_evict(team, n, D, ev, prune);
  }
  return top;
}

// The team's decode step of one item at position t (spec UA.md 4.4, 4.5, as ua::detail::decode_item):
// λ_j += A_jt from the new key and query logit, the token appended by append(at, 0, t) with λ = 0,
// eviction before or after attending `block` (the token's query). n: the kept count, in and out;
// returns the peak count.
template <class Set, class Member, class Storage, class Ev, class In, class Append, class Block>
KOKKOS_INLINE_FUNCTION std::int64_t team_decode(const Member& team, const UaItem<Storage>& it, std::int64_t& n,
                                                std::int64_t t, std::int64_t D, const Ev& ev, bool prune,
                                                bool evict_before_attention, float* workspace, const In* new_key,
                                                float query_logit, const Append& append, const Block& block) {
  it.template team_lambda_update<Set>(team, n, D, new_key, query_logit, t);  // 1. λ_j += A_jt
  Kokkos::single(Kokkos::PerTeam(team), [&]() { append(n, 0, t); });         // 2. append t, λ = 0
  team.team_barrier();
  ++n;
  const std::int64_t top = n;
  if (evict_before_attention) n = it.team_evict(team, n, D, ev, prune);  // 3. evict, 4. attend
  auto a = it.block(block, n, D, workspace);
  a.through = t;  // λ already includes A_{., t}
  a.first = t;
  team_attend_block<Set>(team, a);
  if (!evict_before_attention) n = it.team_evict(team, n, D, ev, prune);  // (or evict last)
  return top;
}

// Ev: the prune policy's evictor (policy/prune.hpp), or ua::detail::NoEvictor (prune::None: no eviction
// is compiled).
template <class Set, class Storage, class MemSpace, class Ev>
struct UaCacheCall {
  UaViews in;
  Storage* keys;          // [B*G*capacity, D]
  Storage* values;        // [B*G*capacity, D]
  float* lambda;          // [B*G*capacity]
  float* key_logit;       // [B*G*capacity]
  std::int64_t* pos;      // [B*G*capacity]
  std::int64_t* length;   // [B*G]
  std::int64_t* peak;     // [B*G]
  std::int64_t* counter;  // [B]
  std::int64_t G, r, D, T, capacity, chunk, ws_elems;
  Ev ev;
  bool prune;  // whether the evictor can evict (prune::active, decided on the host)
  bool decode, evict_before_attention;

  KOKKOS_INLINE_FUNCTION UaItem<Storage> item(std::int64_t i) const {
    const std::int64_t row0 = i * capacity;
    return {keys + row0 * D, values + row0 * D, lambda + row0, key_logit + row0, pos + row0};
  }

  KOKKOS_INLINE_FUNCTION void append_row(const UaItem<Storage>& it, std::int64_t row, std::int64_t b, std::int64_t g,
                                         std::int64_t t, std::int64_t position) const {
    kernel::ua::append_entry(it.keys, it.values, it.lambda, it.key_logit, it.pos, row, &in.k(b, g, t, 0),
                             &in.v(b, g, t, 0), in.z_k(b, g, t), position, D);
  }

  // Chunked prefill of one item (spec UA.md 4.5), as ua::detail::prefill_item, by the team: the chunk's
  // rows appended over the threads, the block attended by team_attend_block, eviction on one thread.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void prefill_item(const Member& team, std::int64_t i, float* workspace) const {
    const std::int64_t b = i / G, g = i % G;
    const UaItem<Storage> it = item(i);
    std::int64_t n = length[i];
    const std::int64_t top = team_prefill<Set>(
        team, it, n, counter[b], T, chunk, D, ev, prune, workspace,
        [&](std::int64_t at, std::int64_t t, std::int64_t position) { append_row(it, at, b, g, t, position); },
        [&](std::int64_t t0, std::int64_t t1) { return in.block<Storage>(b, g, r, t0, t1); });
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      length[i] = n;
      peak[i] = top;
    });
  }

  // One decode step of one item (spec UA.md 4.4, 4.5), as ua::detail::decode_item, by the team.
  template <class Member>
  KOKKOS_INLINE_FUNCTION void decode_item(const Member& team, std::int64_t i, float* workspace) const {
    const std::int64_t b = i / G, g = i % G;
    const UaItem<Storage> it = item(i);
    std::int64_t n = length[i];
    const std::int64_t top = team_decode<Set>(
        team, it, n, counter[b], D, ev, prune, evict_before_attention, workspace, &in.k(b, g, 0, 0), in.z_q(b, g, 0),
        [&](std::int64_t at, std::int64_t t, std::int64_t position) { append_row(it, at, b, g, t, position); },
        in.block<Storage>(b, g, r, 0, 1));
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      length[i] = n;
      peak[i] = top;
    });
  }

  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(const Member& team) const {
    const std::int64_t i = team.league_rank();
    // Unchecked calls skip an item without room for T more rows (it stays as it was).
    if (length[i] + T > capacity) return;
    float* workspace = static_cast<float*>(team.team_scratch(ws_level()).get_shmem(scratch_bytes()));
    if (decode)
      decode_item(team, i, workspace);
    else
      prefill_item(team, i, workspace);
  }

  KOKKOS_INLINE_FUNCTION std::size_t scratch_bytes() const {
    return static_cast<std::size_t>(ws_elems) * sizeof(float);
  }
  KOKKOS_INLINE_FUNCTION int ws_level() const {
    return static_cast<std::size_t>(ws_elems) * sizeof(float) <= kScratch0Bytes ? 0 : 1;
  }
};

// Finiteness of one call's inputs and (for cache calls) room for T rows. The reduction keeps the
// largest failure code (Kokkos::Max): 1 q, 2 k, 3 v, 4 z_k, 5 z_q, 6 z_o, 7 capacity.
template <class Space>
Status ua_check(const Executor<Space>& exec, const UaViews& in, std::int64_t B, std::int64_t G, std::int64_t H,
                std::int64_t T, std::int64_t D, const std::int64_t* length, std::int64_t capacity) {
  std::int64_t found = 0;
  const bool has_z_o = in.z_o.data != nullptr;
  Kokkos::parallel_reduce(
      "kvmem::kokkos::ua::check", Kokkos::RangePolicy<Space>(exec.space, 0, B * G),
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
  const std::int64_t r = s.query_heads / s.kv_heads;
  bool can_evict = false;
  if constexpr (ua::detail::kEvicts<Ev>) can_evict = prune::active(ev);
  const UaCacheCall<Set, Storage, MemSpace, Ev> call{views,
                                                     cache.keys.data(),
                                                     cache.values.data(),
                                                     cache.lambda.data(),
                                                     cache.key_logit.data(),
                                                     cache.pos.data(),
                                                     cache.length.data(),
                                                     cache.peak.data(),
                                                     cache.counter.data(),
                                                     s.kv_heads,
                                                     r,
                                                     s.head_dim,
                                                     T,
                                                     s.capacity,
                                                     opt.prefill_chunk,
                                                     kernel::ua::block_workspace_elems(r, s.head_dim),
                                                     ev,
                                                     can_evict,
                                                     decode,
                                                     opt.evict_before_attention};
  auto policy = team_policy(exec, s.batch * s.kv_heads);
  policy.set_scratch_size(call.ws_level(), Kokkos::PerTeam(call.scratch_bytes()));
  Kokkos::parallel_for(decode ? "kvmem::kokkos::ua::decode" : "kvmem::kokkos::ua::prefill", policy, call);
  std::int64_t* counter = cache.counter.data();
  Kokkos::parallel_for(
      "kvmem::kokkos::ua::advance", Kokkos::RangePolicy<Space>(exec.space, 0, s.batch),
      KOKKOS_LAMBDA(const std::int64_t b) { counter[b] += T; });
  return Status::ok();
}

// Dense UA over T tokens without a cache (ua::forward): one team per (sequence, kv head) runs one
// block over every position; λ, key logits and positions are per-call buffers (not a hot path).
template <class Set>
struct UaForwardCall {
  UaViews in;
  DeviceView<float, 3> lse;          // [B,H,T] (data == nullptr: not wanted)
  DeviceView<float, 3> lambda_last;  // [B,G,T] (data == nullptr: not wanted)
  float* lambda;                     // [B*G, T]
  float* key_logit;                  // [B*G, T]
  std::int64_t* pos;                 // [B*G, T]
  std::int64_t G, r, D, T, ws_elems;

  KOKKOS_INLINE_FUNCTION std::size_t scratch_bytes() const {
    return static_cast<std::size_t>(ws_elems) * sizeof(float);
  }
  KOKKOS_INLINE_FUNCTION int ws_level() const {
    return static_cast<std::size_t>(ws_elems) * sizeof(float) <= kScratch0Bytes ? 0 : 1;
  }

  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(const Member& team) const {
    const std::int64_t i = team.league_rank();
    const std::int64_t b = i / G, g = i % G;
    float* workspace = static_cast<float*>(team.team_scratch(ws_level()).get_shmem(scratch_bytes()));
    float* lam = lambda + i * T;
    float* zk = key_logit + i * T;
    std::int64_t* p = pos + i * T;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, T), [&](const std::int64_t t) {
      lam[t] = 0.0f;
      zk[t] = in.z_k(b, g, t);
      p[t] = t;
    });
    team.team_barrier();
    {
      auto a = in.block<float>(b, g, r, 0, T);
      a.keys = &in.k(b, g, 0, 0);
      a.values = &in.v(b, g, 0, 0);
      a.key_stride = in.k.stride[2];
      a.value_stride = in.v.stride[2];
      a.lambda = lam;
      a.key_logit = zk;
      a.pos = p;
      a.n = T;
      a.through = -1;
      a.first = 0;
      a.workspace = workspace;
      if (lse.data != nullptr) {  // [B,H,T]: the block's heads g*r.. write their rows in place
        a.lse = &lse(b, g * r, 0);
        a.lse_head_stride = lse.stride[1];
        a.lse_row_stride = lse.stride[2];
      }
      team_attend_block<Set>(team, a);
    }
    if (lambda_last.data != nullptr)
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, T),
                           [&](const std::int64_t t) { lambda_last(b, g, t) = lam[t]; });  // Λ_{T-1, t}
  }
};

// ---- the slot step (ua::step on a UaCache) ----------------------------------------------------------

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

  // BlockArgs for tokens [t0, t1) of the row starting at packed token x0, kv head g (as the host's
  // ua::detail::item_io + block_args of a packed call: same pointers, same strides).
  template <class KS>
  KOKKOS_INLINE_FUNCTION kernel::ua::BlockArgs<KS, float, float, float> block(std::int64_t x0, std::int64_t g,
                                                                              std::int64_t r, std::int64_t t0,
                                                                              std::int64_t t1) const {
    kernel::ua::BlockArgs<KS, float, float, float> a;
    a.D = q.extent[2];
    a.heads = r;
    a.rows = t1 - t0;
    a.new_keys = &k(x0 + t0, g, 0);
    a.new_key_stride = k.stride[0];
    a.query_logit = &z_q(x0 + t0, g);
    a.query_logit_stride = z_q.stride[0];
    a.q = &q(x0 + t0, g * r, 0);
    a.q_head_stride = q.stride[1];
    a.q_row_stride = q.stride[0];
    if (z_o.data != nullptr) {
      a.z_o = &z_o(x0 + t0, g * r, 0);
      a.z_o_row_stride = z_o.stride[0];
      a.z_o_head_stride = z_o.stride[1];
    }
    a.out = &out(x0 + t0, g * r, 0);
    a.out_row_stride = out.stride[0];
    a.out_head_stride = out.stride[1];
    if (lse.data != nullptr) {
      a.lse = &lse(x0 + t0, g * r);
      a.lse_head_stride = lse.stride[1];
      a.lse_row_stride = lse.stride[0];
    }
    return a;
  }
};

// One row of a step as the kernels see it: its slot (-1 padding), first packed token and token count.
struct UaRow {
  std::int64_t slot = -1, x0 = 0, T = 0;
  bool first = false;  // no earlier row names this slot (a later one is skipped: two rows would race)
  bool fits = false;   // sizes in range: starts within the tokens, slot within the cache, tokens within max_len
};

template <class Set, class Storage, class Ev>
struct UaStepCall {
  UaPackedViews in;
  Storage* keys;          // [B*G*capacity, D]
  Storage* values;        // [B*G*capacity, D]
  float* lambda;          // [B*G*capacity]
  float* key_logit;       // [B*G*capacity]
  std::int64_t* pos;      // [B*G*capacity]
  std::int64_t* length;   // [B*G]
  std::int64_t* peak;     // [B*G]
  std::int64_t* counter;  // [B]
  std::int64_t* admit;    // [B]
  std::int64_t B, G, r, D, capacity, chunk, ws_elems;
  Ev ev;       // the prune evictor, or ua::detail::NoEvictor
  bool prune;  // whether the evictor can evict, decided on the host
  bool evict_before_attention;

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
  KOKKOS_INLINE_FUNCTION bool room(const UaRow& w) const {
    for (std::int64_t g = 0; g < G; ++g)
      if (length[w.slot * G + g] + w.T > capacity) return false;
    return true;
  }
  KOKKOS_INLINE_FUNCTION bool runs(const UaRow& w) const {
    return w.slot >= 0 && w.fits && w.first && w.T > 0 && admit[w.slot] != 0;
  }

  KOKKOS_INLINE_FUNCTION UaItem<Storage> item(std::int64_t i) const {
    const std::int64_t row0 = i * capacity;
    return {keys + row0 * D, values + row0 * D, lambda + row0, key_logit + row0, pos + row0};
  }
  KOKKOS_INLINE_FUNCTION void append_row(const UaItem<Storage>& it, std::int64_t at, const UaRow& w, std::int64_t g,
                                         std::int64_t t, std::int64_t position) const {
    kernel::ua::append_entry(it.keys, it.values, it.lambda, it.key_logit, it.pos, at, &in.k(w.x0 + t, g, 0),
                             &in.v(w.x0 + t, g, 0), in.z_k(w.x0 + t, g), position, D);
  }

  // A row of more than one token: chunked prefill continuing the slot (as ua::detail::prefill_item).
  template <class Member>
  KOKKOS_INLINE_FUNCTION void prefill_item(const Member& team, const UaRow& w, std::int64_t g, float* workspace) const {
    const std::int64_t i = w.slot * G + g;
    const UaItem<Storage> it = item(i);
    std::int64_t n = length[i];
    const std::int64_t top = team_prefill<Set>(
        team, it, n, counter[w.slot], w.T, chunk, D, ev, prune, workspace,
        [&](std::int64_t at, std::int64_t t, std::int64_t position) { append_row(it, at, w, g, t, position); },
        [&](std::int64_t t0, std::int64_t t1) { return in.block<Storage>(w.x0, g, r, t0, t1); });
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      length[i] = n;
      peak[i] = top;
    });
  }
  // A one-token row: one decode step (as ua::detail::decode_item, spec UA.md 4.4, 4.5).
  template <class Member>
  KOKKOS_INLINE_FUNCTION void decode_item(const Member& team, const UaRow& w, std::int64_t g, float* workspace) const {
    const std::int64_t i = w.slot * G + g;
    const UaItem<Storage> it = item(i);
    std::int64_t n = length[i];
    const std::int64_t top = team_decode<Set>(
        team, it, n, counter[w.slot], D, ev, prune, evict_before_attention, workspace, &in.k(w.x0, g, 0),
        in.z_q(w.x0, g),
        [&](std::int64_t at, std::int64_t t, std::int64_t position) { append_row(it, at, w, g, t, position); },
        in.block<Storage>(w.x0, g, r, 0, 1));
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      length[i] = n;
      peak[i] = top;
    });
  }

  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(const Member& team) const {
    const std::int64_t g = team.league_rank() % G;
    const UaRow w = row(team.league_rank() / G);
    if (w.slot == -1) {  // padding: inputs unread, this kv group's output (and lse) rows zeroed
      if (!w.fits) return;
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, w.T * r * D), [&](const std::int64_t x) {
        const std::int64_t t = w.x0 + x / (r * D), h = g * r + (x / D) % r, d = x % D;
        in.out(t, h, d) = 0.0f;
        if (d == 0 && in.lse.data != nullptr) in.lse(t, h) = 0.0f;
      });
      return;
    }
    if (!runs(w)) return;
    float* workspace = static_cast<float*>(team.team_scratch(ws_level()).get_shmem(scratch_bytes()));
    if (w.T == 1)
      decode_item(team, w, g, workspace);
    else
      prefill_item(team, w, g, workspace);
  }

  KOKKOS_INLINE_FUNCTION std::size_t scratch_bytes() const {
    return static_cast<std::size_t>(ws_elems) * sizeof(float);
  }
  KOKKOS_INLINE_FUNCTION int ws_level() const {
    return static_cast<std::size_t>(ws_elems) * sizeof(float) <= kScratch0Bytes ? 0 : 1;
  }
};

// The checked reduction of a step over rows: the smallest code * rows + row, or kNoFailure.
enum class UaStepCheck : std::int64_t { kStart = 1, kSlot, kDuplicate, kBound, kCapacity, kQ, kK, kV, kZk, kZq, kZo };

template <class Space, class Set, class Storage, class Ev>
Status ua_step_check(const Executor<Space>& exec, const UaStepCall<Set, Storage, Ev>& call, std::int64_t R,
                     std::int64_t tokens, std::int64_t H) {
  std::int64_t found = kNoFailure;
  const bool has_z_o = call.in.z_o.data != nullptr;
  Kokkos::parallel_reduce(
      "kvmem::kokkos::ua::step_check", Kokkos::RangePolicy<Space>(exec.space, 0, R),
      KOKKOS_LAMBDA(const std::int64_t x, std::int64_t& first) {
        auto fail = [&](UaStepCheck code) {
          const std::int64_t c = static_cast<std::int64_t>(code) * R + x;
          if (c < first) first = c;
        };
        const UaRow w = call.row(x);
        const std::int64_t x1 = w.x0 + w.T;
        if ((x == 0 && w.x0 != 0) || w.T < 0 || (x == R - 1 && x1 != tokens)) return fail(UaStepCheck::kStart);
        if (w.slot < -1 || w.slot >= call.B) return fail(UaStepCheck::kSlot);
        if (!w.first) return fail(UaStepCheck::kDuplicate);
        if (w.slot >= 0 && call.in.max_len > 0 && w.T > call.in.max_len) return fail(UaStepCheck::kBound);
        if (w.x0 < 0 || x1 > tokens) return;  // another row's start is wrong and reported there
        if (w.slot >= 0 && !call.room(w)) fail(UaStepCheck::kCapacity);
        const std::int64_t D = call.D, G = call.G;
        for (std::int64_t t = w.x0; t < x1; ++t) {  // every token, padding included (as the host step)
          for (std::int64_t h = 0; h < H; ++h)
            for (std::int64_t d = 0; d < D; ++d) {
              if (!finite(call.in.q(t, h, d))) fail(UaStepCheck::kQ);
              if (has_z_o && !finite(call.in.z_o(t, h, d))) fail(UaStepCheck::kZo);
            }
          for (std::int64_t g = 0; g < G; ++g) {
            for (std::int64_t d = 0; d < D; ++d) {
              if (!finite(call.in.k(t, g, d))) fail(UaStepCheck::kK);
              if (!finite(call.in.v(t, g, d))) fail(UaStepCheck::kV);
            }
            if (!finite(call.in.z_k(t, g))) fail(UaStepCheck::kZk);
            if (!finite(call.in.z_q(t, g))) fail(UaStepCheck::kZq);
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
                                                             "max_slots = ", call.B, ", got a value outside")};
    case UaStepCheck::kDuplicate:
      return invalid_argument(kvmem::detail::indexed("slot", x), "a slot used by no earlier row of this step",
                              "a slot an earlier row names");
    case UaStepCheck::kBound:
      return invalid_argument("max_query_len",
                              kvmem::detail::concat("at least the tokens of every row that names a slot (row ", x,
                                                    ": more, read on the device)"),
                              call.in.max_len);
    case UaStepCheck::kCapacity:
      return {StatusCode::kOutOfRange,
              kvmem::detail::concat("cache capacity: row ", x, " needs room for its tokens in every kv head of its ",
                                    "slot (kept + new tokens), over capacity ", call.capacity)};
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
  using Mem = typename Space::memory_space;
  const auto items = static_cast<std::size_t>(B * G), n = static_cast<std::size_t>(T);
  Kokkos::View<float*, Mem> lambda(Kokkos::view_alloc(exec.space, "kvmem ua forward lambda"), items * n);
  Kokkos::View<float*, Mem> key_logit(Kokkos::view_alloc(exec.space, "kvmem ua forward key logit"), items * n);
  Kokkos::View<std::int64_t*, Mem> pos(Kokkos::view_alloc(exec.space, "kvmem ua forward positions"), items * n);
  kokkos::detail::UaForwardCall<Set> call{views,
                                          {},
                                          {},
                                          lambda.data(),
                                          key_logit.data(),
                                          pos.data(),
                                          G,
                                          H / G,
                                          D,
                                          T,
                                          kernel::ua::block_workspace_elems(H / G, D)};
  if (!lse.empty()) call.lse = kokkos::detail::DeviceView<float, 3>(lse);
  if (!lambda_last.empty()) call.lambda_last = kokkos::detail::DeviceView<float, 3>(lambda_last);
  auto policy = kokkos::detail::team_policy(exec, B * G);
  policy.set_scratch_size(call.ws_level(), Kokkos::PerTeam(call.scratch_bytes()));
  Kokkos::parallel_for("kvmem::kokkos::ua::forward", policy, call);
  exec.space.fence();  // the per-call buffers are released on return
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
  bool can_evict = false;
  if constexpr (detail::kEvicts<Ev>) can_evict = prune::active(ev);
  const UaStepCall<Set, Storage, Ev> call{views,
                                          cache.keys.data(),
                                          cache.values.data(),
                                          cache.lambda.data(),
                                          cache.key_logit.data(),
                                          cache.pos.data(),
                                          cache.length.data(),
                                          cache.peak.data(),
                                          cache.counter.data(),
                                          cache.admit.data(),
                                          s.batch,
                                          G,
                                          H / G,
                                          D,
                                          s.capacity,
                                          opt.prefill_chunk,
                                          kernel::ua::block_workspace_elems(H / G, D),
                                          ev,
                                          can_evict,
                                          opt.evict_before_attention};
  if (exec.checked) KVMEM_RETURN_IF_ERROR(ua_step_check(exec, call, R, N, H));
  Kokkos::parallel_for(
      "kvmem::kokkos::ua::step_admit", Kokkos::RangePolicy<Space>(exec.space, 0, R),
      KOKKOS_LAMBDA(const std::int64_t x) {
        const UaRow w = call.row(x);
        if (w.slot >= 0 && w.fits && w.first) call.admit[w.slot] = call.room(w) ? 1 : 0;
      });
  auto policy = team_policy(exec, R * G);
  policy.set_scratch_size(call.ws_level(), Kokkos::PerTeam(call.scratch_bytes()));
  Kokkos::parallel_for("kvmem::kokkos::ua::step", policy, call);
  Kokkos::parallel_for(
      "kvmem::kokkos::ua::step_advance", Kokkos::RangePolicy<Space>(exec.space, 0, R),
      KOKKOS_LAMBDA(const std::int64_t x) {
        const UaRow w = call.row(x);
        if (call.runs(w)) call.counter[w.slot] += w.T;
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
      "kvmem::kokkos::ua::reset_slots", Kokkos::RangePolicy<Space>(exec.space, 0, n),
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
      "kvmem::kokkos::ua::copy_slots", Kokkos::RangePolicy<Space>(exec.space, 0, n * G),
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
      "kvmem::kokkos::ua::copy_counters", Kokkos::RangePolicy<Space>(exec.space, 0, n),
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
      "kvmem::kokkos::ua::import_slot", Kokkos::RangePolicy<Space>(exec.space, 0, G),
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
