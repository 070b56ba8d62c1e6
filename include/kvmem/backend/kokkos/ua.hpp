// SPDX-License-Identifier: Apache-2.0
#pragma once
// Universal Attention on Kokkos: a pruned cache in the space's memory (UaCache) and the ua/
// operations for kokkos::Executor<Space> (prefill with pruning + compaction, decode with pruning,
// dense forward), running the shared bodies of kernel/ua_*.hpp.
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
// (spec UA.md 4.5: every chunk's eviction depends on the previous one), so the work inside an item is
// done by one thread of the team; the block workspace (accumulators, running max/sum, decay and bias
// tiles) lives in team scratch: level 0 when it fits the ~40 KB CUDA cap (DESIGN.md 4), else level 1.
// Lengths, positions and counters are read inside the kernels. With exec.checked, one reduction checks
// finiteness and capacity first and its result is read back (validation before any change, DESIGN.md 3).

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include <Kokkos_Core.hpp>

#include "kvmem/backend/kokkos/device_view.hpp"
#include "kvmem/backend/kokkos/executor.hpp"
#include "kvmem/core/numeric.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/kernel/ua_attend.hpp"
#include "kvmem/kernel/ua_decay.hpp"
#include "kvmem/kernel/ua_evict.hpp"
#include "kvmem/policy/decay.hpp"
#include "kvmem/ua/cache.hpp"
#include "kvmem/ua/ops.hpp"

namespace kvmem::kokkos {

// The UA pruned cache in MemSpace (spec UA.md 2, 4.4, 4.5). Allocated once by create_cache.
template <class Storage, class MemSpace>
struct UaCache {
  using storage_type = Storage;
  using memory_space = MemSpace;

  ua::CacheShape shape{0, 1, 1, 0, 0, 16};             // empty until create_cache: no slots, a group size of 1
  Kokkos::View<Storage*, MemSpace> keys, values;       // [B, G, capacity, D]
  Kokkos::View<float*, MemSpace> lambda, key_logit;    // [B, G, capacity]
  Kokkos::View<std::int64_t*, MemSpace> pos;           // [B, G, capacity]
  Kokkos::View<std::int64_t*, MemSpace> length, peak;  // [B, G]
  Kokkos::View<std::int64_t*, MemSpace> counter;       // [B] next absolute position

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
  }

  [[nodiscard]] bool valid() const { return shape.capacity > 0 && counter.extent(0) == std::size_t(shape.batch); }
  // Sequence slots (CacheShape::batch); 0 for an empty cache.
  [[nodiscard]] std::int64_t max_slots() const { return valid() ? shape.batch : 0; }
  [[nodiscard]] std::int64_t group_size() const { return shape.query_heads / shape.kv_heads; }
};

template <class Storage = float, class Space, class MemSpace = typename Executor<Space>::memory_space>
Status create_cache(const Executor<Space>& /*exec*/, const ua::CacheShape& s, UaCache<Storage, MemSpace>& out) {
  static_assert(Kokkos::SpaceAccessibility<Space, MemSpace>::accessible,
                "kvmem::kokkos::create_cache: the execution space cannot access MemSpace");
  KVMEM_RETURN_IF_ERROR(ua::PrunedCache<Storage>::validate_shape(s));
  UaCache<Storage, MemSpace> c;
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
  out = std::move(c);
  return Status::ok();
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

// Row pointers of one (sequence, kv head) item of a UaCache.
template <class Storage>
struct UaItem {
  Storage* keys;
  Storage* values;
  float* lambda;
  float* key_logit;
  std::int64_t* pos;
};

template <class Set, class Storage, class MemSpace>
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
  double log_p;
  bool prune;  // log_p > -inf, decided on the host (std::numeric_limits is not device code)
  bool decode, evict_before_attention;

  KOKKOS_INLINE_FUNCTION UaItem<Storage> item(std::int64_t i) const {
    const std::int64_t row0 = i * capacity;
    return {keys + row0 * D, values + row0 * D, lambda + row0, key_logit + row0, pos + row0};
  }
  KOKKOS_INLINE_FUNCTION bool prunes() const { return prune; }

  KOKKOS_INLINE_FUNCTION void append_row(const UaItem<Storage>& it, std::int64_t row, std::int64_t b, std::int64_t g,
                                         std::int64_t t, std::int64_t position) const {
    kernel::ua::append_entry(it.keys, it.values, it.lambda, it.key_logit, it.pos, row, &in.k(b, g, t, 0),
                             &in.v(b, g, t, 0), in.z_k(b, g, t), position, D);
  }
  KOKKOS_INLINE_FUNCTION kernel::ua::BlockArgs<Storage, float, float, float> with_cache(
      kernel::ua::BlockArgs<Storage, float, float, float> a, const UaItem<Storage>& it, std::int64_t n,
      float* workspace) const {
    a.keys = it.keys;
    a.values = it.values;
    a.key_stride = a.value_stride = D;
    a.lambda = it.lambda;
    a.key_logit = it.key_logit;
    a.pos = it.pos;
    a.n = n;
    a.workspace = workspace;
    return a;
  }
  KOKKOS_INLINE_FUNCTION std::int64_t evict(const UaItem<Storage>& it, std::int64_t n) const {
    return kernel::ua::evict_and_compact(it.keys, it.values, D, it.lambda, it.key_logit, it.pos, n, D, log_p);
  }

  // Chunked prefill of one item (spec UA.md 4.5), as ua::detail::prefill_item.
  KOKKOS_INLINE_FUNCTION void prefill_item(std::int64_t i, float* workspace) const {
    const std::int64_t b = i / G, g = i % G;
    const UaItem<Storage> it = item(i);
    const std::int64_t first = counter[b];
    std::int64_t n = length[i], top = n;
    for (std::int64_t t0 = 0; t0 < T; t0 += chunk) {
      const std::int64_t t1 = t0 + chunk < T ? t0 + chunk : T;
      for (std::int64_t t = t0; t < t1; ++t) append_row(it, n + (t - t0), b, g, t, first + t);
      n += t1 - t0;
      top = n > top ? n : top;
      auto a = with_cache(in.block<Storage>(b, g, r, t0, t1), it, n, workspace);
      a.through = first + t0 - 1;  // survivors hold Λ_{first+t0-1}; the chunk keys hold 0
      a.first = first + t0;
      kernel::ua::attend_block<Set>(a);
      if (prunes()) n = evict(it, n);
    }
    length[i] = n;
    peak[i] = top;
  }

  // One decode step of one item (spec UA.md 4.4, 4.5), as ua::detail::decode_item.
  KOKKOS_INLINE_FUNCTION void decode_item(std::int64_t i, float* workspace) const {
    const std::int64_t b = i / G, g = i % G;
    const UaItem<Storage> it = item(i);
    const std::int64_t t = counter[b];
    std::int64_t n = length[i];
    kernel::ua::lambda_update<Set, float>(it.keys, D, it.key_logit, it.pos, it.lambda, n, &in.k(b, g, 0, 0),
                                          in.z_q(b, g, 0), t, D);  // 1. λ_j += A_jt
    append_row(it, n, b, g, 0, t);                                 // 2. append t with λ = 0
    ++n;
    const std::int64_t top = n;
    if (prunes() && evict_before_attention) n = evict(it, n);  // 3. evict, 4. attend (or evict last)
    auto a = with_cache(in.block<Storage>(b, g, r, 0, 1), it, n, workspace);
    a.through = t;  // λ already includes A_{., t}
    a.first = t;
    kernel::ua::attend_block<Set>(a);
    if (prunes() && !evict_before_attention) n = evict(it, n);
    length[i] = n;
    peak[i] = top;
  }

  template <class Member>
  KOKKOS_INLINE_FUNCTION void operator()(const Member& team) const {
    const std::int64_t i = team.league_rank();
    // Unchecked calls skip an item without room for T more rows (it stays as it was).
    if (length[i] + T > capacity) return;
    float* workspace = static_cast<float*>(team.team_scratch(ws_level()).get_shmem(scratch_bytes()));
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      if (decode)
        decode_item(i, workspace);
      else
        prefill_item(i, workspace);
    });
  }

  std::size_t scratch_bytes() const { return static_cast<std::size_t>(ws_elems) * sizeof(float); }
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

template <class Set, class Space, class Storage, class MemSpace>
Status ua_cache_call(const Executor<Space>& exec, UaCache<Storage, MemSpace>& cache, const ua::Inputs& in,
                     const ua::Options& opt, TensorView<float, 4> out, bool decode) {
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
  const UaCacheCall<Set, Storage, MemSpace> call{
      views,
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
      ua::detail::log_threshold(opt.p),
      ua::detail::log_threshold(opt.p) > -std::numeric_limits<double>::infinity(),
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

  std::size_t scratch_bytes() const { return static_cast<std::size_t>(ws_elems) * sizeof(float); }
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
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
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
      kernel::ua::attend_block<Set>(a);
    });
    team.team_barrier();
    if (lambda_last.data != nullptr)
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, T),
                           [&](const std::int64_t t) { lambda_last(b, g, t) = lam[t]; });  // Λ_{T-1, t}
  }
};

}  // namespace detail
}  // namespace kvmem::kokkos

namespace kvmem::ua {

// ua::prefill on a Kokkos cache (spec UA.md 4.5). out: [B,T,H,D]
template <DecaySet Set = decay::Universal, class Space, class Storage, class MemSpace>
Status prefill(const kokkos::Executor<Space>& exec, kokkos::UaCache<Storage, MemSpace>& cache, const Inputs& in,
               const Options& opt, TensorView<float, 4> out) {
  return kokkos::detail::ua_cache_call<Set>(exec, cache, in, opt, out, false);
}

// ua::decode on a Kokkos cache (spec UA.md 4.4, 4.5). out: [B,1,H,D]
template <DecaySet Set = decay::Universal, class Space, class Storage, class MemSpace>
Status decode(const kokkos::Executor<Space>& exec, kokkos::UaCache<Storage, MemSpace>& cache, const Inputs& in,
              const Options& opt, TensorView<float, 4> out) {
  return kokkos::detail::ua_cache_call<Set>(exec, cache, in, opt, out, true);
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

}  // namespace kvmem::ua
