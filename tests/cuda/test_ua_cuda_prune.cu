// SPDX-License-Identifier: Apache-2.0
// Prune rules on the CUDA backend (policy/prune.hpp; backend/cuda/ua_prune.cuh): prune::KeepTop (its cut
// found block-parallel), a user rank rule (tests/ua/ua_compose_rules.hpp: cut(entries) on one thread), a
// per-layer threshold and prune::None, through ua::Attention and the policy overloads of ua::prefill,
// decode and step, against the fp64 reference and the host backend: kept sets equal, outputs within fp32
// rounding. Items stay short (the one-block decode) or grow past it (decode_split_rows at r = 4,
// decode_split at r = 2, rows marked dead in place), over own pages and a shared pool, in both decode
// orders, and a step mixes a prefill row with decode rows.
// Near-ties: a rank cut whose λ gap in the reference lies below fp32 rounding could flip on either
// backend, so each case requires the reference's smallest gap at a rank cut above a band (REQUIRE: a case
// that has one fails, it is never skipped). Skips, saying so, when no CUDA device is visible.
#include "kvmem/backend/cuda/vendor.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "cuda/cuda_test_support.hpp"
#include "kvmem/backend/cuda.hpp"
#include "kvmem/reference/ua.hpp"
#include "support/golden.hpp"
#include "ua/ua_compose_rules.hpp"
#include "ua/ua_host_support.hpp"

namespace {
using kvmem::TensorView;
using namespace kvmem::test;
using namespace kvmem::test::cuda;
using namespace kvmem::test::ua;
namespace kua = kvmem::ua;
namespace prune = kvmem::prune;

constexpr double kFp32Tol = 1e-5;   // golden README: max |x - ref| <= 1e-5 * max(1, max |ref|)
constexpr double kRankBand = 1e-4;  // λ gaps at a rank cut below this could flip in fp32 (160 tokens)
// 420 tokens with λ down to about -60: fp32 λ drifts from the exact value by about 1e-4 at most over the
// sequence (a random walk of one rounding of |λ| 2^-24 per step), so a gap ten times that cannot flip.
constexpr double kLongRankBand = 1e-3;

// A FloatCase in device memory (fp32) and views of its token ranges, batch-major like FloatCase::slice.
struct DevCase {
  const FloatCase& f;
  Dev<float> q, k, v, z_k, z_q;
  explicit DevCase(const FloatCase& fc) : f(fc), q(fc.q), k(fc.k), v(fc.v), z_k(fc.z_k), z_q(fc.z_q) {}
  kua::Inputs slice(std::int64_t t0, std::int64_t t1) const {
    const std::int64_t B = f.c.B, H = f.c.H, G = f.c.G, T = f.c.T, D = f.c.D, n = t1 - t0;
    kua::Inputs in;
    in.q = {q.ptr + t0 * D, {B, H, n, D}, {H * T * D, T * D, D, 1}};
    in.k = {k.ptr + t0 * D, {B, G, n, D}, {G * T * D, T * D, D, 1}};
    in.v = {v.ptr + t0 * D, {B, G, n, D}, {G * T * D, T * D, D, 1}};
    in.z_k = {z_k.ptr + t0, {B, G, n}, {G * T, T, 1}};
    in.z_q = {z_q.ptr + t0, {B, G, n}, {G * T, T, 1}};
    return in;
  }
  TensorView<float, 4> out_slice(float* out, std::int64_t t0, std::int64_t t1) const {
    const std::int64_t H = f.c.H, T = f.c.T, D = f.c.D;
    return {out + t0 * H * D, {f.c.B, t1 - t0, H, D}, {T * H * D, H * D, D, 1}};
  }
};

struct Run {
  std::vector<float> out;
  std::vector<std::int64_t> kept;  // [B,G,T] 1 = in the cache after the last token
  std::vector<double> lambda;      // [B,G,T] λ of each kept position after the last token (0 where evicted)
  std::int64_t longest = 0;        // most entries an item holds at the end
};

// Membership [B,G,T] of a device cache, checking that each item's positions ascend.
Run kept_of(const kvmem::cuda::UaCache<float>& cache, std::int64_t T) {
  const auto& s = cache.shape();
  Run r;
  r.kept.assign(std::size_t(s.batch * s.kv_heads * T), 0);
  r.lambda.assign(r.kept.size(), 0.0);
  for (std::int64_t b = 0; b < s.batch; ++b)
    for (std::int64_t g = 0; g < s.kv_heads; ++g) {
      std::vector<std::int64_t> pos;
      std::vector<float> lam;
      REQUIRE(cache.download(b, g, pos, lam, nullptr, nullptr, nullptr).is_ok());
      r.longest = std::max(r.longest, std::int64_t(pos.size()));
      for (std::size_t e = 0; e < pos.size(); ++e) {
        if (e > 0) CHECK(pos[e] > pos[e - 1]);
        REQUIRE(pos[e] >= 0);
        REQUIRE(pos[e] < T);
        r.kept[std::size_t((b * s.kv_heads + g) * T + pos[e])] = 1;
        r.lambda[std::size_t((b * s.kv_heads + g) * T + pos[e])] = lam[e];
      }
    }
  return r;
}

// Chunked prefill of [0, split), then decode of [split, T), each call `call(cache, inputs, out)` on the
// CUDA backend (the first call is the prefill).
template <class Call>
Run cuda_run(const FloatCase& f, std::int64_t split, const kua::CacheShape& shape, Call call) {
  DevCase d(f);
  kvmem::cuda::UaCache<float> cache;
  const auto made = kvmem::cuda::UaCache<float>::create(shape, cache);
  INFO(made.to_string());
  REQUIRE(made.is_ok());
  Dev<float> out(std::vector<float>(f.make_out().size(), -7.0f));  // poisoned
  const auto prefilled = call(cache, d.slice(0, split), d.out_slice(out.ptr, 0, split));
  INFO(prefilled.to_string());
  REQUIRE(prefilled.is_ok());
  for (std::int64_t t = split; t < f.c.T; ++t) {
    const auto s = call(cache, d.slice(t, t + 1), d.out_slice(out.ptr, t, t + 1));
    INFO("token " << t << ": " << s.to_string());
    REQUIRE(s.is_ok());
  }
  KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
  Run r = kept_of(cache, f.c.T);
  r.out = out.get();
  return r;
}
// The same through a composed variant: Ua::prefill for the first call, Ua::decode for each token.
template <class Ua>
Run cuda_variant(const FloatCase& f, std::int64_t split, const kua::CacheShape& shape, const kua::Options& opt) {
  const kvmem::cuda::Executor exec{};
  bool first = true;
  return cuda_run(f, split, shape, [&](auto& cache, const kua::Inputs& in, TensorView<float, 4> out) {
    const bool prefill = std::exchange(first, false);
    return prefill ? Ua::prefill(exec, cache, in, out, opt) : Ua::decode(exec, cache, in, out, opt);
  });
}
// The same on the host backend.
template <class Ua>
Run host_variant(const FloatCase& f, std::int64_t split, const kua::CacheShape& shape, const kua::Options& opt) {
  typename Ua::Cache cache(shape);
  const kvmem::host::Executor exec{2};
  Run r;
  r.out = f.make_out();
  const auto prefilled = Ua::prefill(exec, cache, f.slice(0, split), f.out_slice(r.out, 0, split), opt);
  INFO(prefilled.to_string());
  REQUIRE(prefilled.is_ok());
  for (std::int64_t t = split; t < f.c.T; ++t) {
    const auto s = Ua::decode(exec, cache, f.slice(t, t + 1), f.out_slice(r.out, t, t + 1), opt);
    INFO(s.to_string());
    REQUIRE(s.is_ok());
  }
  r.kept = kept_mask(cache, f.c.T);
  for (std::int64_t b = 0; b < f.c.B; ++b)
    for (std::int64_t g = 0; g < f.c.G; ++g) r.longest = std::max(r.longest, cache.length(b, g));
  return r;
}

// The case of the host composition test (tests/ua/test_ua_compose.cpp): B 2, T 160, H 4, G 2, D 32,
// prefill of 100 tokens in chunks of 32.
Case compose_case(bool evict_before_attention) {
  Case c = random_case(2, 160, 4, 2, 32, 1234);
  c.config.prefill_chunk = 32;
  c.config.prefill_split = 100;
  c.config.evict_before_attention = evict_before_attention;
  return c;
}
kua::Options options_of(const Case& c) {
  return kua::Options{0.0, c.config.prefill_chunk, c.config.evict_before_attention};
}

// A shared pool of page_rows 16 with room for every item at capacity (nothing runs dry: the pool's
// bookkeeping and the compaction at every decode step of a long item are what differs from own pages).
kua::CacheShape pooled(kua::CacheShape s) {
  s.pool_pages = s.batch * s.kv_heads * s.pages_per_item();
  return s;
}

// Most entries an item of a [B,G,T] membership holds.
std::int64_t longest_of(const std::vector<std::int64_t>& kept, std::int64_t T) {
  std::int64_t most = 0;
  for (std::size_t item = 0; item * std::size_t(T) < kept.size(); ++item) {
    std::int64_t n = 0;
    for (std::int64_t j = 0; j < T; ++j) n += kept[item * std::size_t(T) + std::size_t(j)];
    most = std::max(most, n);
  }
  return most;
}

// Runs variant Ua on CUDA and on the host and checks both against the reference's kept set and outputs.
template <class Ua>
void check_against_reference(const FloatCase& f, const kvmem::reference::ua::PrunedResult& ref,
                             const kua::CacheShape& shape, const kua::Options& opt) {
  const std::int64_t split = f.c.prefill_split;
  const Run gpu = cuda_variant<Ua>(f, split, shape, opt);
  const Run host = host_variant<Ua>(f, split, shape, opt);
  CHECK(gpu.kept == ref.kept);
  CHECK(gpu.kept == host.kept);
  CHECK(gpu.longest == longest_of(ref.kept, f.c.T));
  KVMEM_CHECK_CLOSE(gpu.out, ref.out, kFp32Tol);
  KVMEM_CHECK_CLOSE(gpu.out, host.out, kFp32Tol);
}
}  // namespace

TEST_CASE("ua cuda KeepTop matches the host and the fp64 reference (one-block decode)", "[ua][cuda][compose]") {
  if (no_device()) return;
  for (const bool before : {true, false}) {
    const Case c = compose_case(before);
    const FloatCase f(c);
    for (const double p : {0.0, 0.05}) {
      const auto ref = kvmem::reference::ua::pruned(c.config, c.inputs, p, 24);
      INFO("evict_before_attention " << before << ", p " << p << ", smallest λ gap at a rank cut " << ref.rank_margin);
      REQUIRE(ref.rank_margin > kRankBand);
      if (p == 0.0) REQUIRE(longest_of(ref.kept, c.config.T) == 24);  // the rank binds
      for (const bool pool : {false, true}) {
        INFO("shared pool " << pool);
        const kua::CacheShape shape = pool ? pooled(f.cache_shape()) : f.cache_shape();
        if (p == 0.0)
          check_against_reference<kua::Attention<kvmem::decay::Universal, prune::KeepTop{24, 0.0}>>(f, ref, shape,
                                                                                                    options_of(c));
        else
          check_against_reference<kua::Attention<kvmem::decay::Universal, prune::KeepTop{24, 0.05}>>(f, ref, shape,
                                                                                                     options_of(c));
      }
    }
  }
}

TEST_CASE("ua cuda runs a user prune rule through the policy overloads of prefill and decode", "[ua][cuda][compose]") {
  if (no_device()) return;
  const Case c = compose_case(true);
  const FloatCase f(c);
  const auto ref = kvmem::reference::ua::pruned(c.config, c.inputs, 0.0, 16);
  INFO("smallest λ gap at a rank cut " << ref.rank_margin);
  REQUIRE(ref.rank_margin > kRankBand);
  const kvmem::cuda::Executor exec{};
  const kua::Options opt = options_of(c);
  bool first = true;
  const Run user = cuda_run(f, 100, f.cache_shape(), [&](auto& cache, const kua::Inputs& in, TensorView<float, 4> out) {
    return std::exchange(first, false) ? kua::prefill(exec, cache, in, opt, TopByLambda{16}, out)
                                       : kua::decode(exec, cache, in, opt, TopByLambda{16}, out);
  });
  CHECK(user.kept == ref.kept);
  CHECK(user.longest == 16);
  KVMEM_CHECK_CLOSE(user.out, ref.out, kFp32Tol);
  // The built-in rule of the same ranking: the same kept sets; the cut's entry is the same, so the same bits.
  first = true;
  const Run builtin =
      cuda_run(f, 100, f.cache_shape(), [&](auto& cache, const kua::Inputs& in, TensorView<float, 4> out) {
        return std::exchange(first, false) ? kua::prefill(exec, cache, in, opt, prune::KeepTop{16}, out)
                                           : kua::decode(exec, cache, in, opt, prune::KeepTop{16}, out);
      });
  CHECK(builtin.kept == user.kept);
  CHECK(builtin.out == user.out);
}

TEST_CASE("ua cuda KeepTop on items past the one-block decode (split decodes, dead rows, shared pool)",
          "[ua][cuda][compose]") {
  if (no_device()) return;
  // r = 4: decode_split_rows (fp32 rows of 128 bytes); r = 2: decode_split. Seeds whose smallest gap at a
  // rank cut clears kLongRankBand.
  struct Shape {
    std::int64_t H;
    std::uint32_t seed;
  };
  for (const Shape sh : {Shape{8, 24}, Shape{4, 11}}) {
    Case c = random_case(1, 420, sh.H, 2, 32, sh.seed);
    c.config.prefill_chunk = 32;
    c.config.prefill_split = 300;
    const FloatCase f(c);
    const auto ref = kvmem::reference::ua::pruned(c.config, c.inputs, 0.0, 260);
    INFO("H " << sh.H << ", smallest λ gap at a rank cut " << ref.rank_margin);
    REQUIRE(ref.rank_margin > kLongRankBand);
    REQUIRE(longest_of(ref.kept, c.config.T) == 260);  // every decode step starts from more than 256 rows
    for (const bool pool : {false, true}) {
      INFO("shared pool " << pool);
      const kua::CacheShape shape = pool ? pooled(f.cache_shape()) : f.cache_shape();
      check_against_reference<kua::Attention<kvmem::decay::Universal, prune::KeepTop{260}>>(f, ref, shape,
                                                                                            options_of(c));
    }
  }
}

namespace {
// Token-major packed rows of one step (host arrays): each row (sequence b of the case, tokens [t0, t1)).
struct Packed {
  std::vector<float> q, k, v, z_k, z_q;
  std::vector<std::int32_t> slot, start{0};
  void add(const FloatCase& f, std::int64_t b, std::int64_t t0, std::int64_t t1) {
    const std::int64_t H = f.c.H, G = f.c.G, T = f.c.T, D = f.c.D;
    for (std::int64_t t = t0; t < t1; ++t) {
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t d = 0; d < D; ++d) q.push_back(f.q[std::size_t(((b * H + h) * T + t) * D + d)]);
      for (std::int64_t g = 0; g < G; ++g) {
        for (std::int64_t d = 0; d < D; ++d) {
          k.push_back(f.k[std::size_t(((b * G + g) * T + t) * D + d)]);
          v.push_back(f.v[std::size_t(((b * G + g) * T + t) * D + d)]);
        }
        z_k.push_back(f.z_k[std::size_t((b * G + g) * T + t)]);
        z_q.push_back(f.z_q[std::size_t((b * G + g) * T + t)]);
      }
    }
    slot.push_back(std::int32_t(b));
    start.push_back(std::int32_t(start.back() + (t1 - t0)));
  }
  std::int64_t tokens() const { return start.back(); }
  std::int64_t rows() const { return std::int64_t(slot.size()); }
  static kua::PackedInputs view(const float* q0, const float* k0, const float* v0, const float* zk, const float* zq,
                                std::int64_t N, std::int64_t H, std::int64_t G, std::int64_t D) {
    kua::PackedInputs in;
    in.q = TensorView<const float, 3>(q0, {N, H, D});
    in.k = TensorView<const float, 3>(k0, {N, G, D});
    in.v = TensorView<const float, 3>(v0, {N, G, D});
    in.z_k = TensorView<const float, 2>(zk, {N, G});
    in.z_q = TensorView<const float, 2>(zq, {N, G});
    return in;
  }
};
}  // namespace

namespace {
// Steps of variant Ua on CUDA and on the host, sequence 0's prefill row beside nothing, then sequence 1's
// prefill row beside sequence 0's decode rows, against the reference `ref` (outputs and kept sets).
template <class Ua>
void check_steps(const Case& c, const FloatCase& f, const kvmem::reference::ua::PrunedResult& ref) {
  const std::int64_t H = c.config.H, G = c.config.G, D = c.config.D, T = c.config.T, split = 100;
  const kua::Options opt = options_of(c);
  for (const bool pool : {false, true}) {
    INFO("shared pool " << pool);
    const kua::CacheShape shape = pool ? pooled(f.cache_shape()) : f.cache_shape();
    kvmem::cuda::UaCache<float> dev;
    REQUIRE(kvmem::cuda::UaCache<float>::create(shape, dev).is_ok());
    kua::PrunedCache<float> host(shape);
    const kvmem::cuda::Executor exec{};
    std::vector<float> out_gpu = f.make_out(), out_host = f.make_out();
    // Sequence 0 prefills at step 0 and decodes from step 1; sequence 1 prefills at step 1 (beside the
    // decode row of sequence 0) and decodes from step 2, one step behind.
    double worst = 0.0;
    for (std::int64_t step = 0; step <= T - split + 1; ++step) {
      Packed p;
      std::vector<std::pair<std::int64_t, std::int64_t>> where;  // (sequence, first token) of each row
      for (std::int64_t b = 0; b < 2; ++b) {
        const std::int64_t s = step - b;  // this sequence's own step
        if (s < 0) continue;
        const std::int64_t t0 = s == 0 ? 0 : split + s - 1, t1 = s == 0 ? split : t0 + 1;
        if (t0 >= T) continue;
        p.add(f, b, t0, t1);
        where.emplace_back(b, t0);
      }
      const std::int64_t N = p.tokens(), R = p.rows();
      std::vector<float> oh(std::size_t(N * H * D));
      const kvmem::Rows hr{TensorView<const std::int32_t, 1>(p.slot.data(), {R}),
                           TensorView<const std::int32_t, 1>(p.start.data(), {R + 1})};
      const auto on_host =
          Ua::step(kvmem::host::Executor{2}, host, hr,
                   Packed::view(p.q.data(), p.k.data(), p.v.data(), p.z_k.data(), p.z_q.data(), N, H, G, D),
                   TensorView<float, 3>(oh.data(), {N, H, D}), {}, opt);
      INFO(on_host.to_string());
      REQUIRE(on_host.is_ok());
      Dev<float> q(p.q), k(p.k), v(p.v), zk(p.z_k), zq(p.z_q), out(std::size_t(N * H * D));
      Dev<std::int32_t> ds(p.slot), dq(p.start);
      const kvmem::Rows dr{TensorView<const std::int32_t, 1>(ds.ptr, {R}),
                           TensorView<const std::int32_t, 1>(dq.ptr, {R + 1})};
      const auto on_device = Ua::step(exec, dev, dr, Packed::view(q.ptr, k.ptr, v.ptr, zk.ptr, zq.ptr, N, H, G, D),
                                      TensorView<float, 3>(out.ptr, {N, H, D}), {}, opt);
      INFO(on_device.to_string());
      REQUIRE(on_device.is_ok());
      REQUIRE(dev.step_status(exec).is_ok());
      const auto og = out.get();
      worst = std::max(worst, relative_frobenius(og, oh));
      // scatter the rows' outputs into [B,T,H,D] for the reference comparison
      for (std::int64_t row = 0; row < R; ++row)
        for (std::int64_t x = p.start[std::size_t(row)]; x < p.start[std::size_t(row) + 1]; ++x)
          for (std::int64_t i = 0; i < H * D; ++i) {
            const std::int64_t b = where[std::size_t(row)].first,
                               t = where[std::size_t(row)].second + (x - p.start[std::size_t(row)]);
            out_gpu[std::size_t((b * T + t) * H * D + i)] = og[std::size_t(x * H * D + i)];
            out_host[std::size_t((b * T + t) * H * D + i)] = oh[std::size_t(x * H * D + i)];
          }
    }
    INFO("worst relative Frobenius error of a step's outputs against the host " << worst);
    CHECK(worst <= 1e-5);
    KVMEM_CHECK_CLOSE(out_gpu, ref.out, kFp32Tol);
    KVMEM_CHECK_CLOSE(out_host, ref.out, kFp32Tol);
    KVMEM_CUDA_REQUIRE(cudaDeviceSynchronize());
    const Run gpu = kept_of(dev, T);
    CHECK(gpu.kept == ref.kept);
    CHECK(gpu.kept == kept_mask(host, T));
  }
}
}  // namespace

TEST_CASE("ua cuda step with a prune rule: prefill rows beside decode rows", "[ua][cuda][compose]") {
  if (no_device()) return;
  const Case c = compose_case(true);
  const FloatCase f(c);
  const auto ref = kvmem::reference::ua::pruned(c.config, c.inputs, 0.0, 24);
  INFO("smallest λ gap at a rank cut " << ref.rank_margin);
  REQUIRE(ref.rank_margin > kRankBand);
  check_steps<kua::Attention<kvmem::decay::Universal, prune::KeepTop{24}>>(c, f, ref);
}

// prune::None reaches the kernels as the instances without eviction (decode_attend_kernel and
// finish_kernel with kEvict = false, no cut kernels): every row stays, however far its λ falls, on every
// decode path (one block, and past 256 rows decode_split_rows at r = 4 and decode_split at r = 2), over own
// pages and a shared pool, in fixed-batch calls and in steps.
TEST_CASE("ua cuda prune::None keeps every row however far λ falls", "[ua][cuda][compose]") {
  using Dense = kua::Attention<kvmem::decay::Universal, prune::None{}>;
  static_assert(!Dense::kEvicts && !kua::evicts_v<prune::None>);
  static_assert(kua::evicts_v<prune::Threshold> && kua::evicts_v<prune::KeepTop>);
  if (no_device()) return;
  struct Shape {
    std::int64_t B, T, H;
  };
  for (const Shape sh : {Shape{2, 160, 4}, Shape{1, 420, 8}, Shape{1, 420, 4}}) {
    INFO("B " << sh.B << ", T " << sh.T << ", H " << sh.H);
    Case c = random_case(sh.B, sh.T, sh.H, 2, 32, 1234);
    c.config.prefill_chunk = 32;
    c.config.prefill_split = 100;
    const FloatCase f(c);
    // Many keys decay far below any threshold a rule would use: λ < ln 1e-6 at the last token.
    const auto exact = kvmem::reference::ua::dense(c.config, c.inputs);
    std::int64_t far = 0;
    for (const double l : exact.lambda_last) far += l < std::log(1e-6) ? 1 : 0;
    REQUIRE(far > 100);
    const auto ref = kvmem::reference::ua::pruned(c.config, c.inputs, 0.0);
    for (const bool pool : {false, true}) {
      INFO("shared pool " << pool);
      const kua::CacheShape shape = pool ? pooled(f.cache_shape()) : f.cache_shape();
      const Run gpu = cuda_variant<Dense>(f, 100, shape, options_of(c));
      KVMEM_CHECK_CLOSE(gpu.out, ref.out, kFp32Tol);
      CHECK(gpu.kept == std::vector<std::int64_t>(gpu.kept.size(), 1));
      CHECK(gpu.longest == sh.T);
      KVMEM_CHECK_CLOSE(gpu.lambda, exact.lambda_last, kFp32Tol);  // every row kept, with its exact λ
    }
    if (sh.B == 2) check_steps<Dense>(c, f, ref);
  }
}

TEST_CASE("ua cuda prune::None and a per-layer threshold through ua::Attention give the plain calls' bits",
          "[ua][cuda][compose]") {
  if (no_device()) return;
  const Case c = compose_case(true);
  const FloatCase f(c);
  const kvmem::cuda::Executor exec{};
  const auto plain = [&](double p) {
    bool first = true;
    const kua::Options opt{p, 32, true};
    return cuda_run(f, 100, f.cache_shape(), [&](auto& cache, const kua::Inputs& in, TensorView<float, 4> out) {
      return std::exchange(first, false) ? kua::prefill(exec, cache, in, opt, out)
                                         : kua::decode(exec, cache, in, opt, out);
    });
  };
  const Run none = cuda_variant<kua::Attention<kvmem::decay::Universal, prune::None{}>>(f, 100, f.cache_shape(),
                                                                                        kua::Options{0.0, 32, true});
  const Run dense = plain(0.0);
  CHECK(none.out == dense.out);
  CHECK(none.longest == c.config.T);
  constexpr prune::PerLayer kLayers{0.05, 0.15};
  using Layered = kua::Attention<kvmem::decay::Universal, kLayers>;
  for (std::int64_t layer = 0; layer < 2; ++layer) {
    INFO("layer " << layer);
    kua::Options opt{0.0, 32, true};
    opt.layer = layer;
    const Run run = cuda_variant<Layered>(f, 100, f.cache_shape(), opt);
    const Run same = plain(kLayers.p[layer]);
    CHECK(run.out == same.out);
    CHECK(run.kept == same.kept);
    CHECK(run.longest < c.config.T);
  }
  // Refusals before anything changes: a policy beside Options::p, a layer the policy does not have.
  DevCase d(f);
  kvmem::cuda::UaCache<float> cache;
  REQUIRE(kvmem::cuda::UaCache<float>::create(f.cache_shape(), cache).is_ok());
  Dev<float> out(f.make_out().size());
  const auto both = kua::prefill(exec, cache, d.slice(0, 10), kua::Options{0.05, 32, true}, prune::KeepTop{8},
                                 d.out_slice(out.ptr, 0, 10));
  CHECK(both.code() == kvmem::StatusCode::kInvalidArgument);
  CHECK_THAT(both.message(), Catch::Matchers::Contains("Options p"));
  kua::Options layer2{0.0, 32, true};
  layer2.layer = 2;
  const auto outside = Layered::prefill(exec, cache, d.slice(0, 10), d.out_slice(out.ptr, 0, 10), layer2);
  CHECK(outside.code() == kvmem::StatusCode::kOutOfRange);
  std::vector<std::int64_t> lengths;
  REQUIRE(cache.lengths(lengths, exec.stream).is_ok());
  for (const std::int64_t n : lengths) CHECK(n == 0);
  CHECK(cache.position(0) == 0);
}
