// SPDX-License-Identifier: Apache-2.0
// Compile-time composition on the CUDA backend:
//  - kvm::Attention with a user budget policy (a logarithmic budget, tests/kvm/compose_budget.hpp)
//    creates a cuda::KvmState through make_state; the CUDA backend evaluates the policy on the host into
//    its per-update target table, and prefill / decode match the fp64 reference run with the same
//    policy and the schedule computed from the policy's formula;
//  - ua::Attention with a per-layer threshold steps a cuda::UaCache (the policy's evictor at the
//    layer: its p) exactly like the host's ua::step with that p run alone;
//  - the CUDA backend's compile-time limits (backend/cuda/limits.hpp) hold for the real executor.

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include <catch2/catch.hpp>

#include "cuda/cuda_test_support.hpp"
#include "kvm/compose_budget.hpp"
#include "kvm/kvm_host_util.hpp"
#include "kvmem/backend/cuda.hpp"
#include "support/golden.hpp"
#include "ua/ua_host_support.hpp"

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

namespace {
namespace kua = kvmem::ua;
// Tokens [t0, t0 + T) of a one-sequence FloatCase ([1,H,L,D] layout) as packed token-major host arrays.
struct Packed {
  std::vector<float> q, k, v, z_k, z_q;
  Packed(const ua::FloatCase& f, std::int64_t t0, std::int64_t T) {
    const std::int64_t H = f.c.H, G = f.c.G, D = f.c.D, L = f.c.T;
    for (std::int64_t t = t0; t < t0 + T; ++t) {
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t d = 0; d < D; ++d) q.push_back(f.q[std::size_t((h * L + t) * D + d)]);
      for (std::int64_t g = 0; g < G; ++g) {
        for (std::int64_t d = 0; d < D; ++d) {
          k.push_back(f.k[std::size_t((g * L + t) * D + d)]);
          v.push_back(f.v[std::size_t((g * L + t) * D + d)]);
        }
        z_k.push_back(f.z_k[std::size_t(g * L + t)]);
        z_q.push_back(f.z_q[std::size_t(g * L + t)]);
      }
    }
  }
  kua::PackedInputs view(const float* q0, const float* k0, const float* v0, const float* zk, const float* zq,
                         std::int64_t T, std::int64_t H, std::int64_t G, std::int64_t D) const {
    kua::PackedInputs in;
    in.q = TensorView<const float, 3>(q0, {T, H, D});
    in.k = TensorView<const float, 3>(k0, {T, G, D});
    in.v = TensorView<const float, 3>(v0, {T, G, D});
    in.z_k = TensorView<const float, 2>(zk, {T, G});
    in.z_q = TensorView<const float, 2>(zq, {T, G});
    return in;
  }
};
}  // namespace

TEST_CASE("ua cuda Attention with a per-layer threshold steps like the host with that layer's p",
          "[ua][cuda][compose]") {
  if (no_device()) return;
  ua::Case c = ua::random_case(1, 160, 4, 2, 32, 77);
  const ua::FloatCase f(c);
  const std::int64_t H = 4, G = 2, D = 32, cap = 256;
  constexpr kvmem::prune::PerLayer kLayers{0.05, 0.15};
  using Ua = kua::Attention<kvmem::decay::Universal, kLayers>;
  const kua::Options opt = Ua::options(/*prefill_chunk*/ 32, /*evict_before_attention*/ true, /*layer*/ 1);
  kua::PrunedCache<float> host(kua::CacheShape{1, H, G, D, cap, 16});
  kvmem::cuda::UaCache<float> dev;
  REQUIRE(kvmem::cuda::UaCache<float>::create({1, H, G, D, cap, 16}, dev).is_ok());
  const kvmem::cuda::Executor exec{};
  // Rows: a prefill row of 100 tokens, then one decode row per token.
  std::vector<std::pair<std::int64_t, std::int64_t>> rows{{0, 100}};
  for (std::int64_t t = 100; t < c.config.T; ++t) rows.push_back({t, 1});
  double worst = 0.0;
  for (const auto& [t0, T] : rows) {
    const Packed p(f, t0, T);
    const std::vector<std::int32_t> slot{0}, qs{0, std::int32_t(T)};
    // host, Options::p of layer 1, no policy
    std::vector<float> out_h(std::size_t(T * H * D));
    const kvmem::Rows hr{TensorView<const std::int32_t, 1>(slot.data(), {1}),
                         TensorView<const std::int32_t, 1>(qs.data(), {2})};
    REQUIRE(kua::step(kvmem::host::Executor{1}, host, hr,
                      p.view(p.q.data(), p.k.data(), p.v.data(), p.z_k.data(), p.z_q.data(), T, H, G, D),
                      kua::Options{0.15, 32, true}, TensorView<float, 3>(out_h.data(), {T, H, D}))
                .is_ok());
    // CUDA through the composed variant
    Dev<float> q(p.q), k(p.k), v(p.v), zk(p.z_k), zq(p.z_q), out(std::size_t(T * H * D));
    Dev<std::int32_t> ds(slot), dq(qs);
    const kvmem::Rows dr{TensorView<const std::int32_t, 1>(ds.ptr, {1}),
                         TensorView<const std::int32_t, 1>(dq.ptr, {2})};
    const auto s = Ua::step(exec, dev, dr, p.view(q.ptr, k.ptr, v.ptr, zk.ptr, zq.ptr, T, H, G, D),
                            TensorView<float, 3>(out.ptr, {T, H, D}), {}, opt);
    INFO(s.to_string());
    REQUIRE(s.is_ok());
    REQUIRE(dev.step_status(exec).is_ok());
    worst = std::max(worst, relative_frobenius(out.get(), out_h));
  }
  INFO("worst relative Frobenius of a row's outputs " << worst);
  CHECK(worst <= 1e-4);
  std::vector<std::int64_t> lengths;
  REQUIRE(dev.lengths(lengths, exec.stream).is_ok());
  for (std::int64_t g = 0; g < G; ++g) {
    CHECK(lengths[std::size_t(g)] == host.length(0, g));
    CHECK(host.length(0, g) < c.config.T);  // layer 1's p = 0.15 evicted
  }
}
