// SPDX-License-Identifier: Apache-2.0
#pragma once
// Runs a UA reference Case through the Kokkos backend: the float inputs of tests/ua's FloatCase are
// copied into Kokkos::Views of the space's memory, token ranges are strided tensor views of those
// Views, and the cache is a kokkos::UaCache. Results come back as host vectors.

#include <cstdint>
#include <vector>

#include <Kokkos_Core.hpp>

#include "kvm_kokkos_util.hpp"
#include "kvmem/backend/kokkos.hpp"
#include "ua/ua_host_support.hpp"

namespace kvmem::test::ua {

using KokkosUaCache = kvmem::kokkos::UaCache<float, KokkosSpace::memory_space>;

struct KokkosCase {
  const FloatCase& f;
  Kokkos::View<float*, KokkosSpace::memory_space> q, k, v, z_k, z_q, z_o;

  explicit KokkosCase(const FloatCase& fc)
      : f(fc),
        q(to_device(fc.q, fc.q.size())),
        k(to_device(fc.k, fc.k.size())),
        v(to_device(fc.v, fc.v.size())),
        z_k(to_device(fc.z_k, fc.z_k.size())),
        z_q(to_device(fc.z_q, fc.z_q.size())) {
    if (!fc.z_o.empty()) z_o = to_device(fc.z_o, fc.z_o.size());
  }

  // FloatCase::slice with the same strides over the device copies.
  [[nodiscard]] kvmem::ua::Inputs slice(std::int64_t t0, std::int64_t t1) const {
    kvmem::ua::Inputs host = f.slice(t0, t1);
    const auto rebase = [&](auto view, const std::vector<float>& from, const auto& to) {
      using V = decltype(view);
      return V(to.data() + (view.data() - from.data()), view.extents(), view.strides());
    };
    kvmem::ua::Inputs in;
    in.q = rebase(host.q, f.q, q);
    in.k = rebase(host.k, f.k, k);
    in.v = rebase(host.v, f.v, v);
    in.z_k = rebase(host.z_k, f.z_k, z_k);
    in.z_q = rebase(host.z_q, f.z_q, z_q);
    if (!f.z_o.empty()) in.z_o = rebase(host.z_o, f.z_o, z_o);
    return in;
  }
  [[nodiscard]] Kokkos::View<float*, KokkosSpace::memory_space> make_out() const {
    return Kokkos::View<float*, KokkosSpace::memory_space>("kvmem test ua out", f.make_out().size());
  }
  [[nodiscard]] kvmem::TensorView<float, 4> out_slice(const Kokkos::View<float*, KokkosSpace::memory_space>& out,
                                                      std::int64_t t0, std::int64_t t1) const {
    const std::int64_t H = f.c.H, T = f.c.T, D = f.c.D;
    return {out.data() + t0 * H * D, {f.c.B, t1 - t0, H, D}, {T * H * D, H * D, D, 1}};
  }
};

inline KokkosUaCache make_kokkos_cache(const KokkosExec& exec, const FloatCase& f, std::int64_t capacity = -1) {
  KokkosUaCache cache;
  const auto s = kvmem::kokkos::create_cache<float>(exec, f.cache_shape(capacity), cache);
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  return cache;
}

inline HostDense kokkos_forward(const FloatCase& f, const KokkosExec& exec = {}) {
  const KokkosCase kc(f);
  const auto out = kc.make_out();
  Kokkos::View<float***, Kokkos::LayoutRight, KokkosSpace::memory_space> lse("lse", f.c.B, f.c.H, f.c.T);
  Kokkos::View<float***, Kokkos::LayoutRight, KokkosSpace::memory_space> lam("lambda_last", f.c.B, f.c.G, f.c.T);
  const Status s = kvmem::ua::forward(exec, kc.slice(0, f.c.T), kc.out_slice(out, 0, f.c.T),
                                      kvmem::kokkos::to_tensor_view(lse), kvmem::kokkos::to_tensor_view(lam));
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  return {to_host(out), to_host(lse), to_host(lam)};
}

// Chunked prefill of [0, split) then decode of [split, T) (ua::prefill / ua::decode on `exec`).
inline std::vector<float> kokkos_prefill_decode(const FloatCase& f, std::int64_t split, const kvmem::ua::Options& opt,
                                                KokkosUaCache& cache, const KokkosExec& exec = {}) {
  const KokkosCase kc(f);
  const auto out = kc.make_out();
  if (split > 0) {
    const Status s = kvmem::ua::prefill(exec, cache, kc.slice(0, split), opt, kc.out_slice(out, 0, split));
    INFO(s.to_string());
    REQUIRE(s.is_ok());
  }
  for (std::int64_t t = split; t < f.c.T; ++t) {
    const Status s = kvmem::ua::decode(exec, cache, kc.slice(t, t + 1), opt, kc.out_slice(out, t, t + 1));
    INFO(s.to_string());
    REQUIRE(s.is_ok());
  }
  exec.space.fence();
  return to_host(out);
}

// Cache membership [B,G,T] as 0/1, as kept_mask() of tests/ua.
inline std::vector<std::int64_t> kokkos_kept_mask(const KokkosUaCache& cache, std::int64_t T) {
  const auto snap = kvmem::kokkos::snapshot(cache);
  const auto& s = cache.shape;
  std::vector<std::int64_t> kept(static_cast<std::size_t>(s.batch * s.kv_heads * T), 0);
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t g = 0; g < s.kv_heads; ++g)
      for (std::int64_t e = 0; e < snap.length_of(b, g); ++e)
        kept[static_cast<std::size_t>((b * s.kv_heads + g) * T + snap.positions(b, g)[e])] = 1;
  return kept;
}

}  // namespace kvmem::test::ua
