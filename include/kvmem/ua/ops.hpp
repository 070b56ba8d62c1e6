// SPDX-License-Identifier: Apache-2.0
#pragma once
// Universal Attention operations (spec UA.md 2, 4): prefill into a PrunedCache (chunked, evicting at
// chunk ends), decode one token, and forward (dense, no cache: output + lse + lambda_last for
// training-style use). Every operation takes the executor first, validates everything (shapes,
// NaN/Inf, threshold, chunk, capacity) before it touches the cache, and runs one (sequence, kv head)
// item per worker through the backend's Launcher (backend/host/ua.hpp for kvmem::host::Executor).
//
// Runtime configuration: Options{p, prefill_chunk, evict_before_attention}; p = 0 is dense UA
// (prune::None) with the same API. Compile-time composition: ua::Attention<DecaySet, Prune, Precision>.

#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "kvmem/core/math.hpp"
#include "kvmem/core/status.hpp"
#include "kvmem/core/tensor.hpp"
#include "kvmem/kernel/ua_attend.hpp"
#include "kvmem/kernel/ua_decay.hpp"
#include "kvmem/kernel/ua_evict.hpp"
#include "kvmem/policy/decay.hpp"
#include "kvmem/policy/precision.hpp"
#include "kvmem/policy/prune.hpp"
#include "kvmem/ua/cache.hpp"

namespace kvmem::ua {

// Runtime options (spec UA.md 3).
struct Options {
  double p = 0.0;                      // eviction threshold, evict iff λ < ln p; 0 = never (dense)
  std::int64_t prefill_chunk = 128;    // P: prefill evicts at the end of each chunk
  bool evict_before_attention = true;  // decode order: λ update, append, evict, attend (false: evict last)

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

// Customisation point: a backend specialises Launcher<Executor> with
//   template <class Body> static void for_each(const Executor&, std::int64_t items, std::int64_t work, Body&& body);
// running body(item) once for every (sequence, kv head) item; `work` is a rough multiply-add count of
// the whole call, so a backend can run small calls (a decode step over a pruned cache) inline instead
// of paying for a launch. ua/ knows no backend (DESIGN.md 1).
template <class Exec>
struct Launcher {
  static_assert(sizeof(Exec) == 0,
                "kvmem::ua: no UA backend for this executor; include kvmem/backend/host/ua.hpp for kvmem::host::Executor");
};

namespace detail {

template <std::size_t Rank>
Status check_finite(const TensorView<const float, Rank>& view, const char* name) {
  bool ok = true;
  if constexpr (Rank == 3) {
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

inline double log_threshold(double p) { return prune::Threshold{p}.log_threshold(); }

template <class Storage>
void append_row(typename PrunedCache<Storage>::ItemView& v, std::int64_t row, const Inputs& in, std::int64_t b,
                std::int64_t g, std::int64_t t, std::int64_t pos, std::int64_t D) {
  kernel::ua::append_entry(v.keys, v.values, v.lambda, v.key_logit, v.pos, row, &in.k(b, g, t, 0), &in.v(b, g, t, 0),
                           in.z_k(b, g, t), pos, D);
}

// BlockArgs for query tokens [t0, t1) of the call for (b, g), over `n` cache-like entries.
template <class KS>
kernel::ua::BlockArgs<KS, float, float, float> block_args(const Inputs& in, TensorView<float, 4> out, std::int64_t b,
                                                           std::int64_t g, std::int64_t r, std::int64_t t0,
                                                           std::int64_t t1) {
  kernel::ua::BlockArgs<KS, float, float, float> a;
  a.D = in.q.extent(3);
  a.heads = r;
  a.rows = t1 - t0;
  a.new_keys = &in.k(b, g, t0, 0);
  a.new_key_stride = in.k.stride(2);
  a.query_logit = &in.z_q(b, g, t0);
  a.query_logit_stride = in.z_q.stride(2);
  a.q = &in.q(b, g * r, t0, 0);
  a.q_head_stride = in.q.stride(1);
  a.q_row_stride = in.q.stride(2);
  if (!in.z_o.empty()) {
    a.z_o = &in.z_o(b, t0, g * r, 0);
    a.z_o_row_stride = in.z_o.stride(1);
    a.z_o_head_stride = in.z_o.stride(2);
  }
  a.out = &out(b, t0, g * r, 0);
  a.out_row_stride = out.stride(1);
  a.out_head_stride = out.stride(2);
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
  a.n = n;
  a.workspace = v.workspace;
  return a;
}

// Chunked prefill of one (b, g) item (spec UA.md 4.5): per chunk, append the chunk's keys, attend
// (survivors + chunk keys t0..i with exact Λ), move λ to the chunk end, evict λ < ln p.
template <class Set, class Storage>
void prefill_item(PrunedCache<Storage>& cache, std::int64_t b, std::int64_t g, const Inputs& in, const Options& opt,
                  TensorView<float, 4> out) {
  auto v = cache.item_view(b, g);
  const std::int64_t D = in.q.extent(3), T = in.q.extent(2), r = cache.group_size();
  const std::int64_t first = cache.position(b);
  const double log_p = log_threshold(opt.p);
  std::int64_t n = *v.length, peak = n;
  for (std::int64_t t0 = 0; t0 < T; t0 += opt.prefill_chunk) {
    const std::int64_t t1 = t0 + opt.prefill_chunk < T ? t0 + opt.prefill_chunk : T;
    for (std::int64_t t = t0; t < t1; ++t) append_row<Storage>(v, n + (t - t0), in, b, g, t, first + t, D);
    n += t1 - t0;
    peak = n > peak ? n : peak;
    auto a = with_cache<Storage>(block_args<Storage>(in, out, b, g, r, t0, t1), v, n);
    a.through = first + t0 - 1;  // survivors hold Λ_{first+t0-1}; the chunk keys hold 0
    a.first = first + t0;
    kernel::ua::attend_block<Set>(a);
    if (log_p > -std::numeric_limits<double>::infinity())
      n = kernel::ua::evict_and_compact(v.keys, v.values, D, v.lambda, v.key_logit, v.pos, n, D, log_p);
  }
  *v.length = n;
  *v.peak = peak;
}

// One decode step of one (b, g) item (spec UA.md 4.4, 4.5).
template <class Set, class Storage>
void decode_item(PrunedCache<Storage>& cache, std::int64_t b, std::int64_t g, const Inputs& in, const Options& opt,
                 TensorView<float, 4> out) {
  auto v = cache.item_view(b, g);
  const std::int64_t D = in.q.extent(3), r = cache.group_size();
  const std::int64_t t = cache.position(b);
  const double log_p = log_threshold(opt.p);
  const bool prunes = log_p > -std::numeric_limits<double>::infinity();
  std::int64_t n = *v.length;
  // 1. λ_j += A_jt for every cached entry
  kernel::ua::lambda_update<Set, float>(v.keys, D, v.key_logit, v.pos, v.lambda, n, &in.k(b, g, 0, 0), in.z_q(b, g, 0), t, D);
  // 2. append t with λ = 0
  append_row<Storage>(v, n, in, b, g, 0, t, D);
  ++n;
  const std::int64_t peak = n;
  // 3. evict (default order), 4. attend with bias λ, or evict afterwards
  if (prunes && opt.evict_before_attention)
    n = kernel::ua::evict_and_compact(v.keys, v.values, D, v.lambda, v.key_logit, v.pos, n, D, log_p);
  auto a = with_cache<Storage>(block_args<Storage>(in, out, b, g, r, 0, 1), v, n);
  a.through = t;  // λ already includes A_{., t}
  a.first = t;
  kernel::ua::attend_block<Set>(a);
  if (prunes && !opt.evict_before_attention)
    n = kernel::ua::evict_and_compact(v.keys, v.values, D, v.lambda, v.key_logit, v.pos, n, D, log_p);
  *v.length = n;
  *v.peak = peak;
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
  // Prefill needs room for everything it may append before evicting; a conservative bound that does
  // not depend on the data (feed long prompts chunk by chunk to keep the cache small).
  const std::int64_t need = cache.max_length() + T;
  if (need > s.capacity)
    return {StatusCode::kOutOfRange,
            kvmem::detail::concat("cache capacity: expected room for ", need, " rows per (sequence, kv head) (longest ",
                                  cache.max_length(), " + ", T, " new tokens), got capacity ", s.capacity)};
  return Status::ok();
}

}  // namespace detail

// Prefill T tokens of every sequence into the cache (spec UA.md 4.5) and write their outputs.
// The caller rotates token t of sequence b at position cache.position(b) + t. Needs
// longest cache + T <= capacity (checked up front; eviction is data-dependent): to keep the cache
// small, feed a long prompt in calls of prefill_chunk tokens, which gives the same result as one call.
// out: [B,T,H,D]
template <DecaySet Set = decay::Universal, class Exec, class Storage>
Status prefill(const Exec& exec, PrunedCache<Storage>& cache, const Inputs& in, const Options& opt,
               TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_cache_call(cache, in, opt, out, false));
  const CacheShape& s = cache.shape();
  const std::int64_t T = in.q.extent(2);
  const std::int64_t work = s.batch * s.query_heads * s.head_dim * T * (cache.max_length() + T);
  Launcher<Exec>::for_each(exec, s.batch * s.kv_heads, work, [&](std::int64_t it) {
    detail::prefill_item<Set>(cache, it / s.kv_heads, it % s.kv_heads, in, opt, out);
  });
  for (std::int64_t b = 0; b < s.batch; ++b) cache.advance(b, in.q.extent(2));
  return Status::ok();
}

// Decode one token per sequence (T = 1) at position cache.position(b) (spec UA.md 4.4, 4.5).
// out: [B,1,H,D]
template <DecaySet Set = decay::Universal, class Exec, class Storage>
Status decode(const Exec& exec, PrunedCache<Storage>& cache, const Inputs& in, const Options& opt,
              TensorView<float, 4> out) {
  KVMEM_RETURN_IF_ERROR(detail::validate_cache_call(cache, in, opt, out, true));
  const CacheShape& s = cache.shape();
  std::int64_t entries = 0;
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t g = 0; g < s.kv_heads; ++g) entries += cache.length(b, g) + 1;
  const std::int64_t work = entries * s.head_dim * (cache.group_size() + 1);
  Launcher<Exec>::for_each(exec, s.batch * s.kv_heads, work, [&](std::int64_t it) {
    detail::decode_item<Set>(cache, it / s.kv_heads, it % s.kv_heads, in, opt, out);
  });
  for (std::int64_t b = 0; b < s.batch; ++b) cache.advance(b, 1);
  return Status::ok();
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
    auto a = detail::block_args<float>(in, out, b, g, r, 0, T);
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

// Compile-time composition (DESIGN.md 2): a decay set, a prune policy value and a precision policy.
//   using Ua = kvmem::ua::Attention<kvmem::decay::Universal, kvmem::prune::Threshold{0.05}>;
//   Ua::Cache cache({B, H, G, D, capacity});
//   Ua::prefill(exec, cache, inputs, out);  Ua::decode(exec, cache, step_inputs, out1);
template <DecaySet Set = decay::Universal, auto Prune = prune::None{}, PrecisionPolicy Precision = precision::Fp32Storage>
struct Attention {
  static constexpr auto kPrune = prune::checked<Prune>();
  using decay_set = Set;
  using storage_type = typename Precision::storage_type;
  using Cache = PrunedCache<storage_type>;
  static_assert(std::is_same_v<typename Precision::accumulate_type, float>,
                "kvmem::ua::Attention: the host UA path accumulates in fp32 (use the reference for fp64)");

  static constexpr double threshold() {
    if constexpr (std::remove_cvref_t<decltype(kPrune)>::kEnabled) return kPrune.p;
    else return 0.0;
  }
  static Options options(std::int64_t prefill_chunk = 128, bool evict_before_attention = true) {
    return Options{threshold(), prefill_chunk, evict_before_attention};
  }
  template <class Exec>
  static Status prefill(const Exec& exec, Cache& cache, const Inputs& in, TensorView<float, 4> out,
                        std::int64_t prefill_chunk = 128, bool evict_before_attention = true) {
    return ua::prefill<Set>(exec, cache, in, options(prefill_chunk, evict_before_attention), out);
  }
  template <class Exec>
  static Status decode(const Exec& exec, Cache& cache, const Inputs& in, TensorView<float, 4> out,
                       bool evict_before_attention = true) {
    return ua::decode<Set>(exec, cache, in, options(128, evict_before_attention), out);
  }
  template <class Exec>
  static Status forward(const Exec& exec, const Inputs& in, TensorView<float, 4> out, TensorView<float, 3> lse = {},
                        TensorView<float, 3> lambda_last = {}) {
    return ua::forward<Set>(exec, in, out, lse, lambda_last);
  }
};

}  // namespace kvmem::ua
