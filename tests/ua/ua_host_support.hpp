// SPDX-License-Identifier: Apache-2.0
#pragma once
// Runs a reference Case (fp64 vectors) through the host backend in fp32: float copies of the inputs,
// strided views of token ranges, and the three runs the goldens define (dense forward, token-by-token
// decode, chunked prefill + pruned decode).

#include <cstdint>
#include <vector>

#include "kvmem/backend/host/ua.hpp"
#include "ua_test_support.hpp"

namespace kvmem::test::ua {

struct FloatCase {
  ref::Config c;
  std::vector<float> q, k, v, z_k, z_q, z_o;

  explicit FloatCase(const Case& x) : c(x.config) {
    auto cvt = [](const std::vector<double>& in) { return std::vector<float>(in.begin(), in.end()); };
    q = cvt(x.inputs.q);
    k = cvt(x.inputs.k);
    v = cvt(x.inputs.v);
    z_k = cvt(x.inputs.z_k);
    z_q = cvt(x.inputs.z_q);
    z_o = cvt(x.inputs.z_o);
  }

  // Views of tokens [t0, t1) of every sequence (strides of the full tensors).
  [[nodiscard]] kvmem::ua::Inputs slice(std::int64_t t0, std::int64_t t1) const {
    const std::int64_t B = c.B, H = c.H, G = c.G, T = c.T, D = c.D, n = t1 - t0;
    kvmem::ua::Inputs in;
    in.q = {q.data() + t0 * D, {B, H, n, D}, {H * T * D, T * D, D, 1}};
    in.k = {k.data() + t0 * D, {B, G, n, D}, {G * T * D, T * D, D, 1}};
    in.v = {v.data() + t0 * D, {B, G, n, D}, {G * T * D, T * D, D, 1}};
    in.z_k = {z_k.data() + t0, {B, G, n}, {G * T, T, 1}};
    in.z_q = {z_q.data() + t0, {B, G, n}, {G * T, T, 1}};
    if (!z_o.empty()) in.z_o = {z_o.data() + t0 * H * D, {B, n, H, D}, {T * H * D, H * D, D, 1}};
    return in;
  }
  [[nodiscard]] TensorView<float, 4> out_slice(std::vector<float>& out, std::int64_t t0, std::int64_t t1) const {
    const std::int64_t H = c.H, T = c.T, D = c.D;
    return {out.data() + t0 * H * D, {c.B, t1 - t0, H, D}, {T * H * D, H * D, D, 1}};
  }
  [[nodiscard]] std::vector<float> make_out() const {
    return std::vector<float>(static_cast<std::size_t>(c.B * c.T * c.H * c.D), 0.0f);
  }
  [[nodiscard]] kvmem::ua::CacheShape cache_shape(std::int64_t capacity = -1) const {
    return {c.B, c.H, c.G, c.D, capacity < 0 ? c.T : capacity, 16};
  }
};

struct HostDense {
  std::vector<float> out, lse, lambda_last;
};

inline HostDense host_forward(const FloatCase& f, int threads = 2) {
  HostDense r;
  r.out = f.make_out();
  r.lse.assign(static_cast<std::size_t>(f.c.B * f.c.H * f.c.T), 0.0f);
  r.lambda_last.assign(static_cast<std::size_t>(f.c.B * f.c.G * f.c.T), 0.0f);
  const Status s = kvmem::ua::forward(kvmem::host::Executor{threads}, f.slice(0, f.c.T), f.out_slice(r.out, 0, f.c.T),
                                      TensorView<float, 3>(r.lse.data(), {f.c.B, f.c.H, f.c.T}),
                                      TensorView<float, 3>(r.lambda_last.data(), {f.c.B, f.c.G, f.c.T}));
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  return r;
}

// Chunked prefill of [0, split) then decode of [split, T), all with options `opt`.
template <class Storage = float>
std::vector<float> host_prefill_decode(const FloatCase& f, std::int64_t split, const kvmem::ua::Options& opt,
                                       kvmem::ua::PrunedCache<Storage>& cache, int threads = 2) {
  std::vector<float> out = f.make_out();
  const kvmem::host::Executor exec{threads};
  if (split > 0) {
    const Status s = kvmem::ua::prefill(exec, cache, f.slice(0, split), opt, f.out_slice(out, 0, split));
    INFO(s.to_string());
    REQUIRE(s.is_ok());
  }
  for (std::int64_t t = split; t < f.c.T; ++t) {
    const Status s = kvmem::ua::decode(exec, cache, f.slice(t, t + 1), opt, f.out_slice(out, t, t + 1));
    INFO(s.to_string());
    REQUIRE(s.is_ok());
  }
  return out;
}

// Cache membership [B,G,T] as 0/1 (positions of the entries).
template <class Storage>
std::vector<std::int64_t> kept_mask(const kvmem::ua::PrunedCache<Storage>& cache, std::int64_t T) {
  const auto& s = cache.shape();
  std::vector<std::int64_t> kept(static_cast<std::size_t>(s.batch * s.kv_heads * T), 0);
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t g = 0; g < s.kv_heads; ++g)
      for (std::int64_t e = 0; e < cache.length(b, g); ++e)
        kept[static_cast<std::size_t>((b * s.kv_heads + g) * T + cache.positions(b, g)[e])] = 1;
  return kept;
}

}  // namespace kvmem::test::ua
