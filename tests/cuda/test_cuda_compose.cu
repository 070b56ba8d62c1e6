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
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "cuda/cuda_test_support.hpp"
#include "kvm/compose_budget.hpp"
#include "kvm/kvm_host_util.hpp"
#include "kvmem/backend/cuda.hpp"
#include "kvmem/reference/ua.hpp"
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
  place_outputs(o, c, t0, n, out_full);
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

// A variant with fixed head dims reaches the CUDA kernel choice as HeadDims (core/support.hpp): only the
// kernels of those dims are instantiated, and each call runs the kernel the run-time choice picks for the
// same shape, so its outputs are the run-time variant's bits. The run-time variant is checked against
// the fp64 reference here (fp32) and in test_kvm_cuda / test_ua_cuda.
namespace {
// Prefill of [0, split) then one decode call per token through the composed variant Kvm, storage S.
template <class Kvm>
std::vector<float> kvm_variant_run(const rkvm::Config& c, const rkvm::Inputs& in, std::int64_t split) {
  using S = typename Kvm::storage_type;
  const Kvm attn(to_params(c));
  const FloatWeights fw(in);
  Dev<float> lw(fw.w), lb(fw.b), ts(fw.ts), tw(fw.tw);
  const kvmem::cuda::KvmWeights w{lw.ptr, lb.ptr, ts.ptr, tw.ptr};
  kvmem::cuda::KvmState<S> st;
  const auto made = attn.make_state(to_shape(c, c.T), st);
  INFO(made.to_string());
  REQUIRE(made.is_ok());
  std::vector<float> out_full(std::size_t(c.B * c.T * c.Hq * c.Dv), 0.0f);
  const kvmem::cuda::Executor exec{};
  for (std::int64_t t0 = 0; t0 < c.T; t0 = t0 == 0 ? split : t0 + 1) {
    const std::int64_t t1 = t0 == 0 ? split : t0 + 1, n = t1 - t0;
    Dev<S> q(as_storage<S>(slice_tokens(in.q, c.B * c.Hq, c.T, c.D, t0, t1))),
        k(as_storage<S>(slice_tokens(in.k, c.B * c.Hk, c.T, c.D, t0, t1))),
        v(as_storage<S>(slice_tokens(in.v, c.B * c.Hk, c.T, c.Dv, t0, t1))),
        g(as_storage<S>(slice_tokens(in.gate, c.B * c.Hk, c.T, 1, t0, t1)));
    Dev<float> out(std::vector<float>(std::size_t(c.B * n * c.Hq * c.Dv), -7.0f));
    const TensorView<const S, 4> qv(q.ptr, {c.B, c.Hq, n, c.D}), kv(k.ptr, {c.B, c.Hk, n, c.D}),
        vv(v.ptr, {c.B, c.Hk, n, c.Dv});
    const TensorView<const S, 3> gv(g.ptr, {c.B, c.Hk, n});
    const TensorView<float, 4> ov(out.ptr, {c.B, n, c.Hq, c.Dv});
    const auto s =
        n == 1 && t0 > 0 ? attn.decode(exec, st, w, qv, kv, vv, gv, ov) : attn.prefill(exec, st, w, qv, kv, vv, gv, ov);
    INFO("tokens [" << t0 << ", " << t1 << "): " << s.to_string());
    REQUIRE(s.is_ok());
    const auto o = out.get();
    place_outputs(o, c, t0, n, out_full);
  }
  return out_full;
}
}  // namespace

TEST_CASE("kvm cuda Attention with fixed head dims runs the kernels of those dims", "[kvm][cuda][compose]") {
  if (no_device()) return;
  {  // fp32, D 16, Dv 12: the generic readout and decode kernels
    auto c = small_config(2, 120, 4, 2, 16, 12, kvmem::budget::Any(kLog));
    const auto in = random_inputs(c, 29);
    const auto ref = rkvm::prefill(c, in);
    const auto fixed = kvm_variant_run<kvmem::kvm::Attention<kLog, kvmem::precision::Fp32Storage, 16, 12>>(c, in, 40);
    const auto any = kvm_variant_run<LogKvm>(c, in, 40);
    KVMEM_CHECK_CLOSE(fixed, ref.out, 2e-5);
    CHECK(fixed == any);
  }
  // bf16 at 64 and 128: the register and tensor-core readouts, the tensor-core routing, and at 128 the
  // vectorised decode (the only decode kernel such a variant instantiates)
  for (const std::int64_t D : {64, 128}) {
    INFO("D = Dv = " << D);
    auto c = small_config(1, 96, 8, 2, D, D, kvmem::budget::Any(kLog));
    const auto in = random_inputs(c, 31);
    using Any = kvmem::kvm::Attention<kLog, kvmem::precision::Bf16Storage>;
    const auto any = kvm_variant_run<Any>(c, in, 48);
    const auto fixed =
        D == 64 ? kvm_variant_run<kvmem::kvm::Attention<kLog, kvmem::precision::Bf16Storage, 64>>(c, in, 48)
                : kvm_variant_run<kvmem::kvm::Attention<kLog, kvmem::precision::Bf16Storage, 128>>(c, in, 48);
    CHECK(fixed == any);
  }
  // The internal overload refuses a state of other dims with a Status (the variant's make_state already
  // refuses to create one).
  auto c = small_config(1, 32, 4, 2, 16, 16, kvmem::budget::Any(kLog));
  kvmem::cuda::KvmState<float> st;
  REQUIRE(kvmem::cuda::KvmState<float>::create(to_params(c), to_shape(c, c.T), st).is_ok());
  Dev<float> x(std::vector<float>(std::size_t(4 * 32 * 16), 0.5f)), out(std::size_t(32 * 4 * 16));
  const TensorView<const float, 4> qv(x.ptr, {1, 4, 8, 16}), kv(x.ptr, {1, 2, 8, 16});
  const TensorView<const float, 3> gv(x.ptr, {1, 2, 8});
  const auto s = kvmem::kvm::Backend<kvmem::cuda::Executor>::prefill(
      kvmem::HeadDims<64>{}, kvmem::cuda::Executor{}, st, kvmem::cuda::KvmWeights{x.ptr, x.ptr, x.ptr, x.ptr}, qv, kv,
      kv, gv, TensorView<float, 4>(out.ptr, {1, 8, 4, 16}), nullptr, nullptr);
  CHECK(s.code() == kvmem::StatusCode::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::Matchers::Contains("head dims 64"));
}

namespace {
// Prefill of [0, split) then one decode call per token through the composed variant Ua (one sequence), in
// the storage S (bf16 inputs for bf16 caches); returns the outputs and the kept lengths.
template <class Ua>
std::pair<std::vector<float>, std::vector<std::int64_t>> ua_variant_run(const ua::FloatCase& f, std::int64_t split,
                                                                        const kua::CacheShape& shape) {
  using S = typename Ua::storage_type;
  const std::int64_t H = f.c.H, G = f.c.G, T = f.c.T, D = f.c.D;
  Dev<S> q(as_storage<S>(f.q)), k(as_storage<S>(f.k)), v(as_storage<S>(f.v));
  Dev<float> zk(f.z_k), zq(f.z_q), out(std::vector<float>(std::size_t(T * H * D), -7.0f));
  kvmem::cuda::UaCache<S> cache;
  REQUIRE(kvmem::cuda::UaCache<S>::create(shape, cache).is_ok());
  const kvmem::cuda::Executor exec{};
  for (std::int64_t t0 = 0; t0 < T; t0 = t0 == 0 ? split : t0 + 1) {
    const std::int64_t n = t0 == 0 ? split : 1;
    kua::InputsOf<S> in;
    in.q = {q.ptr + t0 * D, {1, H, n, D}, {H * T * D, T * D, D, 1}};
    in.k = {k.ptr + t0 * D, {1, G, n, D}, {G * T * D, T * D, D, 1}};
    in.v = {v.ptr + t0 * D, {1, G, n, D}, {G * T * D, T * D, D, 1}};
    in.z_k = {zk.ptr + t0, {1, G, n}, {G * T, T, 1}};
    in.z_q = {zq.ptr + t0, {1, G, n}, {G * T, T, 1}};
    const TensorView<float, 4> o(out.ptr + t0 * H * D, {1, n, H, D}, {T * H * D, H * D, D, 1});
    const auto s = t0 == 0 ? Ua::prefill(exec, cache, in, o, 32) : Ua::decode(exec, cache, in, o);
    INFO("token " << t0 << ": " << s.to_string());
    REQUIRE(s.is_ok());
  }
  std::vector<std::int64_t> lengths;
  REQUIRE(cache.lengths(lengths, exec.stream).is_ok());
  return {out.get(), lengths};
}
}  // namespace

TEST_CASE("ua cuda Attention with a fixed head dim runs the kernels of that dim", "[ua][cuda][compose]") {
  if (no_device()) return;
  using Universal = kvmem::decay::Universal;
  constexpr kvmem::prune::Threshold kP{0.05};
  {  // fp32, D 32: the CUDA-core chunk and decode kernels of 32 dims, pruning at p = 0.05
    const ua::Case c = ua::random_case(1, 160, 4, 2, 32, 77);
    const ua::FloatCase f(c);
    kvmem::reference::ua::Config rc = c.config;  // the runs' schedule: chunks of 32 over [0, 100), then decode
    rc.prefill_chunk = 32;
    rc.prefill_split = 100;
    const auto ref = kvmem::reference::ua::pruned(rc, c.inputs, 0.05);
    const auto fixed =
        ua_variant_run<kua::Attention<Universal, kP, kvmem::precision::Fp32Storage, 32>>(f, 100, f.cache_shape());
    const auto any = ua_variant_run<kua::Attention<Universal, kP>>(f, 100, f.cache_shape());
    KVMEM_CHECK_CLOSE(fixed.first, ref.out, 1e-5);
    CHECK(fixed.first == any.first);
    CHECK(fixed.second == any.second);
    CHECK(fixed.second[0] < c.config.T);  // p = 0.05 evicted
  }
  // bf16, D 128, r 4, prune::None: the dense tensor-core prefill and the decode kernels of 128 dims
  {
    const ua::Case c = ua::random_case(1, 160, 8, 2, 128, 5);
    const ua::FloatCase f(c);
    using Fixed = kua::Attention<Universal, kvmem::prune::None{}, kvmem::precision::Bf16Storage, 128>;
    using Any = kua::Attention<Universal, kvmem::prune::None{}, kvmem::precision::Bf16Storage>;
    const auto fixed = ua_variant_run<Fixed>(f, 100, f.cache_shape());
    const auto any = ua_variant_run<Any>(f, 100, f.cache_shape());
    CHECK(fixed.first == any.first);
    CHECK(fixed.second == any.second);
  }
  // The internal overload refuses a cache of another head dim with a Status.
  const ua::Case c = ua::random_case(1, 16, 4, 2, 32, 3);
  const ua::FloatCase f(c);
  kvmem::cuda::UaCache<float> cache;
  REQUIRE(kvmem::cuda::UaCache<float>::create(f.cache_shape(), cache).is_ok());
  Dev<float> q(f.q), k(f.k), v(f.v), zk(f.z_k), zq(f.z_q), out(f.make_out().size());
  kua::Inputs in;
  in.q = {q.ptr, {1, 4, 16, 32}};
  in.k = {k.ptr, {1, 2, 16, 32}};
  in.v = {v.ptr, {1, 2, 16, 32}};
  in.z_k = {zk.ptr, {1, 2, 16}};
  in.z_q = {zq.ptr, {1, 2, 16}};
  const auto s =
      kua::prefill<Universal>(kvmem::HeadDims<64>{}, kvmem::cuda::Executor{}, cache, in, kua::Options{0.0, 16},
                              kvmem::prune::None{}, TensorView<float, 4>(out.ptr, {1, 16, 4, 32}));
  CHECK(s.code() == kvmem::StatusCode::kInvalidArgument);
  CHECK_THAT(s.message(), Catch::Matchers::Contains("head dim 64"));
}
