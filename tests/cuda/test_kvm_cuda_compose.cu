// SPDX-License-Identifier: Apache-2.0
// Compile-time composition on the CUDA backend: kvm::Attention with a user budget policy (a logarithmic
// budget, tests/kvm/compose_budget.hpp) creates a cuda::KvmState through make_state; the CUDA backend
// evaluates the policy on the host into its per-update target table, and prefill / decode match the
// fp64 reference run with the same policy and the schedule computed from the policy's formula.
// The CUDA backend's compile-time limits (backend/cuda/limits.hpp) are checked against the real executor.

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include <catch2/catch.hpp>

#include "cuda/cuda_test_support.hpp"
#include "kvm/compose_budget.hpp"
#include "kvm/kvm_host_util.hpp"
#include "kvmem/backend/cuda.hpp"
#include "support/golden.hpp"

namespace {
using kvmem::TensorView;
namespace rkvm = kvmem::reference::kvm;
using namespace kvmem::test;
using namespace kvmem::test::cuda;

constexpr LogBudget kLog{4.0, 8, 1 << 20};
using LogKvm = kvmem::kvm::Attention<kLog, kvmem::precision::Fp32Storage>;
static_assert(kvmem::check_kvm_support<kvmem::cuda::Executor, float, 128, 256>());
static_assert(kvmem::check_ua_support<kvmem::cuda::Executor, 256>());

// Feeds tokens [t0, t1) through cuda::kvm_prefill; out_full [B,T,Hq,Dv] receives their rows.
void cuda_feed(kvmem::cuda::KvmState<float>& st, const rkvm::Config& c, const rkvm::Inputs& in,
               const kvmem::cuda::KvmWeights& w, std::int64_t t0, std::int64_t t1, std::vector<float>& out_full,
               kvmem::kvm::RouteLog* log) {
  const std::int64_t n = t1 - t0;
  Dev<float> q(slice_tokens(in.q, c.B * c.Hq, c.T, c.D, t0, t1)), k(slice_tokens(in.k, c.B * c.Hk, c.T, c.D, t0, t1)),
      v(slice_tokens(in.v, c.B * c.Hk, c.T, c.Dv, t0, t1)), g(slice_tokens(in.gate, c.B * c.Hk, c.T, 1, t0, t1));
  Dev<float> out(std::vector<float>(std::size_t(c.B * n * c.Hq * c.Dv), -7.0f));
  const auto status = kvmem::cuda::kvm_prefill(
      kvmem::cuda::Executor{}, st, w, TensorView<const float, 4>(q.ptr, {c.B, c.Hq, n, c.D}),
      TensorView<const float, 4>(k.ptr, {c.B, c.Hk, n, c.D}), TensorView<const float, 4>(v.ptr, {c.B, c.Hk, n, c.Dv}),
      TensorView<const float, 3>(g.ptr, {c.B, c.Hk, n}), TensorView<float, 4>(out.ptr, {c.B, n, c.Hq, c.Dv}), log);
  INFO(status.to_string());
  REQUIRE(status.is_ok());
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  const auto o = out.get();
  out_full.resize(std::size_t(c.B * c.T * c.Hq * c.Dv), 0.0f);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t i = 0; i < c.Hq * c.Dv; ++i)
        out_full[std::size_t(((b * c.T + t0 + t) * c.Hq) * c.Dv + i)] = o[std::size_t((b * n + t) * c.Hq * c.Dv + i)];
}
}  // namespace

TEST_CASE("kvm cuda with a user budget matches the fp64 reference and the policy's schedule", "[kvm][cuda][compose]") {
  if (no_device()) return;
  auto c = small_config(2, 120, 4, 2, 16, 12, kvmem::budget::Any(kLog));
  const auto in = random_inputs(c, 29);
  const LogKvm attn(to_params(c));
  const FloatWeights fw(in);
  Dev<float> lw(fw.w), lb(fw.b), ts(fw.ts), tw(fw.tw);
  const kvmem::cuda::KvmWeights w{lw.ptr, lb.ptr, ts.ptr, tw.ptr};
  const auto expected = log_budget_schedule(4.0, 8, c.chunk, c.window_chunks, c.T);
  const auto ref = rkvm::prefill(c, in);
  REQUIRE(ref.slots_after_update == expected);
  for (const std::int64_t split : {c.T, std::int64_t(40)}) {  // one prefill; a prefill then decode
    INFO("split " << split);
    kvmem::cuda::KvmState<float> st;
    const auto made = attn.make_state(to_shape(c, c.T), st);
    INFO(made.to_string());
    REQUIRE(made.is_ok());
    HostResult r;
    kvmem::kvm::RouteLog log;
    cuda_feed(st, c, in, w, 0, split, r.out, &log);
    for (std::int64_t t = split; t < c.T; ++t) cuda_feed(st, c, in, w, t, t + 1, r.out, &log);
    extract_routes(log, c, r);
    CHECK(r.slots_after_update == expected);
    CHECK(st.slots() == expected.back());
    CHECK(r.route_append == ref.route_append);
    CHECK(r.route_merge == ref.route_merge);
    KVMEM_CHECK_CLOSE(r.out, ref.out, 2e-5);
  }
}
