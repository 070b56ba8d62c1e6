// SPDX-License-Identifier: Apache-2.0
#pragma once
// Universal Attention operations (spec UA.md 2, 4): prefill into a PrunedCache (chunked, evicting at
// chunk ends), decode one token, step (a ragged batch of sequence slots mixing prefill rows and decode
// rows, DESIGN.md 3), and forward (dense, no cache: output + lse + lambda_last for training-style use).
// The slot operations (reset_slots, copy_slots, export/import, truncate) are in ua/slots.hpp. Every
// operation takes the executor first, validates everything (shapes, NaN/Inf, threshold, chunk,
// capacity, workspace) before it touches the cache, and runs one (sequence, kv head) item per worker
// through the backend's Launcher (backend/host/ua.hpp for kvmem::host::Executor). Item w of a call uses
// work item w of the cache's workspace; rows take pages from the cache's pool (ua/cache.hpp).
//
// Runtime configuration: Options{p, prefill_chunk, evict_before_attention}; p = 0 is dense UA
// (prune::None) with the same API. Compile-time composition: ua::Attention<DecaySet, Prune, Precision>.

#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvmem/core/math.hpp"
#include "kvmem/core/slots.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/support.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/kernel/ua_attend.hpp"
#include "kvmem/kernel/ua_decay.hpp"
#include "kvmem/kernel/ua_evict.hpp"
#include "kvmem/policy/decay.hpp"
#include "kvmem/policy/precision.hpp"
#include "kvmem/policy/prune.hpp"
#include "kvmem/ua/cache.hpp"
#include "kvmem/ua/slots.hpp"

namespace kvmem::ua {

// Runtime options (spec UA.md 3).
struct Options {
  double p = 0.0;                      // eviction threshold, evict iff λ < ln p; 0 = never (dense)
  std::int64_t prefill_chunk = 128;    // P: prefill evicts at the end of each chunk
  bool evict_before_attention = true;  // decode order: λ update, append, evict, attend (false: evict last)
  std::int64_t layer = 0;              // the layer this cache belongs to (a prune policy may use it)

  // From a prune policy value chosen at run time (prune::Threshold{p}) or prune::None (dense).
  static Options with(const prune::Threshold& policy, std::int64_t chunk = 128, bool evict_before = true) {
    return Options{policy.p, chunk, evict_before};
  }
  static Options with(const prune::None&, std::int64_t chunk = 128, bool evict_before = true) {
    return Options{0.0, chunk, evict_before};
  }
};

// Views of one call's inputs. T is the number of tokens of the call (1 for decode). q, k, v and z_o
// have the element type S (float on the host; the CUDA backend also takes bf16 / fp16 device memory),
// the gate logits are fp32.
template <class S>
struct InputsOf {
  TensorView<const S, 4> q;        // [B,H,T,D] post-RoPE queries, no 1/sqrt(D)
  TensorView<const S, 4> k;        // [B,G,T,D] normalised, then rotated keys
  TensorView<const S, 4> v;        // [B,G,T,D]
  TensorView<const float, 3> z_k;  // [B,G,T] key-gate logits
  TensorView<const float, 3> z_q;  // [B,G,T] query-side gate logits
  TensorView<const S, 4> z_o;      // [B,T,H,D] output-gate logits; empty view = no output gate
};
// Host and Kokkos inputs: float views of caller memory.
using Inputs = InputsOf<float>;

// Whether the host backend runs a cache of this shape: ok, or a Status with the reason. Sizes come from
// ua::cache_layout and ua::workspace_bytes (ua/cache.hpp, docs/memory.md).
template <class Exec>
Status can_run(const Exec& /*exec*/, const CacheShape& shape) {
  return PrunedCache<float>::validate_shape(shape);
}

// Customisation point: a backend specialises Launcher<Executor> with
//   template <class Body> static void for_each(const Executor&, std::int64_t items, std::int64_t work, Body&& body);
// running body(item) once for every (sequence, kv head) item; `work` is a rough multiply-add count of
// the whole call, so a backend can run small calls (a decode step over a pruned cache) inline instead
// of paying for a launch. ua/ knows no backend (DESIGN.md 1).
template <class Exec>
struct Launcher {
  static_assert(
      sizeof(Exec) == 0,
      "kvmem::ua: no UA backend for this executor; include kvmem/backend/host/ua.hpp for kvmem::host::Executor");
};

// The cache type of an executor's backend (DESIGN.md 3), so engine code written once names it, as
// kvm::state_t does for KVM: each backend specialises Backend<Executor> with
//   template <class S> using cache_type;
// (host: PrunedCache<S>; Kokkos: kokkos::UaCache<S, memory space>; CUDA: cuda::UaCache<S>). Every cache
// type has static create(const CacheShape&, cache&), valid() and max_slots(), and prefill, decode, step,
// forward and the slot operations take it in the same argument order on every backend.
template <class Executor>
struct Backend;
template <class Executor, class S = float>
using cache_t = typename Backend<Executor>::template cache_type<S>;

namespace detail {

template <std::size_t Rank>
Status check_finite(const TensorView<const float, Rank>& view, const char* name) {
  bool ok = true;
  if constexpr (Rank == 2) {
    for (std::int64_t a = 0; a < view.extent(0); ++a)
      for (std::int64_t b = 0; b < view.extent(1); ++b) ok = ok && std::isfinite(view(a, b));
  } else if constexpr (Rank == 3) {
    for (std::int64_t a = 0; a < view.extent(0); ++a)
      for (std::int64_t b = 0; b < view.extent(1); ++b)
        for (std::int64_t c = 0; c < view.extent(2); ++c) ok = ok && std::isfinite(view(a, b, c));
  } else {
    for (std::int64_t a = 0; a < view.extent(0); ++a)
      for (std::int64_t b = 0; b < view.extent(1); ++b)
        for (std::int64_t c = 0; c < view.extent(2); ++c)
          for (std::int64_t d = 0; d < view.extent(3); ++d) ok = ok && std::isfinite(view(a, b, c, d));
  }
  if (!ok) return invalid_argument(name, "finite values", "NaN or Inf");
  return Status::ok();
}

template <class T, std::size_t Rank>
Status check_rows(const TensorView<T, Rank>& view, const char* name) {
  if (view.size() > 0 && view.stride(Rank - 1) != 1)
    return invalid_argument(std::string(name) + " innermost stride", 1, view.stride(Rank - 1));
  return Status::ok();
}

// Shapes and row strides of the inputs of one call with T tokens (no data read); every backend checks
// these first. The bodies read rows through pointers, so the innermost stride must be 1.
template <class S, class O>
Status check_call_shapes(const InputsOf<S>& in, TensorView<O, 4> out, std::int64_t B, std::int64_t H, std::int64_t G,
                         std::int64_t D) {
  const std::int64_t T = in.q.extent(2);
  if (T <= 0) return invalid_argument("q tokens (dim 2)", "at least one token", T);
  KVMEM_RETURN_IF_ERROR(check_shape(in.q, {B, H, T, D}, "q [B,H,T,D]"));
  KVMEM_RETURN_IF_ERROR(check_shape(in.k, {B, G, T, D}, "k [B,G,T,D]"));
  KVMEM_RETURN_IF_ERROR(check_shape(in.v, {B, G, T, D}, "v [B,G,T,D]"));
  KVMEM_RETURN_IF_ERROR(check_shape(in.z_k, {B, G, T}, "z_k [B,G,T]"));
  KVMEM_RETURN_IF_ERROR(check_shape(in.z_q, {B, G, T}, "z_q [B,G,T]"));
  if (!in.z_o.empty()) KVMEM_RETURN_IF_ERROR(check_shape(in.z_o, {B, T, H, D}, "z_o [B,T,H,D]"));
  KVMEM_RETURN_IF_ERROR(check_shape(TensorView<const O, 4>(out), {B, T, H, D}, "out [B,T,H,D]"));
  KVMEM_RETURN_IF_ERROR(check_rows(in.q, "q"));
  KVMEM_RETURN_IF_ERROR(check_rows(in.k, "k"));
  KVMEM_RETURN_IF_ERROR(check_rows(in.v, "v"));
  KVMEM_RETURN_IF_ERROR(check_rows(in.z_o, "z_o"));
  return check_rows(out, "out");
}

// Shapes, strides and finiteness of one call with T tokens (the host backend's full check).
inline Status validate_inputs(const Inputs& in, TensorView<float, 4> out, std::int64_t B, std::int64_t H,
                              std::int64_t G, std::int64_t D) {
  KVMEM_RETURN_IF_ERROR(check_call_shapes(in, out, B, H, G, D));
  KVMEM_RETURN_IF_ERROR(check_finite(in.q, "q"));
  KVMEM_RETURN_IF_ERROR(check_finite(in.k, "k"));
  KVMEM_RETURN_IF_ERROR(check_finite(in.v, "v"));
  KVMEM_RETURN_IF_ERROR(check_finite(in.z_k, "z_k"));
  KVMEM_RETURN_IF_ERROR(check_finite(in.z_q, "z_q"));
  if (!in.z_o.empty()) KVMEM_RETURN_IF_ERROR(check_finite(in.z_o, "z_o"));
  return Status::ok();
}

inline Status validate_options(const Options& opt) {
  KVMEM_RETURN_IF_ERROR(prune::Threshold{opt.p}.validate());
  if (opt.prefill_chunk <= 0)
    return invalid_argument("Options prefill_chunk", "a positive chunk length (default 128)", opt.prefill_chunk);
  return Status::ok();
}

inline double log_threshold(double p) {
  return prune::Threshold{p}.log_threshold();
}

// A call that passes a prune policy: Options::p stays 0 (the policy decides), the policy's values
// and the call's layer are valid for it.
template <PrunePolicy Rule>
Status validate_rule(const Rule& rule, const Options& opt) {
  if (opt.p != 0.0)
    return invalid_argument("Options p", "0 when a prune policy is passed (the policy decides eviction)", opt.p);
  KVMEM_RETURN_IF_ERROR(rule.validate());
  return prune::validate_layer(rule, opt.layer);
}

// The evictor of a call: the policy's, at the call's layer; NoEvictor for a disabled policy
// (prune::None), which removes the eviction from the item bodies at compile time: the host and Kokkos
// bodies test kEvicts with `if constexpr`, and the CUDA/HIP launches pick the decode and finish kernel
// instances without an eviction test and no cut kernels (backend/cuda/ua.cuh).
struct NoEvictor {};
template <class Ev>
inline constexpr bool kEvicts = !std::is_same_v<Ev, NoEvictor>;
template <PrunePolicy Rule>
auto evictor_of(const Rule& rule, const Options& opt) {
  if constexpr (Rule::kEnabled)
    return rule.evictor(opt.layer);
  else
    return NoEvictor{};
}

// The inputs and outputs of one (sequence, kv head) item over the T tokens of its call: pointers to
// token 0 of the item (query heads g*r.., kv head g) and the strides between tokens and heads. The
// batch-major ops (prefill, decode) and the token-major slot step (step) both describe their tensors
// this way, so they run the very same item code and give the same bits.
struct ItemIO {
  std::int64_t T = 0;
  const float* q = nullptr;  // [r heads, T, D]
  std::int64_t q_head_stride = 0, q_row_stride = 0;
  const float* k = nullptr;  // [T, D]
  const float* v = nullptr;  // [T, D]
  std::int64_t k_row_stride = 0, v_row_stride = 0;
  const float* z_k = nullptr;  // [T]
  const float* z_q = nullptr;  // [T]
  std::int64_t z_k_stride = 1, z_q_stride = 1;
  const float* z_o = nullptr;  // [T, r heads, D], nullptr = no output gate
  std::int64_t z_o_row_stride = 0, z_o_head_stride = 0;
  float* out = nullptr;  // [T, r heads, D]
  std::int64_t out_row_stride = 0, out_head_stride = 0;
  float* lse = nullptr;  // [r heads, T], nullptr = not wanted
  std::int64_t lse_head_stride = 0, lse_row_stride = 0;
};

// Item (b, g) of a batch-major call (Inputs [B,H,T,D] ..., out [B,T,H,D]).
inline ItemIO item_io(const Inputs& in, TensorView<float, 4> out, std::int64_t b, std::int64_t g, std::int64_t r) {
  ItemIO io;
  io.T = in.q.extent(2);
  io.q = &in.q(b, g * r, 0, 0);
  io.q_head_stride = in.q.stride(1);
  io.q_row_stride = in.q.stride(2);
  io.k = &in.k(b, g, 0, 0);
  io.k_row_stride = in.k.stride(2);
  io.v = &in.v(b, g, 0, 0);
  io.v_row_stride = in.v.stride(2);
  io.z_k = &in.z_k(b, g, 0);
  io.z_k_stride = in.z_k.stride(2);
  io.z_q = &in.z_q(b, g, 0);
  io.z_q_stride = in.z_q.stride(2);
  if (!in.z_o.empty()) {
    io.z_o = &in.z_o(b, 0, g * r, 0);
    io.z_o_row_stride = in.z_o.stride(1);
    io.z_o_head_stride = in.z_o.stride(2);
  }
  io.out = &out(b, 0, g * r, 0);
  io.out_row_stride = out.stride(1);
  io.out_head_stride = out.stride(2);
  return io;
}

// Appends token t of the item's call as logical entry `row` (its page is taken already).
template <class Storage>
void append_row(typename PrunedCache<Storage>::ItemView& v, std::int64_t row, const ItemIO& io, std::int64_t t,
                std::int64_t pos, std::int64_t D) {
  kernel::ua::append_entry(v.keys, v.values, v.lambda, v.key_logit, v.pos, v.map(row), io.k + t * io.k_row_stride,
                           io.v + t * io.v_row_stride, io.z_k[t * io.z_k_stride], pos, D, v.key_scale, v.value_scale);
}

// Zeroes the outputs (and lse) of an item's T tokens and r heads: a slot that overflowed the pool.
inline void zero_outputs(const ItemIO& io, std::int64_t r, std::int64_t D) {
  for (std::int64_t t = 0; t < io.T; ++t)
    for (std::int64_t h = 0; h < r; ++h) {
      float* o = io.out + t * io.out_row_stride + h * io.out_head_stride;
      for (std::int64_t d = 0; d < D; ++d) o[d] = 0.0f;
      if (io.lse != nullptr) io.lse[h * io.lse_head_stride + t * io.lse_row_stride] = 0.0f;
    }
}

// The pool had no page for item (b, g): flag the slot, return the item's pages at once, zero its
// outputs. The slot's other items are cleared after the operation (finish_overflowed).
template <class Storage>
bool overflow_item(PrunedCache<Storage>& cache, std::int64_t b, std::int64_t g, const ItemIO& io) {
  cache.set_overflow(b);
  cache.release_rows(b, g, 0);
  cache.set_length(b, g, 0, 0);
  zero_outputs(io, cache.group_size(), cache.shape().head_dim);
  return false;
}

// BlockArgs for query tokens [t0, t1) of one item's call.
template <class KS>
kernel::ua::BlockArgs<KS, float, float, float> block_args(const ItemIO& io, std::int64_t D, std::int64_t r,
                                                          std::int64_t t0, std::int64_t t1) {
  kernel::ua::BlockArgs<KS, float, float, float> a;
  a.D = D;
  a.heads = r;
  a.rows = t1 - t0;
  a.new_keys = io.k + t0 * io.k_row_stride;
  a.new_key_stride = io.k_row_stride;
  a.query_logit = io.z_q + t0 * io.z_q_stride;
  a.query_logit_stride = io.z_q_stride;
  a.q = io.q + t0 * io.q_row_stride;
  a.q_head_stride = io.q_head_stride;
  a.q_row_stride = io.q_row_stride;
  if (io.z_o != nullptr) {
    a.z_o = io.z_o + t0 * io.z_o_row_stride;
    a.z_o_row_stride = io.z_o_row_stride;
    a.z_o_head_stride = io.z_o_head_stride;
  }
  a.out = io.out + t0 * io.out_row_stride;
  a.out_row_stride = io.out_row_stride;
  a.out_head_stride = io.out_head_stride;
  if (io.lse != nullptr) {
    a.lse = io.lse + t0 * io.lse_row_stride;
    a.lse_head_stride = io.lse_head_stride;
    a.lse_row_stride = io.lse_row_stride;
  }
  return a;
}

template <class Storage>
kernel::ua::BlockArgs<Storage, float, float, float> with_cache(kernel::ua::BlockArgs<Storage, float, float, float> a,
                                                               const typename PrunedCache<Storage>::ItemView& v,
                                                               std::int64_t n) {
  a.keys = v.keys;
  a.values = v.values;
  a.key_stride = a.value_stride = a.D;
  a.lambda = v.lambda;
  a.key_logit = v.key_logit;
  a.pos = v.pos;
  a.key_scale = v.key_scale;
  a.value_scale = v.value_scale;
  a.map = v.map;
  a.n = n;
  a.workspace = v.workspace;
  return a;
}

// Evicts what the evictor's cut removes from item (b, g) of n entries and returns the pages past the
// survivors to the pool. Returns the survivors.
template <class Ev, class Storage, class View>
std::int64_t evict_item(const Ev& ev, PrunedCache<Storage>& cache, std::int64_t b, std::int64_t g, const View& v,
                        std::int64_t n) {
  const std::int64_t D = cache.shape().head_dim;
  n = kernel::ua::evict_by(ev, v.map, v.keys, v.values, D, v.lambda, v.key_logit, v.pos, n, D, v.key_scale,
                           v.value_scale);
  cache.release_rows(b, g, n);
  return n;
}

// Chunked prefill of one (b, g) item (spec UA.md 4.5): per chunk, append the chunk's keys, attend
// (survivors + chunk keys t0..i with exact Λ), move λ to the chunk end, evict (the prune policy's
// evictor `ev`; NoEvictor: none). Chunks are
// counted from the call's first token, and the survivors of earlier calls take part like the
// survivors of an earlier chunk, so a call continues a non-empty cache. Pages: a chunk's rows are taken
// before it is appended, and eviction returns the pages past the survivors. False: the pool ran dry.
// w: the work item whose workspace the item uses.
template <class Set, class Storage, class Ev>
bool prefill_item(PrunedCache<Storage>& cache, std::int64_t b, std::int64_t g, std::int64_t w, const ItemIO& io,
                  const Options& opt, const Ev& ev) {
  auto v = cache.item_view(b, g, w);
  const std::int64_t D = cache.shape().head_dim, T = io.T, r = cache.group_size();
  const std::int64_t first = cache.position(b);
  bool prunes = false;
  if constexpr (kEvicts<Ev>) prunes = prune::active(ev);
  std::int64_t n = *v.length, peak = n;
  for (std::int64_t t0 = 0; t0 < T; t0 += opt.prefill_chunk) {
    const std::int64_t t1 = t0 + opt.prefill_chunk < T ? t0 + opt.prefill_chunk : T;
    if (!cache.reserve_rows(b, g, n + (t1 - t0))) return overflow_item(cache, b, g, io);
    for (std::int64_t t = t0; t < t1; ++t) append_row<Storage>(v, n + (t - t0), io, t, first + t, D);
    n += t1 - t0;
    peak = n > peak ? n : peak;
    auto a = with_cache<Storage>(block_args<Storage>(io, D, r, t0, t1), v, n);
    a.through = first + t0 - 1;  // survivors hold Λ_{first+t0-1}; the chunk keys hold 0
    a.first = first + t0;
    kernel::ua::attend_block<Set>(a);
    if constexpr (kEvicts<Ev>)
      if (prunes) n = evict_item(ev, cache, b, g, v, n);
  }
  *v.length = n;
  *v.peak = peak;
  return true;
}

// One decode step of one (b, g) item (spec UA.md 4.4, 4.5). The new row's page is taken before anything
// changes; eviction returns the pages past the survivors. False: the pool ran dry.
template <class Set, class Storage, class Ev>
bool decode_item(PrunedCache<Storage>& cache, std::int64_t b, std::int64_t g, std::int64_t w, const ItemIO& io,
                 const Options& opt, const Ev& ev) {
  auto v = cache.item_view(b, g, w);
  const std::int64_t D = cache.shape().head_dim, r = cache.group_size();
  const std::int64_t t = cache.position(b);
  bool prunes = false;
  if constexpr (kEvicts<Ev>) prunes = prune::active(ev);
  std::int64_t n = *v.length;
  if (!cache.reserve_rows(b, g, n + 1)) return overflow_item(cache, b, g, io);
  // 1. λ_j += A_jt for every cached entry, run by run of consecutive rows (each entry on its own)
  for (std::int64_t e = 0; e < n;) {
    const std::int64_t len = v.map.run(e, n), x = v.map(e);
    kernel::ua::lambda_update<Set, float>(v.keys + x * D, D, v.key_logit + x, v.pos + x, v.lambda + x, len, io.k,
                                          io.z_q[0], t, D, v.key_scale ? v.key_scale + x : nullptr);
    e += len;
  }
  // 2. append t with λ = 0
  append_row<Storage>(v, n, io, 0, t, D);
  ++n;
  const std::int64_t peak = n;
  // 3. evict (default order), 4. attend with bias λ, or evict afterwards
  if constexpr (kEvicts<Ev>)
    if (prunes && opt.evict_before_attention) n = evict_item(ev, cache, b, g, v, n);
  auto a = with_cache<Storage>(block_args<Storage>(io, D, r, 0, 1), v, n);
  a.through = t;  // λ already includes A_{., t}
  a.first = t;
  kernel::ua::attend_block<Set>(a);
  if constexpr (kEvicts<Ev>)
    if (prunes && !opt.evict_before_attention) n = evict_item(ev, cache, b, g, v, n);
  *v.length = n;
  *v.peak = peak;
  return true;
}

// After an operation: every slot flagged by overflow_item has all of its items emptied and its pages
// back in the pool (an item that ran before the pool went dry may still hold some).
template <class Storage>
void finish_overflowed(PrunedCache<Storage>& cache, std::int64_t b) {
  for (std::int64_t g = 0; g < cache.shape().kv_heads; ++g) {
    cache.release_rows(b, g, 0);
    cache.set_length(b, g, 0, 0);
  }
}

template <class Storage>
Status validate_cache_call(const PrunedCache<Storage>& cache, const Inputs& in, const Options& opt,
                           TensorView<float, 4> out, bool decode) {
  const CacheShape& s = cache.shape();
  if (s.capacity <= 0) return invalid_argument("cache", "a cache made by PrunedCache::create", "an empty cache");
  KVMEM_RETURN_IF_ERROR(validate_options(opt));
  KVMEM_RETURN_IF_ERROR(validate_inputs(in, out, s.batch, s.query_heads, s.kv_heads, s.head_dim));
  const std::int64_t T = in.q.extent(2);
  if (decode && T != 1) return invalid_argument("decode tokens (q dim 2)", 1, T);
  KVMEM_RETURN_IF_ERROR(cache.check_workspace(s.batch));
  // Prefill needs room for everything it may append before evicting; a conservative bound that does
  // not depend on the data (feed long prompts chunk by chunk to keep the cache small).
  const std::int64_t need = cache.max_length() + T;
  if (need > s.capacity)
    return {StatusCode::kOutOfRange,
            kvmem::detail::concat("cache capacity: expected room for ", need, " rows per (sequence, kv head) (longest ",
                                  cache.max_length(), " + ", T, " new tokens), got capacity ", s.capacity)};
  return Status::ok();
}

// After a batch-major call: sequences advance, except those whose slot overflowed the pool, which are
// emptied and whose outputs are zeroed for every head.
template <class Storage>
void finish_batch(PrunedCache<Storage>& cache, const Inputs& in, TensorView<float, 4> out) {
  const CacheShape& s = cache.shape();
  for (std::int64_t b = 0; b < s.batch; ++b) {
    if (!cache.overflowed(b)) {
      cache.advance(b, in.q.extent(2));
      continue;
    }
    finish_overflowed(cache, b);
    for (std::int64_t g = 0; g < s.kv_heads; ++g)
      zero_outputs(item_io(in, out, b, g, cache.group_size()), cache.group_size(), s.head_dim);
  }
}

}  // namespace detail

namespace detail {
template <DecaySet Set, class Exec, class Storage, class Ev>
Status prefill_with(const Exec& exec, PrunedCache<Storage>& cache, const Inputs& in, const Options& opt, const Ev& ev,
                    TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_cache_call(cache, in, opt, out, false));
  const CacheShape& s = cache.shape();
  const std::int64_t T = in.q.extent(2);
  const std::int64_t work = s.batch * s.query_heads * s.head_dim * T * (cache.max_length() + T);
  Launcher<Exec>::for_each(exec, s.batch * s.kv_heads, work, [&](std::int64_t it) {
    const std::int64_t b = it / s.kv_heads, g = it % s.kv_heads;
    const detail::ItemIO io = detail::item_io(in, out, b, g, cache.group_size());
    if (cache.overflowed(b))
      detail::zero_outputs(io, cache.group_size(), s.head_dim);
    else
      detail::prefill_item<Set>(cache, b, g, it, io, opt, ev);
  });
  detail::finish_batch(cache, in, out);
  return Status::ok();
}
}  // namespace detail

// Prefill T tokens of every sequence into the cache (spec UA.md 4.5) and write their outputs.
// The caller rotates token t of sequence b at position cache.position(b) + t. Needs
// longest cache + T <= capacity (checked up front; eviction is data-dependent): to keep the cache
// small, feed a long prompt in calls of prefill_chunk tokens, which gives the same result as one call.
// out: [B,T,H,D]
// With a prune policy `rule` (policy/prune.hpp) in place of Options::p, which must then be 0.
template <DecaySet Set = decay::Universal, PrunePolicy Rule, class Exec, class Storage>
Status prefill(const Exec& exec, PrunedCache<Storage>& cache, const Inputs& in, const Options& opt, const Rule& rule,
               TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_rule(rule, opt));
  return detail::prefill_with<Set>(exec, cache, in, opt, detail::evictor_of(rule, opt), out);
}
template <DecaySet Set = decay::Universal, class Exec, class Storage>
Status prefill(const Exec& exec, PrunedCache<Storage>& cache, const Inputs& in, const Options& opt,
               TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_options(opt));
  return detail::prefill_with<Set>(exec, cache, in, opt, prune::Threshold{opt.p}.evictor(opt.layer), out);
}

namespace detail {
template <DecaySet Set, class Exec, class Storage, class Ev>
Status decode_with(const Exec& exec, PrunedCache<Storage>& cache, const Inputs& in, const Options& opt, const Ev& ev,
                   TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_cache_call(cache, in, opt, out, true));
  const CacheShape& s = cache.shape();
  std::int64_t entries = 0;
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t g = 0; g < s.kv_heads; ++g) entries += cache.length(b, g) + 1;
  const std::int64_t work = entries * s.head_dim * (cache.group_size() + 1);
  Launcher<Exec>::for_each(exec, s.batch * s.kv_heads, work, [&](std::int64_t it) {
    const std::int64_t b = it / s.kv_heads, g = it % s.kv_heads;
    const detail::ItemIO io = detail::item_io(in, out, b, g, cache.group_size());
    if (cache.overflowed(b))
      detail::zero_outputs(io, cache.group_size(), s.head_dim);
    else
      detail::decode_item<Set>(cache, b, g, it, io, opt, ev);
  });
  detail::finish_batch(cache, in, out);
  return Status::ok();
}
}  // namespace detail

// Decode one token per sequence (T = 1) at position cache.position(b) (spec UA.md 4.4, 4.5).
// out: [B,1,H,D]
template <DecaySet Set = decay::Universal, PrunePolicy Rule, class Exec, class Storage>
Status decode(const Exec& exec, PrunedCache<Storage>& cache, const Inputs& in, const Options& opt, const Rule& rule,
              TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_rule(rule, opt));
  return detail::decode_with<Set>(exec, cache, in, opt, detail::evictor_of(rule, opt), out);
}
template <DecaySet Set = decay::Universal, class Exec, class Storage>
Status decode(const Exec& exec, PrunedCache<Storage>& cache, const Inputs& in, const Options& opt,
              TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_options(opt));
  return detail::decode_with<Set>(exec, cache, in, opt, prune::Threshold{opt.p}.evictor(opt.layer), out);
}

// Dense UA over T tokens without a cache (training-style use, spec UA.md 2): out, and optionally
// lse and lambda_last (empty views = not wanted). Allocates its per-item workspace (not a hot path).
// out: [B,T,H,D]; lse: [B,H,T] or empty; lambda_last: [B,G,T] or empty
template <DecaySet Set = decay::Universal, class Exec>
Status forward(const Exec& exec, const Inputs& in, TensorView<float, 4> out, TensorView<float, 3> lse = {},
               TensorView<float, 3> lambda_last = {}) {
  const std::int64_t B = in.q.extent(0), H = in.q.extent(1), T = in.q.extent(2), D = in.q.extent(3);
  const std::int64_t G = in.k.extent(1);
  if (B <= 0 || H <= 0 || G <= 0 || D <= 0)
    return invalid_argument("q/k extents", "positive B, H, G, D", kvmem::detail::concat(B, ",", H, ",", G, ",", D));
  if (H % G != 0) return invalid_argument("H % G (q dim 1, k dim 1)", 0, H % G);
  KVMEM_RETURN_IF_ERROR(detail::validate_inputs(in, out, B, H, G, D));
  if (!lse.empty()) KVMEM_RETURN_IF_ERROR(check_shape(TensorView<const float, 3>(lse), {B, H, T}, "lse [B,H,T]"));
  if (!lambda_last.empty())
    KVMEM_RETURN_IF_ERROR(check_shape(TensorView<const float, 3>(lambda_last), {B, G, T}, "lambda_last [B,G,T]"));
  const std::int64_t r = H / G;
  const std::int64_t ws = kernel::ua::block_workspace_elems(r, D);
  Launcher<Exec>::for_each(exec, B * G, B * H * D * T * T, [&](std::int64_t it) {
    const std::int64_t b = it / G, g = it % G;
    // Keys and values stay in the caller's tensors; λ, gates and positions are per-item copies.
    std::vector<float> lambda(static_cast<std::size_t>(T), 0.0f), key_logit(static_cast<std::size_t>(T)),
        workspace(static_cast<std::size_t>(ws));
    std::vector<std::int64_t> pos(static_cast<std::size_t>(T));
    for (std::int64_t t = 0; t < T; ++t) {
      key_logit[static_cast<std::size_t>(t)] = in.z_k(b, g, t);
      pos[static_cast<std::size_t>(t)] = t;
    }
    auto a = detail::block_args<float>(detail::item_io(in, out, b, g, r), D, r, 0, T);
    a.keys = &in.k(b, g, 0, 0);
    a.values = &in.v(b, g, 0, 0);
    a.key_stride = in.k.stride(2);
    a.value_stride = in.v.stride(2);
    a.lambda = lambda.data();
    a.key_logit = key_logit.data();
    a.pos = pos.data();
    a.n = T;
    a.through = -1;
    a.first = 0;
    a.workspace = workspace.data();
    std::vector<float> lse_buf;
    if (!lse.empty()) {
      lse_buf.assign(static_cast<std::size_t>(r * T), 0.0f);
      a.lse = lse_buf.data();
      a.lse_head_stride = T;
      a.lse_row_stride = 1;
    }
    kernel::ua::attend_block<Set>(a);
    for (std::int64_t t = 0; t < T; ++t) {
      if (!lambda_last.empty()) lambda_last(b, g, t) = lambda[static_cast<std::size_t>(t)];  // Λ_{T-1, t}
      if (!lse.empty())
        for (std::int64_t h = 0; h < r; ++h) lse(b, g * r + h, t) = lse_buf[static_cast<std::size_t>(h * T + t)];
    }
  });
  return Status::ok();
}

// ---- the slot step (DESIGN.md 3, core/slots.hpp) -------------------------------------------------

// Packed token-major inputs of one slot step: token x of the call belongs to the row r with
// query_start[r] <= x < query_start[r+1]. q, k, v and z_o have the element type S (float on the host);
// the gate logits are fp32.
template <class S>
struct PackedInputsOf {
  TensorView<const S, 3> q;        // [tokens,H,D] post-RoPE queries, no 1/sqrt(D)
  TensorView<const S, 3> k;        // [tokens,G,D] normalised, then rotated keys
  TensorView<const S, 3> v;        // [tokens,G,D]
  TensorView<const float, 2> z_k;  // [tokens,G] key-gate logits
  TensorView<const float, 2> z_q;  // [tokens,G] query-side gate logits
  TensorView<const S, 3> z_o;      // [tokens,H,D] output-gate logits; empty view = no output gate
  [[nodiscard]] std::int64_t tokens() const { return q.extent(0); }
};
using PackedInputs = PackedInputsOf<float>;

namespace detail {

// Item (row token range [x0, x0 + T), kv head g) of a packed call.
inline ItemIO item_io(const PackedInputs& in, TensorView<float, 3> out, TensorView<float, 2> lse, std::int64_t x0,
                      std::int64_t T, std::int64_t g, std::int64_t r) {
  ItemIO io;
  io.T = T;
  io.q = &in.q(x0, g * r, 0);
  io.q_head_stride = in.q.stride(1);
  io.q_row_stride = in.q.stride(0);
  io.k = &in.k(x0, g, 0);
  io.k_row_stride = in.k.stride(0);
  io.v = &in.v(x0, g, 0);
  io.v_row_stride = in.v.stride(0);
  io.z_k = &in.z_k(x0, g);
  io.z_k_stride = in.z_k.stride(0);
  io.z_q = &in.z_q(x0, g);
  io.z_q_stride = in.z_q.stride(0);
  if (!in.z_o.empty()) {
    io.z_o = &in.z_o(x0, g * r, 0);
    io.z_o_row_stride = in.z_o.stride(0);
    io.z_o_head_stride = in.z_o.stride(1);
  }
  io.out = &out(x0, g * r, 0);
  io.out_row_stride = out.stride(0);
  io.out_head_stride = out.stride(1);
  if (!lse.empty()) {
    io.lse = &lse(x0, g * r);
    io.lse_row_stride = lse.stride(0);
    io.lse_head_stride = lse.stride(1);
  }
  return io;
}

// The shapes and row layouts of a slot step's packed inputs and outputs against a cache of shape s
// (every backend's ua::step checks these on the host before anything runs).
template <class S>
Status check_packed_step(const CacheShape& s, const PackedInputsOf<S>& in, TensorView<float, 3> out,
                         TensorView<float, 2> lse) {
  const std::int64_t N = in.tokens(), H = s.query_heads, G = s.kv_heads, D = s.head_dim;
  KVMEM_RETURN_IF_ERROR(check_shape(in.q, {N, H, D}, "q [tokens,H,D]"));
  KVMEM_RETURN_IF_ERROR(check_shape(in.k, {N, G, D}, "k [tokens,G,D]"));
  KVMEM_RETURN_IF_ERROR(check_shape(in.v, {N, G, D}, "v [tokens,G,D]"));
  KVMEM_RETURN_IF_ERROR(check_shape(in.z_k, {N, G}, "z_k [tokens,G]"));
  KVMEM_RETURN_IF_ERROR(check_shape(in.z_q, {N, G}, "z_q [tokens,G]"));
  if (!in.z_o.empty()) KVMEM_RETURN_IF_ERROR(check_shape(in.z_o, {N, H, D}, "z_o [tokens,H,D]"));
  KVMEM_RETURN_IF_ERROR(check_shape(TensorView<const float, 3>(out), {N, H, D}, "out [tokens,H,D]"));
  if (lse.data() != nullptr || !lse.empty())  // a default-constructed view: lse not wanted
    KVMEM_RETURN_IF_ERROR(check_shape(TensorView<const float, 2>(lse), {N, H}, "lse [tokens,H]"));
  KVMEM_RETURN_IF_ERROR(check_rows(in.q, "q"));
  KVMEM_RETURN_IF_ERROR(check_rows(in.k, "k"));
  KVMEM_RETURN_IF_ERROR(check_rows(in.v, "v"));
  KVMEM_RETURN_IF_ERROR(check_rows(in.z_o, "z_o"));
  KVMEM_RETURN_IF_ERROR(check_rows(out, "out"));
  return Status::ok();
}

// Everything step checks before it changes anything (DESIGN.md 3: validation first).
template <class Storage>
Status validate_step(const PrunedCache<Storage>& cache, const Rows& rows, const PackedInputs& in, const Options& opt,
                     TensorView<float, 3> out, TensorView<float, 2> lse) {
  if (!cache.valid()) return invalid_argument("cache", "a cache made by PrunedCache::create", "an empty cache");
  KVMEM_RETURN_IF_ERROR(validate_options(opt));
  const CacheShape& s = cache.shape();
  const std::int64_t N = in.tokens(), G = s.kv_heads;
  KVMEM_RETURN_IF_ERROR(check_packed_step(s, in, out, lse));
  KVMEM_RETURN_IF_ERROR(check_finite(in.q, "q"));
  KVMEM_RETURN_IF_ERROR(check_finite(in.k, "k"));
  KVMEM_RETURN_IF_ERROR(check_finite(in.v, "v"));
  KVMEM_RETURN_IF_ERROR(check_finite(in.z_k, "z_k"));
  KVMEM_RETURN_IF_ERROR(check_finite(in.z_q, "z_q"));
  if (!in.z_o.empty()) KVMEM_RETURN_IF_ERROR(check_finite(in.z_o, "z_o"));
  KVMEM_RETURN_IF_ERROR(validate_rows(rows, cache.max_slots(), N));
  // Capacity, row by row: only a row whose own slot would overflow is refused (the conservative bound
  // of prefill, length + tokens, since eviction is data-dependent). The whole call is refused before
  // any change, and the message names the row and the slot, so the engine can drop or reset that
  // slot and step the others in its next call.
  std::int64_t active = 0;  // rows that run: each takes G work items of the workspace
  for (std::int64_t r = 0; r < rows.count(); ++r) {
    const std::int32_t slot = rows.slot(r);
    if (slot < 0 || cache.overflowed(slot)) continue;  // padding, or a slot skipped until reset_slots
    const std::int64_t n = rows.query_start(r + 1) - rows.query_start(r);
    active += n > 0 ? 1 : 0;
    for (std::int64_t g = 0; g < G; ++g)
      if (cache.length(slot, g) + n > s.capacity)
        return {StatusCode::kOutOfRange,
                kvmem::detail::concat("cache capacity: row ", r, " (slot ", slot, ", kv head ", g, ") needs room for ",
                                      cache.length(slot, g) + n, " rows (", cache.length(slot, g), " kept + ", n,
                                      " new tokens), got capacity ", s.capacity)};
  }
  return cache.check_workspace(active);
}

}  // namespace detail

namespace detail {
template <DecaySet Set, class Exec, class Storage, class Ev>
Status step_with(const Exec& exec, PrunedCache<Storage>& cache, const Rows& rows, const PackedInputs& in,
                 const Options& opt, const Ev& ev, TensorView<float, 3> out, TensorView<float, 2> lse) {
  KVMEM_RETURN_IF_ERROR(detail::validate_step(cache, rows, in, opt, out, lse));
  const CacheShape& s = cache.shape();
  const std::int64_t G = s.kv_heads, H = s.query_heads, D = s.head_dim, r = cache.group_size();
  std::int64_t* active = cache.row_list();  // rows that run, in order (workspace: steps do not allocate)
  std::int64_t n_active = 0, work = 0;
  for (std::int64_t row = 0; row < rows.count(); ++row) {
    const std::int64_t x0 = rows.query_start(row), x1 = rows.query_start(row + 1);
    if (rows.slot(row) < 0 || cache.overflowed(rows.slot(row))) {  // padding, or a slot skipped until reset
      for (std::int64_t x = x0; x < x1; ++x)
        for (std::int64_t h = 0; h < H; ++h) {
          for (std::int64_t d = 0; d < D; ++d) out(x, h, d) = 0.0f;
          if (!lse.empty()) lse(x, h) = 0.0f;
        }
      continue;
    }
    if (x1 == x0) continue;
    active[n_active++] = row;
    std::int64_t kept = 0;
    for (std::int64_t g = 0; g < G; ++g) kept += cache.length(rows.slot(row), g);
    work += H * D * (x1 - x0) * (kept / G + x1 - x0);
  }
  Launcher<Exec>::for_each(exec, n_active * G, work, [&](std::int64_t it) {
    const std::int64_t row = active[it / G], g = it % G;
    const std::int64_t slot = rows.slot(row), x0 = rows.query_start(row), T = rows.query_start(row + 1) - x0;
    const detail::ItemIO io = detail::item_io(in, out, lse, x0, T, g, r);
    if (T == 1)
      detail::decode_item<Set>(cache, slot, g, it, io, opt, ev);
    else
      detail::prefill_item<Set>(cache, slot, g, it, io, opt, ev);
  });
  for (std::int64_t a = 0; a < n_active; ++a) {
    const std::int64_t row = active[a], slot = rows.slot(row), x0 = rows.query_start(row);
    const std::int64_t T = rows.query_start(row + 1) - x0;
    if (!cache.overflowed(slot)) {
      cache.advance(slot, T);
      continue;
    }
    detail::finish_overflowed(cache, slot);  // every head's outputs zero, every page back
    for (std::int64_t g = 0; g < G; ++g) detail::zero_outputs(detail::item_io(in, out, lse, x0, T, g, r), r, D);
  }
  return Status::ok();
}
}  // namespace detail

// One step of a ragged batch of sequence slots (DESIGN.md 3, core/slots.hpp). Row r runs the tokens
// [query_start[r], query_start[r+1]) of the packed inputs for the sequence in slot[r], which advances by
// that many tokens; the caller rotates the row's token i at position cache.position(slot[r]) + i.
//  - 1 token: one decode step (spec UA.md 4.4, 4.5; Options::evict_before_attention applies), bitwise
//    equal to ua::decode of that sequence alone.
//  - more tokens: a chunked prefill that continues the slot's cache (spec UA.md 4.5), bitwise equal to
//    ua::prefill of that sequence alone: chunks of Options::prefill_chunk are counted from the row's
//    first token, the slot's kept entries take part like the survivors of an earlier chunk, and the
//    row ends with an eviction. A prompt fed in rows of whole chunks therefore gives the same cache and
//    outputs as one prefill call of the whole prompt.
//  - 0 tokens: the slot is not touched. A padding row (slot -1) is skipped.
// Output rows of padding rows are zeroed (lse too); every other output row is written.
// Page pool (ua/cache.hpp): a row whose slot found the pool dry in this step, or in an earlier one and
// was not reset since, gets zero outputs (and lse) and does not advance; the other rows are unaffected.
// Validation first: shapes, finiteness, options, the rows (core/slots.hpp: slots in range, each at most
// once), capacity per row (kept + tokens <= capacity for each kv head of the row's slot) and the
// workspace (at most its max_rows rows that run); on any error nothing changes. Slots named by no row
// are untouched, so a full slot refuses only calls that advance it. No allocation.
// out: [tokens,H,D]; lse: [tokens,H] natural log-sum-exp of each softmax row, or empty (not wanted).
template <DecaySet Set = decay::Universal, class Exec, class Storage>
Status step(const Exec& exec, PrunedCache<Storage>& cache, const Rows& rows, const PackedInputs& in, const Options& opt,
            TensorView<float, 3> out, TensorView<float, 2> lse = {}) {
  KVMEM_RETURN_IF_ERROR(detail::validate_options(opt));
  return detail::step_with<Set>(exec, cache, rows, in, opt, prune::Threshold{opt.p}.evictor(opt.layer), out, lse);
}
// With a prune policy `rule` (policy/prune.hpp) in place of Options::p, which must then be 0.
template <DecaySet Set = decay::Universal, PrunePolicy Rule, class Exec, class Storage>
Status step(const Exec& exec, PrunedCache<Storage>& cache, const Rows& rows, const PackedInputs& in, const Options& opt,
            const Rule& rule, TensorView<float, 3> out, TensorView<float, 2> lse = {}) {
  KVMEM_RETURN_IF_ERROR(detail::validate_rule(rule, opt));
  return detail::step_with<Set>(exec, cache, rows, in, opt, detail::evictor_of(rule, opt), out, lse);
}

// Whether a call with prune policy Rule compiles an eviction (the λ test, the compaction of evicted
// rows, a rule's cut kernels) on any backend: the type of the evictor that reaches the item bodies and
// kernels decides it, and prune::None's (NoEvictor) removes the eviction at compile time.
template <PrunePolicy Rule>
inline constexpr bool evicts_v =
    detail::kEvicts<decltype(detail::evictor_of(std::declval<const Rule&>(), std::declval<const Options&>()))>;

namespace detail {
// The threshold p a threshold-shaped prune policy applies at `layer` (None: 0, Threshold: p, PerLayer:
// p[layer]): what a backend whose eviction kernels take only Options::p can run.
constexpr double threshold_p(const prune::None&, std::int64_t) {
  return 0.0;
}
constexpr double threshold_p(const prune::Threshold& rule, std::int64_t) {
  return rule.p;
}
template <std::size_t L>
constexpr double threshold_p(const prune::PerLayer<L>& rule, std::int64_t layer) {
  return layer >= 0 && layer < std::int64_t(L) ? rule.p[layer] : 0.0;
}
template <class Rule>
concept ThresholdRule = requires(const Rule& rule) {
  threshold_p(rule, 0);
};

// A composed variant's call: the backend's overload that takes the prune policy when it has one (host,
// Kokkos); otherwise (the CUDA eviction kernels take ln p only) the policy's threshold as Options::p.
// The calls are unqualified, so argument-dependent lookup where ua::Attention is instantiated also
// finds the overloads a backend header included after this one declares.
template <class Rule>
Status threshold_options(const Rule& rule, Options& opt) {
  static_assert(ThresholdRule<Rule>,
                "kvmem::ua::Attention: this backend's UA eviction kernels take only a threshold (prune::None, "
                "prune::Threshold{p}, prune::PerLayer); prune::KeepTop and user prune rules run on the host and "
                "Kokkos backends");
  KVMEM_RETURN_IF_ERROR(validate_rule(rule, opt));
  opt.p = threshold_p(rule, opt.layer);
  return Status::ok();
}
//
// A variant with a fixed head dim first tries the backend's overload that takes HeadDims<HeadDim> before
// the executor (CUDA/HIP: only the kernels of that head dim are instantiated, core/support.hpp).
template <class Set, std::int64_t HeadDim, class Exec, class C, class In, class Rule, class Out>
Status attention_prefill(const Exec& exec, C& cache, const In& in, Options opt, const Rule& rule, Out out) {
  if constexpr (HeadDim != kAnyDim &&
                requires { prefill<Set>(HeadDims<HeadDim>{}, exec, cache, in, opt, rule, out); }) {
    return prefill<Set>(HeadDims<HeadDim>{}, exec, cache, in, opt, rule, out);
  } else if constexpr (requires { prefill<Set>(exec, cache, in, opt, rule, out); }) {
    return prefill<Set>(exec, cache, in, opt, rule, out);
  } else {
    KVMEM_RETURN_IF_ERROR(threshold_options(rule, opt));
    return prefill<Set>(exec, cache, in, opt, out);
  }
}
template <class Set, std::int64_t HeadDim, class Exec, class C, class In, class Rule, class Out>
Status attention_decode(const Exec& exec, C& cache, const In& in, Options opt, const Rule& rule, Out out) {
  if constexpr (HeadDim != kAnyDim && requires { decode<Set>(HeadDims<HeadDim>{}, exec, cache, in, opt, rule, out); }) {
    return decode<Set>(HeadDims<HeadDim>{}, exec, cache, in, opt, rule, out);
  } else if constexpr (requires { decode<Set>(exec, cache, in, opt, rule, out); }) {
    return decode<Set>(exec, cache, in, opt, rule, out);
  } else {
    KVMEM_RETURN_IF_ERROR(threshold_options(rule, opt));
    return decode<Set>(exec, cache, in, opt, out);
  }
}
template <class Set, std::int64_t HeadDim, class Exec, class C, class In, class Rule, class Out, class Lse>
Status attention_step(const Exec& exec, C& cache, const Rows& rows, const In& in, Options opt, const Rule& rule,
                      Out out, Lse lse) {
  if constexpr (HeadDim != kAnyDim &&
                requires { step<Set>(HeadDims<HeadDim>{}, exec, cache, rows, in, opt, rule, out, lse); }) {
    return step<Set>(HeadDims<HeadDim>{}, exec, cache, rows, in, opt, rule, out, lse);
  } else if constexpr (requires { step<Set>(exec, cache, rows, in, opt, rule, out, lse); }) {
    return step<Set>(exec, cache, rows, in, opt, rule, out, lse);
  } else {
    KVMEM_RETURN_IF_ERROR(threshold_options(rule, opt));
    return step<Set>(exec, cache, rows, in, opt, out, lse);
  }
}
}  // namespace detail

// Compile-time composition (DESIGN.md 2): a decay set, a prune policy value and a precision policy.
//   using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::Threshold{0.05}>;
//   Ua::Cache cache({B, H, G, D, capacity});
//   Ua::prefill(exec, cache, inputs, out);  Ua::decode(exec, cache, step_inputs, out1);
// The prune policy reaches the eviction of every item as a type (its evictor, policy/prune.hpp);
// prune::None compiles the eviction away. The functions take any cache the executor's backend runs
// (ua::PrunedCache on the host, kokkos::UaCache on Kokkos); the Options overloads pass the layer
// (Options::layer, for prune::PerLayer), the prefill chunk and the decode order (their p stays 0).
// HeadDim (default kAnyDim: chosen at run time) fixes the head dim: a cache of another head dim is
// refused, and a call on a backend whose kernels cannot take it does not compile (core/support.hpp).
template <DecaySet Set = decay::Universal, auto Prune = prune::None{},
          PrecisionPolicy Precision = precision::Fp32Storage, std::int64_t HeadDim = kAnyDim>
struct Attention {
  static constexpr auto kPrune = prune::checked<Prune>();
  static constexpr std::int64_t kHeadDim = HeadDim;
  static_assert(HeadDim >= 0, "kvmem::ua::Attention: the head dim is > 0 (or kAnyDim)");
  using prune_type = std::remove_cvref_t<decltype(kPrune)>;
  // Whether the variant's calls compile an eviction at all (evicts_v): false for prune::None.
  static constexpr bool kEvicts = evicts_v<prune_type>;
  using decay_set = Set;
  using storage_type = typename Precision::storage_type;
  using Cache = PrunedCache<storage_type>;
  static_assert(std::is_same_v<typename Precision::accumulate_type, float>,
                "kvmem::ua::Attention: the host UA path accumulates in fp32 (use the reference for fp64)");

  // The threshold p of a prune::Threshold variant (0 for every other policy).
  static constexpr double threshold() {
    if constexpr (std::is_same_v<prune_type, prune::Threshold>)
      return kPrune.p;
    else
      return 0.0;
  }
  static Options options(std::int64_t prefill_chunk = 128, bool evict_before_attention = true, std::int64_t layer = 0) {
    return Options{0.0, prefill_chunk, evict_before_attention, layer};
  }
  // Ok when `shape` has the variant's fixed head dim (any, for kAnyDim).
  static Status check_dims(const CacheShape& shape) {
    if (HeadDim != kAnyDim && shape.head_dim != HeadDim)
      return invalid_argument("head_dim", "the variant's head dim " + std::to_string(HeadDim), shape.head_dim);
    return Status::ok();
  }
  template <class Exec, class C>
  static Status check_call(const C& cache) {
    static_assert(check_ua_support<Exec, storage_type, HeadDim>());
    if constexpr (requires { cache.shape().head_dim; })
      return check_dims(cache.shape());
    else
      return check_dims(cache.shape);
  }
  // The inputs are float views on the host and Kokkos; a GPU cache takes its own input type (CUDA:
  // InputsOf<S>, bf16 for an fp8 cache).
  template <class Exec, class C, class In = float>
  static Status prefill(const Exec& exec, C& cache, const InputsOf<In>& in, TensorView<float, 4> out,
                        const Options& opt) {
    KVMEM_RETURN_IF_ERROR(check_call<Exec>(cache));
    return detail::attention_prefill<Set, HeadDim>(exec, cache, in, opt, kPrune, out);
  }
  template <class Exec, class C, class In = float>
  static Status prefill(const Exec& exec, C& cache, const InputsOf<In>& in, TensorView<float, 4> out,
                        std::int64_t prefill_chunk = 128, bool evict_before_attention = true) {
    return prefill(exec, cache, in, out, options(prefill_chunk, evict_before_attention));
  }
  template <class Exec, class C, class In = float>
  static Status decode(const Exec& exec, C& cache, const InputsOf<In>& in, TensorView<float, 4> out,
                       const Options& opt) {
    KVMEM_RETURN_IF_ERROR(check_call<Exec>(cache));
    return detail::attention_decode<Set, HeadDim>(exec, cache, in, opt, kPrune, out);
  }
  template <class Exec, class C, class In = float>
  static Status decode(const Exec& exec, C& cache, const InputsOf<In>& in, TensorView<float, 4> out,
                       bool evict_before_attention = true) {
    return decode(exec, cache, in, out, options(128, evict_before_attention));
  }
  template <class Exec, class C, class In = float>
  static Status step(const Exec& exec, C& cache, const Rows& rows, const PackedInputsOf<In>& in,
                     TensorView<float, 3> out, TensorView<float, 2> lse, const Options& opt) {
    KVMEM_RETURN_IF_ERROR(check_call<Exec>(cache));
    return detail::attention_step<Set, HeadDim>(exec, cache, rows, in, opt, kPrune, out, lse);
  }
  template <class Exec, class C, class In = float>
  static Status step(const Exec& exec, C& cache, const Rows& rows, const PackedInputsOf<In>& in,
                     TensorView<float, 3> out, TensorView<float, 2> lse = {}, std::int64_t prefill_chunk = 128,
                     bool evict_before_attention = true) {
    return step(exec, cache, rows, in, out, lse, options(prefill_chunk, evict_before_attention));
  }
  template <class Exec>
  static Status forward(const Exec& exec, const Inputs& in, TensorView<float, 4> out, TensorView<float, 3> lse = {},
                        TensorView<float, 3> lambda_last = {}) {
    static_assert(check_ua_support<Exec, HeadDim>());
    if (HeadDim != kAnyDim && in.q.extent(3) != HeadDim)
      return invalid_argument("q head dim (dim 3)", "the variant's head dim " + std::to_string(HeadDim),
                              in.q.extent(3));
    return ua::forward<Set>(exec, in, out, lse, lambda_last);
  }
};

}  // namespace kvmem::ua
