// SPDX-License-Identifier: Apache-2.0
#pragma once
// Runs a reference-style KVM problem (rkvm::Config + Inputs) through the Kokkos backend: inputs are
// copied into Kokkos::Views of the execution space's memory and passed as tensor views of those Views
// (to_tensor_view), the state lives in a Kokkos allocation (create_state), and results come back in the
// layout of tests/kvm's HostResult so the host suite's comparisons apply unchanged.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
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

// Whether the Kokkos kernels run the host backend's arithmetic. On a host execution space (Serial,
// OpenMP, Threads) the host compiler builds the same kernel bodies with the same operand order as the
// host backend, so results are bitwise equal to its. A device space (Cuda, HIP) runs the bodies as the
// device compiler builds them: it contracts a * b + c into fused multiply-adds and brings its own
// expf, logf and log1pf (an ulp or two from the host's libm). There results agree with the host
// backend and the fp64 reference within DESIGN.md 5's tolerances, not bitwise; a device run still
// gives the same bits when repeated and for every team size (the same instructions in the same order).
// A host space built with KVMEM_KOKKOS_DEVICE_ORDER runs the device spaces' order (executor.hpp) and is
// compared as a device space.
inline constexpr bool kHostArithmetic =
    std::is_same_v<KokkosSpace, Kokkos::DefaultHostExecutionSpace> && kvmem::kokkos::detail::kHostOrder<KokkosSpace>;

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Max |a - b| over max(1, max |b|) (support/golden.hpp's measure), where equal values, infinities and
// NaNs included, differ by 0 and one non-finite value against another value by infinity.
template <class T>
Deviation deviation_as_host(const std::vector<T>& a, const std::vector<T>& b) {
  Deviation d;
  if (a.size() != b.size()) {
    d.max_abs = INFINITY;
    return d;
  }
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double x = double(a[i]), y = double(b[i]);
    if (std::isfinite(y)) d.scale = std::max(d.scale, std::abs(y));
    if (x == y || (std::isnan(x) && std::isnan(y))) continue;
    const double diff = std::abs(x - y);
    d.max_abs = std::isfinite(diff) ? std::max(d.max_abs, diff) : INFINITY;
  }
  return d;
}

// One line per device-space comparison with the host backend ("as-host: <what> relative <r> max-abs <m>"),
// so a run shows how far the device's arithmetic moved the results, not only that they passed.
inline void print_deviation(const std::string& what, const Deviation& d) {
  std::printf("as-host: %s relative %.3g max-abs %.3g\n", what.c_str(), d.relative(), d.max_abs);
}

// A Kokkos result against the host backend's: the same bits on a host space, within `tol` of
// deviation_as_host on a device space (DESIGN.md 5: 1e-5 for fp32 paths, 1e-2 where keys and values
// are stored in bf16).
#define KVMEM_KOKKOS_CHECK_AS_HOST(kokkos, host, tol)                                                        \
  do {                                                                                                       \
    const auto& kvmem_kokkos_ = (kokkos);                                                                    \
    const auto& kvmem_host_ = (host);                                                                        \
    if constexpr (::kvmem::test::kHostArithmetic) {                                                          \
      INFO(#kokkos " vs " #host ": the same bits (host arithmetic)");                                        \
      CHECK(::kvmem::test::same_bits(kvmem_kokkos_, kvmem_host_));                                           \
    } else {                                                                                                 \
      const auto kvmem_dev_ = ::kvmem::test::deviation_as_host(kvmem_kokkos_, kvmem_host_);                  \
      ::kvmem::test::print_deviation(#kokkos, kvmem_dev_);                                                   \
      INFO(#kokkos " vs " #host " (device arithmetic): max abs "                                             \
           << kvmem_dev_.max_abs << ", scale " << kvmem_dev_.scale << ", relative " << kvmem_dev_.relative() \
           << ", tol " << (tol));                                                                            \
      CHECK(kvmem_dev_.relative() <= (tol));                                                                 \
    }                                                                                                        \
  } while (false)

// The fields of a slot record (core/slots.hpp: magic, version, mechanism, count, then per field a u16
// name length, the name, a u8 kind, a u64 element count and the data), read without the importer so
// two records can be compared field by field.
struct RecordField {
  std::string name;
  std::uint8_t kind = 0;
  std::vector<std::int64_t> ints;  // kind 1
  std::vector<double> reals;       // kinds 2 (f64) and 3 (f32)
};
inline std::vector<RecordField> record_fields(std::span<const std::byte> r) {
  std::size_t pos = 20;  // magic (8), version, mechanism, field count (u32 each)
  const auto get = [&](void* dst, std::size_t n) {
    if (pos + n > r.size()) throw std::invalid_argument("record_fields: a truncated record");
    std::memcpy(dst, r.data() + pos, n);
    pos += n;
  };
  std::vector<RecordField> fields;
  while (pos < r.size()) {
    RecordField f;
    std::uint16_t len = 0;
    get(&len, sizeof len);
    f.name.resize(len);
    get(f.name.data(), len);
    get(&f.kind, sizeof f.kind);
    std::uint64_t n = 0;
    get(&n, sizeof n);
    for (std::uint64_t i = 0; i < n; ++i) {
      if (f.kind == 1) {
        std::int64_t x = 0;
        get(&x, sizeof x);
        f.ints.push_back(x);
      } else if (f.kind == 2) {
        double x = 0;
        get(&x, sizeof x);
        f.reals.push_back(x);
      } else if (f.kind == 3) {
        float x = 0;
        get(&x, sizeof x);
        f.reals.push_back(double(x));
      } else {
        throw std::invalid_argument("record_fields: unknown kind of field " + f.name);
      }
    }
    fields.push_back(std::move(f));
  }
  return fields;
}

// A slot record written after a Kokkos run against the host backend's: the same bytes on a host space;
// on a device space the same fields in the same order with the same lengths, equal integer fields
// (counters, slot counts, positions, the kept set) and floating-point fields within `tol` as above.
inline void check_record_as_host(const std::vector<std::byte>& kokkos, const std::vector<std::byte>& host, double tol) {
  if constexpr (kHostArithmetic) {
    INFO("records: the same bytes (host arithmetic)");
    CHECK(kokkos == host);
  } else {
    REQUIRE(kokkos.size() == host.size());
    CHECK(std::memcmp(kokkos.data(), host.data(), 20) == 0);  // magic, version, mechanism, field count
    const auto a = record_fields(kokkos), b = record_fields(host);
    REQUIRE(a.size() == b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      INFO("record field " << b[i].name);
      REQUIRE(a[i].name == b[i].name);
      REQUIRE(a[i].kind == b[i].kind);
      CHECK(a[i].ints == b[i].ints);
      const auto dev = deviation_as_host(a[i].reals, b[i].reals);
      if (!a[i].reals.empty()) print_deviation("record field " + b[i].name, dev);
      INFO("max abs " << dev.max_abs << ", scale " << dev.scale << ", relative " << dev.relative() << ", tol " << tol);
      CHECK(dev.relative() <= tol);
    }
  }
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
