// SPDX-License-Identifier: Apache-2.0
// The CUDA backend behind the one public API (DESIGN.md 3, kvm/attention.hpp): kvm::prefill, forward,
// step and can_run reach it through Backend<cuda::Executor> with the host's signatures; the state and
// weights types come from kvm::state_t / kvm::weights_t. What the backend does not do is refused with
// kUnsupported before anything changes. Skips, saying so, when no CUDA device is visible.
#include "kvmem/backend/cuda/vendor.cuh"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include "cuda/cuda_test_support.hpp"
#include "kvmem/backend/cuda.hpp"
#include "kvmem/backend/host/ua.hpp"

namespace {

using kvmem::bf16;
using kvmem::Rows;
using kvmem::Status;
using kvmem::StatusCode;
using kvmem::TensorView;
namespace kvm = kvmem::kvm;
namespace kcuda = kvmem::cuda;
using namespace kvmem::test::cuda;

static_assert(std::is_same_v<kvm::state_t<kcuda::Executor, bf16>, kcuda::KvmState<bf16, float>>);
static_assert(std::is_same_v<kvm::state_t<kcuda::Executor, float>, kcuda::KvmState<float, float>>);
static_assert(std::is_same_v<kvm::weights_t<kcuda::Executor>, kcuda::KvmWeights>);

constexpr std::int64_t B = 2, Hq = 4, Hk = 2, D = 32, Dv = 32, T = 80;

kvm::Params params() {
  kvm::Params p;
  p.chunk = 16;
  p.window_chunks = 2;
  p.sink = 1;
  p.rope_dims = 8;
  p.budget = kvmem::budget::Fixed{24, 24};
  return p;
}

// Inputs of a fixed-batch call [B, heads, T, dim] and weights, in device memory.
struct Inputs {
  std::mt19937_64 rng{7};
  Dev<float> q{normal(std::size_t(B * Hq * T * D), rng)}, k{normal(std::size_t(B * Hk * T * D), rng)},
      v{normal(std::size_t(B * Hk * T * Dv), rng)}, g{gates(std::size_t(B * Hk * T), rng)},
      lw{normal(D, rng, 1.f, .2f)}, lb{normal(D, rng, 0.f, .2f)}, ts{normal(Hq, rng, 1.f, .2f)},
      tw{normal(Hq, rng, 1.f, .2f)};
  kvm::weights_t<kcuda::Executor> weights() const { return {lw.ptr, lb.ptr, ts.ptr, tw.ptr}; }
  TensorView<const float, 4> qv() const { return {q.ptr, {B, Hq, T, D}}; }
  TensorView<const float, 4> kv() const { return {k.ptr, {B, Hk, T, D}}; }
  TensorView<const float, 4> vv() const { return {v.ptr, {B, Hk, T, Dv}}; }
  TensorView<const float, 3> gv() const { return {g.ptr, {B, Hk, T}}; }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_CASE("cuda kvm::forward and kvm::prefill run the CUDA fixed-batch kernels", "[cuda][api]") {
  if (no_device()) return;
  const Inputs in;
  const kcuda::Executor exec{};
  Dev<float> out_forward(std::size_t(B * T * Hq * Dv)), out_prefill(out_forward.n), out_direct(out_forward.n);
  const auto view = [](const Dev<float>& o) { return TensorView<float, 4>(o.ptr, {B, T, Hq, Dv}); };

  // forward: a fresh state of the backend's type, one prefill
  const Status s =
      kvm::forward<float>(exec, params(), in.weights(), in.qv(), in.kv(), in.vv(), in.gv(), view(out_forward));
  INFO(s.to_string());
  REQUIRE(s.is_ok());

  kvm::state_t<kcuda::Executor, float> a, b;
  REQUIRE(kcuda::KvmState<float>::create(params(), {B, Hq, Hk, D, Dv, T}, a).is_ok());
  REQUIRE(kcuda::KvmState<float>::create(params(), {B, Hq, Hk, D, Dv, T}, b).is_ok());
  const Status p = kvm::prefill(exec, a, in.weights(), in.qv(), in.kv(), in.vv(), in.gv(), view(out_prefill));
  INFO(p.to_string());
  REQUIRE(p.is_ok());
  REQUIRE(kcuda::kvm_prefill(exec, b, in.weights(), in.qv(), in.kv(), in.vv(), in.gv(), view(out_direct)).is_ok());
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  const std::vector<float> direct = out_direct.get();
  CHECK(same_bits(out_prefill.get(), direct));
  CHECK(same_bits(out_forward.get(), direct));
  CHECK(a.tokens() == T);
  // the outputs are attention outputs, not an untouched buffer
  double norm = 0;
  for (float x : direct) norm += double(x) * x;
  CHECK(norm > 0);
  CHECK(std::isfinite(norm));
}

TEST_CASE("cuda kvm calls refuse what the backend does not do, before anything changes", "[cuda][api]") {
  if (no_device()) return;
  const Inputs in;
  const kcuda::Executor exec{};
  kvm::state_t<kcuda::Executor, float> st;
  REQUIRE(kcuda::KvmState<float>::create(params(), {B, Hq, Hk, D, Dv, T}, st).is_ok());
  Dev<float> out(std::size_t(B * T * Hq * Dv));
  const TensorView<float, 4> o(out.ptr, {B, T, Hq, Dv});

  SECTION("per-sequence lengths of the fixed-batch prefill") {
    const std::int64_t lengths[B] = {T, T / 2};
    const Status s = kvm::prefill(exec, st, in.weights(), in.qv(), in.kv(), in.vv(), in.gv(), o, lengths);
    CHECK(s.code() == StatusCode::kUnsupported);
    CHECK_THAT(s.to_string(), Catch::Contains("kvm::step"));
    CHECK(st.tokens() == 0);
  }
  SECTION("a RouteLog on kvm::step") {
    Dev<std::int32_t> slot(std::vector<std::int32_t>{0}), start(std::vector<std::int32_t>{0, 1});
    const Rows rows{TensorView<const std::int32_t, 1>(slot.ptr, {1}),
                    TensorView<const std::int32_t, 1>(start.ptr, {2})};
    kvm::RouteLog log;
    const Status s =
        kvm::step(exec, st, in.weights(), rows, TensorView<const float, 3>(in.q.ptr, {1, Hq, D}),
                  TensorView<const float, 3>(in.k.ptr, {1, Hk, D}), TensorView<const float, 3>(in.v.ptr, {1, Hk, Dv}),
                  TensorView<const float, 2>(in.g.ptr, {1, Hk}), TensorView<float, 3>(out.ptr, {1, Hq, Dv}),
                  TensorView<float, 2>{}, &log);
    CHECK(s.code() == StatusCode::kUnsupported);
    CHECK_THAT(s.to_string(), Catch::Contains("RouteLog"));
    CHECK(!st.slot_mode());  // the refused step did not enter slot mode
  }
}

TEST_CASE("cuda kvm::can_run answers through the backend", "[cuda][api]") {
  // No device needed: can_run only looks at the problem.
  const kcuda::Executor exec{};
  CHECK(kvm::can_run(exec, {params(), {B, Hq, Hk, D, Dv, T}}).is_ok());
  const Status wide = kvm::can_run(exec, {params(), {1, Hq, Hk, D, 512, T}});
  CHECK(wide.code() == StatusCode::kUnsupported);
  CHECK_THAT(wide.to_string(), Catch::Contains("Dv"));
  kvm::Params bad = params();
  bad.chunk = 0;
  CHECK(kvm::can_run(exec, {bad, {B, Hq, Hk, D, Dv, T}}).code() == StatusCode::kInvalidArgument);
}

}  // namespace

// ---- Universal Attention through the same names (ua/ops.hpp, ua::Backend) -----------------------------

static_assert(std::is_same_v<kvmem::ua::cache_t<kcuda::Executor, bf16>, kcuda::UaCache<bf16>>);
static_assert(std::is_same_v<kvmem::ua::cache_t<kcuda::Executor, float>, kcuda::UaCache<float>>);

// Prefill [0, split) and decode the rest with ua::prefill / ua::decode on any executor; the cache type
// and its creation come from the executor. Inputs are the token-major arrays q [B,Hu,Tu,D] etc. at `base`
// pointers of the backend's memory; returns the output [B,Tu,Hu,D] through `read`.
namespace ua_api {
constexpr std::int64_t Bu = 2, Hu = 4, Gu = 2, Du = 32, Tu = 48, split = 29;

struct Ptrs {
  const float *q, *k, *v, *zk, *zq;
  float* out;
};
kvmem::ua::Inputs slice(const Ptrs& p, std::int64_t t0, std::int64_t t1) {
  const std::int64_t n = t1 - t0;
  kvmem::ua::Inputs in;
  in.q = {p.q + t0 * Du, {Bu, Hu, n, Du}, {Hu * Tu * Du, Tu * Du, Du, 1}};
  in.k = {p.k + t0 * Du, {Bu, Gu, n, Du}, {Gu * Tu * Du, Tu * Du, Du, 1}};
  in.v = {p.v + t0 * Du, {Bu, Gu, n, Du}, {Gu * Tu * Du, Tu * Du, Du, 1}};
  in.z_k = {p.zk + t0, {Bu, Gu, n}, {Gu * Tu, Tu, 1}};
  in.z_q = {p.zq + t0, {Bu, Gu, n}, {Gu * Tu, Tu, 1}};
  return in;
}
TensorView<float, 4> out_slice(const Ptrs& p, std::int64_t t0, std::int64_t t1) {
  return {p.out + t0 * Hu * Du, {Bu, t1 - t0, Hu, Du}, {Tu * Hu * Du, Hu * Du, Du, 1}};
}
template <class Exec>
std::size_t run(const Exec& exec, const Ptrs& p, const kvmem::ua::Options& opt) {
  using Cache = kvmem::ua::cache_t<Exec, float>;
  Cache cache;
  REQUIRE(Cache::create({Bu, Hu, Gu, Du, Tu, 16}, cache).is_ok());
  const Status s = kvmem::ua::prefill(exec, cache, slice(p, 0, split), opt, out_slice(p, 0, split));
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  for (std::int64_t t = split; t < Tu; ++t) {
    const Status d = kvmem::ua::decode(exec, cache, slice(p, t, t + 1), opt, out_slice(p, t, t + 1));
    INFO(d.to_string());
    REQUIRE(d.is_ok());
  }
  return kvmem::ua::export_bytes(cache, 0) + kvmem::ua::export_bytes(cache, 1);  // grows with the kept rows
}
// Relative Frobenius error of got against want.
double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num += double(got[i] - want[i]) * double(got[i] - want[i]);
    den += double(want[i]) * double(want[i]);
  }
  return std::sqrt(num / den);
}
}  // namespace ua_api

TEST_CASE("cuda ua::prefill, ua::decode and ua::forward: the host's calls on the CUDA cache type", "[cuda][api]") {
  if (no_device()) return;
  using namespace ua_api;
  std::mt19937_64 rng{11};
  const auto q = normal(std::size_t(Bu * Hu * Tu * Du), rng), k = normal(std::size_t(Bu * Gu * Tu * Du), rng),
             v = normal(std::size_t(Bu * Gu * Tu * Du), rng), zk = normal(std::size_t(Bu * Gu * Tu), rng, 1.f, 1.5f),
             zq = normal(std::size_t(Bu * Gu * Tu), rng, 1.f, 1.5f);
  std::vector<float> host_out(std::size_t(Bu * Tu * Hu * Du), 0.f);
  const Dev<float> dq(q), dk(k), dv(v), dzk(zk), dzq(zq);
  Dev<float> dout(host_out.size());
  const Ptrs hp{q.data(), k.data(), v.data(), zk.data(), zq.data(), host_out.data()};
  const Ptrs dp{dq.ptr, dk.ptr, dv.ptr, dzk.ptr, dzq.ptr, dout.ptr};
  for (const double p : {0.0, 0.1}) {
    INFO("p " << p);
    const kvmem::ua::Options opt{p, 16, true};
    const std::size_t host_kept = run(kvmem::host::Executor{1}, hp, opt);
    const kcuda::Executor exec{};
    const std::size_t cuda_kept = run(exec, dp, opt);
    KVMEM_CUDA_REQUIRE(cudaStreamSynchronize(exec.stream));
    CHECK(cuda_kept == host_kept);
    CHECK(rel_error(dout.get(), host_out) < 1e-5);  // DESIGN.md 5: fp32 paths
  }
  // Dense forward through ua::forward on both backends.
  std::vector<float> host_fwd(host_out.size());
  Dev<float> dfwd(host_fwd.size());
  REQUIRE(kvmem::ua::forward(kvmem::host::Executor{1}, slice(hp, 0, Tu),
                             TensorView<float, 4>(host_fwd.data(), {Bu, Tu, Hu, Du}))
              .is_ok());
  const kcuda::Executor exec{};
  REQUIRE(kvmem::ua::forward(exec, slice(dp, 0, Tu), TensorView<float, 4>(dfwd.ptr, {Bu, Tu, Hu, Du})).is_ok());
  KVMEM_CUDA_REQUIRE(cudaStreamSynchronize(exec.stream));
  CHECK(rel_error(dfwd.get(), host_fwd) < 1e-5);
}
