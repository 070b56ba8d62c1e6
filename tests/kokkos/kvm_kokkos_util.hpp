// SPDX-License-Identifier: Apache-2.0
#pragma once
// Runs a reference-style KVM problem (rkvm::Config + Inputs) through the Kokkos backend: inputs are
// copied into Kokkos::Views of the execution space's memory and passed as tensor views of those Views
// (to_tensor_view), the state lives in a Kokkos allocation (create_state), and results come back in the
// layout of tests/kvm's HostResult so the host suite's comparisons apply unchanged.

#include <cstdint>
#include <stdexcept>
#include <vector>

#include <Kokkos_Core.hpp>

#include "kvm/kvm_host_util.hpp"
#include "kvmem/backend/kokkos.hpp"

namespace kvmem::test {

using KokkosSpace = Kokkos::DefaultExecutionSpace;
using KokkosExec = kvmem::kokkos::Executor<KokkosSpace>;
template <class S>
using KokkosKvmState = kvmem::kokkos::KvmState<S, float, kvmem::kokkos::state_memory_space<KokkosSpace>>;

// A team size above 1 that the default execution space runs, so one item's work is shared by several
// threads (OpenMP: up to the pool's threads; Cuda: two warps), or 1 where teams have one thread (Serial).
inline int wide_team_size() {
  const int threads = KokkosSpace().concurrency();
  return threads >= 64 ? 64 : threads;
}

template <class T, std::size_t N>
struct AddPointers {
  using type = typename AddPointers<T*, N - 1>::type;
};
template <class T>
struct AddPointers<T, 0> {
  using type = T;
};

// A host vector copied into a View of the space's memory with the given extents (LayoutRight).
template <class T, class... Extent>
auto to_device(const std::vector<T>& host, Extent... extents) {
  using DataType = typename AddPointers<T, sizeof...(Extent)>::type;
  Kokkos::View<DataType, Kokkos::LayoutRight, KokkosSpace::memory_space> view("kvmem test tensor",
                                                                              std::size_t(extents)...);
  auto mirror = Kokkos::create_mirror_view(view);
  // No Catch2 macro here: the concurrency test calls this from two threads (Catch2 is not thread-safe).
  if (std::size_t(mirror.span()) != host.size())
    throw std::invalid_argument("to_device: extents do not match the data");
  for (std::size_t i = 0; i < host.size(); ++i) mirror.data()[i] = host[i];
  Kokkos::deep_copy(view, mirror);
  return view;
}

template <class View>
std::vector<typename View::non_const_value_type> to_host(const View& view) {
  auto mirror = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), view);
  return std::vector<typename View::non_const_value_type>(mirror.data(), mirror.data() + mirror.span());
}

// Feeds tokens [t0, t1) through kvm::prefill on `exec`; out_full [B,T,Hq,Dv] receives their rows.
template <class S>
kvmem::Status kokkos_feed(const KokkosExec& exec, kvmem::kvm::State<S, float>& st, const rkvm::Config& c,
                          const rkvm::Inputs& in, const FloatWeights& w, std::int64_t t0, std::int64_t t1,
                          std::vector<float>& out_full, const std::int64_t* lengths = nullptr,
                          kvmem::kvm::RouteLog* log = nullptr) {
  const std::int64_t n = t1 - t0;
  const auto q = to_device(in.q.empty() ? std::vector<float>(std::size_t(c.B * c.Hq * n * c.D), 0.0f)
                                        : slice_tokens(in.q, c.B * c.Hq, c.T, c.D, t0, t1),
                           c.B, c.Hq, n, c.D);
  const auto k = to_device(slice_tokens(in.k, c.B * c.Hk, c.T, c.D, t0, t1), c.B, c.Hk, n, c.D);
  const auto v = to_device(slice_tokens(in.v, c.B * c.Hk, c.T, c.Dv, t0, t1), c.B, c.Hk, n, c.Dv);
  const auto g = to_device(slice_tokens(in.gate, c.B * c.Hk, c.T, 1, t0, t1), c.B, c.Hk, n);
  const auto lw = to_device(w.w, c.D), lb = to_device(w.b, c.D), ts = to_device(w.ts, c.Hq), tw = to_device(w.tw, c.Hq);
  const auto out = to_device(std::vector<float>(std::size_t(c.B * n * c.Hq * c.Dv), -7.0f), c.B, n, c.Hq, c.Dv);
  using kvmem::TensorView;
  using kvmem::kokkos::to_tensor_view;
  const kvmem::kvm::Weights weights{
      TensorView<const float, 1>(to_tensor_view(lw)), TensorView<const float, 1>(to_tensor_view(lb)),
      TensorView<const float, 1>(to_tensor_view(ts)), TensorView<const float, 1>(to_tensor_view(tw))};
  const kvmem::Status s =
      kvmem::kvm::prefill(exec, st, weights, TensorView<const float, 4>(to_tensor_view(q)),
                          TensorView<const float, 4>(to_tensor_view(k)), TensorView<const float, 4>(to_tensor_view(v)),
                          TensorView<const float, 3>(to_tensor_view(g)), to_tensor_view(out), lengths, log);
  if (!s.is_ok()) return s;
  exec.space.fence();
  const auto o = to_host(out);
  out_full.resize(std::size_t(c.B * c.T * c.Hq * c.Dv), 0.0f);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t i = 0; i < c.Hq * c.Dv; ++i)
        out_full[std::size_t(((b * c.T + t0 + t) * c.Hq) * c.Dv + i)] = o[std::size_t((b * n + t) * c.Hq * c.Dv + i)];
  return s;
}

template <class S>
KokkosKvmState<S> make_kokkos_state(const KokkosExec& exec, const rkvm::Config& c) {
  KokkosKvmState<S> st;
  const auto status = kvmem::kokkos::create_state<S, float>(exec, to_params(c), to_shape(c, c.T), st);
  INFO(status.to_string());
  REQUIRE(status.is_ok());
  return st;
}

template <class S>
HostResult kokkos_prefill(const rkvm::Config& c, const rkvm::Inputs& in, const KokkosExec& exec = {}) {
  auto st = make_kokkos_state<S>(exec, c);
  const FloatWeights w(in);
  HostResult r;
  kvmem::kvm::RouteLog log;
  const auto status = kokkos_feed(exec, st.state, c, in, w, 0, c.T, r.out, nullptr, &log);
  INFO(status.to_string());
  REQUIRE(status.is_ok());
  extract_state(st.state, c, r);  // the state's memory is host-accessible (create_state requires it)
  extract_routes(log, c, r);
  return r;
}

// Prefill [0, split), then one one-token call per later token (what kvm::decode runs).
template <class S>
std::vector<float> kokkos_prefill_then_decode(const rkvm::Config& c, const rkvm::Inputs& in, std::int64_t split,
                                              HostResult* final_state = nullptr, const KokkosExec& exec = {}) {
  auto st = make_kokkos_state<S>(exec, c);
  const FloatWeights w(in);
  std::vector<float> out;
  kvmem::kvm::RouteLog log;
  if (split > 0) REQUIRE(kokkos_feed(exec, st.state, c, in, w, 0, split, out, nullptr, &log).is_ok());
  for (std::int64_t t = split; t < c.T; ++t)
    REQUIRE(kokkos_feed(exec, st.state, c, in, w, t, t + 1, out, nullptr, &log).is_ok());
  if (final_state != nullptr) {
    extract_state(st.state, c, *final_state);
    extract_routes(log, c, *final_state);
  }
  return out;
}

}  // namespace kvmem::test
