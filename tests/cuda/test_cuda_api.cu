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
