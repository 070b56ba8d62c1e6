// SPDX-License-Identifier: Apache-2.0
// Prune rules as policies (policy/prune.hpp) through ua::Attention<Set, Prune> on the host: a rank rule
// (keep at most k entries per (sequence, kv head) by λ), the same rule written as a user policy
// (ua_compose_rules.hpp), a threshold per layer, and prune::None, against the fp64 reference (outputs
// and kept sets).
// Near-ties: a rank cut whose λ gap in the reference is below fp32 rounding could flip, so the
// reference reports its smallest gap and the test requires it well above rounding on these seeds.

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/reference/ua.hpp"
#include "support/golden.hpp"
#include "ua_compose_rules.hpp"
#include "ua_host_support.hpp"

namespace {
using namespace kvmem::test::ua;
namespace kua = kvmem::ua;
namespace prune = kvmem::prune;
using kvmem::TensorView;

constexpr double kFp32Tol = 1e-5;
constexpr double kRankBand = 1e-4;  // λ gaps below this at a rank cut would be near-ties in fp32

struct Run {
  std::vector<float> out;
  std::vector<std::int64_t> kept;
  std::vector<double> lambda;  // [B,G,T] λ of each kept position at the end (0 where evicted)
  std::int64_t longest = 0;    // most entries any item holds at the end
};

// Chunked prefill of [0, split) then decode of [split, T) through the composed variant Ua.
template <class Ua>
Run run_variant(const FloatCase& f, std::int64_t split, const kua::Options& opt) {
  typename Ua::Cache cache(f.cache_shape());
  const kvmem::host::Executor exec{2};
  Run r;
  r.out = f.make_out();
  auto s = Ua::prefill(exec, cache, f.slice(0, split), f.out_slice(r.out, 0, split), opt);
  INFO(s.to_string());
  REQUIRE(s.is_ok());
  for (std::int64_t t = split; t < f.c.T; ++t) {
    s = Ua::decode(exec, cache, f.slice(t, t + 1), f.out_slice(r.out, t, t + 1), opt);
    INFO(s.to_string());
    REQUIRE(s.is_ok());
  }
  r.kept = kept_mask(cache, f.c.T);
  r.lambda.assign(r.kept.size(), 0.0);
  for (std::int64_t b = 0; b < f.c.B; ++b)
    for (std::int64_t g = 0; g < f.c.G; ++g) {
      r.longest = std::max(r.longest, cache.length(b, g));
      for (std::int64_t e = 0; e < cache.length(b, g); ++e)
        r.lambda[static_cast<std::size_t>((b * f.c.G + g) * f.c.T + cache.positions(b, g)[e])] = cache.lambda(b, g)[e];
    }
  return r;
}

Case compose_case() {
  Case c = random_case(2, 160, 4, 2, 32, 1234);
  c.config.prefill_chunk = 32;
  c.config.prefill_split = 100;
  return c;
}
}  // namespace

TEST_CASE("ua Attention with a keep-top-k prune policy matches the fp64 reference", "[ua][compose]") {
  const Case c = compose_case();
  const FloatCase f(c);
  for (const double p : {0.0, 0.05}) {
    INFO("p " << p);
    const auto ref = kvmem::reference::ua::pruned(c.config, c.inputs, p, 24);
    INFO("smallest λ gap at a rank cut " << ref.rank_margin);
    REQUIRE(ref.rank_margin > kRankBand);
    Run run;
    if (p == 0.0)
      run =
          run_variant<kua::Attention<kvmem::decay::Universal, prune::KeepTop{24, 0.0}>>(f, 100, kua::Options{0.0, 32});
    else
      run =
          run_variant<kua::Attention<kvmem::decay::Universal, prune::KeepTop{24, 0.05}>>(f, 100, kua::Options{0.0, 32});
    KVMEM_CHECK_CLOSE(run.out, ref.out, kFp32Tol);
    CHECK(run.kept == ref.kept);
    CHECK(run.longest == 24);  // the rule binds: every item is at its limit
    // The limit is what changes the result: the threshold alone keeps more.
    const auto thr = kvmem::reference::ua::pruned(c.config, c.inputs, p);
    CHECK(thr.kept != ref.kept);
  }
}

TEST_CASE("a user prune rule runs in the eviction like a built-in one", "[ua][compose]") {
  const Case c = compose_case();
  const FloatCase f(c);
  const auto ref = kvmem::reference::ua::pruned(c.config, c.inputs, 0.0, 16);
  REQUIRE(ref.rank_margin > kRankBand);
  const auto user = run_variant<kua::Attention<kvmem::decay::Universal, TopByLambda{16}>>(f, 100, {0.0, 32});
  KVMEM_CHECK_CLOSE(user.out, ref.out, kFp32Tol);
  CHECK(user.kept == ref.kept);
  // The built-in rank rule gives the same bits.
  const auto builtin = run_variant<kua::Attention<kvmem::decay::Universal, prune::KeepTop{16}>>(f, 100, {0.0, 32});
  CHECK(builtin.out == user.out);
  CHECK(builtin.kept == user.kept);
}

TEST_CASE("a per-layer threshold prunes each layer at its own p", "[ua][compose]") {
  const Case c = compose_case();
  const FloatCase f(c);
  constexpr prune::PerLayer kLayers{0.0, 0.05, 0.15};
  using Ua = kua::Attention<kvmem::decay::Universal, kLayers>;
  static_assert(decltype(kLayers)::kLayers == 3);
  for (std::int64_t layer = 0; layer < 3; ++layer) {
    INFO("layer " << layer);
    const double p = kLayers.p[layer];
    const auto ref = kvmem::reference::ua::pruned(c.config, c.inputs, p);
    kua::Options opt{0.0, 32};
    opt.layer = layer;
    const auto run = run_variant<Ua>(f, 100, opt);
    KVMEM_CHECK_CLOSE(run.out, ref.out, kFp32Tol);
    CHECK(run.kept == ref.kept);
    // Bitwise the runtime threshold of that layer (Options::p, no policy).
    kua::PrunedCache<float> cache(f.cache_shape());
    const auto plain = host_prefill_decode(f, 100, kua::Options{p, 32}, cache);
    CHECK(plain == run.out);
  }
  // A layer the policy does not have is refused before anything changes.
  kua::PrunedCache<float> cache(f.cache_shape());
  std::vector<float> out = f.make_out();
  kua::Options opt{0.0, 32};
  opt.layer = 3;
  const auto s = Ua::prefill(kvmem::host::Executor{1}, cache, f.slice(0, 10), f.out_slice(out, 0, 10), opt);
  CHECK(s.code() == kvmem::StatusCode::kOutOfRange);
  CHECK_THAT(s.message(), Catch::Matchers::Contains("layer"));
  CHECK(cache.length(0, 0) == 0);
}

TEST_CASE("prune::None compiles the eviction away and keeps every key", "[ua][compose]") {
  using Dense = kua::Attention<kvmem::decay::Universal, prune::None{}>;
  using Tiny = kua::Attention<kvmem::decay::Universal, prune::Threshold{1e-6}>;
  // The evictor that reaches the item bodies and kernels: none at all for prune::None.
  static_assert(!Dense::kEvicts && !kua::evicts_v<prune::None>);
  static_assert(!kua::detail::kEvicts<decltype(kua::detail::evictor_of(prune::None{}, kua::Options{}))>);
  static_assert(Tiny::kEvicts && kua::evicts_v<prune::KeepTop> && kua::evicts_v<prune::PerLayer<2>>);
  static_assert(kua::detail::kEvicts<decltype(kua::detail::evictor_of(prune::KeepTop{4}, kua::Options{}))>);
  const Case c = compose_case();
  const FloatCase f(c);
  // Many keys decay far below any threshold a rule would use: λ < ln 1e-6 at the last token.
  const auto exact = kvmem::reference::ua::dense(c.config, c.inputs);
  std::int64_t far = 0;
  for (const double l : exact.lambda_last) far += l < std::log(1e-6) ? 1 : 0;
  REQUIRE(far > 100);
  const auto ref = kvmem::reference::ua::pruned(c.config, c.inputs, 0.0);
  const auto run = run_variant<Dense>(f, 100, {0.0, 32});
  KVMEM_CHECK_CLOSE(run.out, ref.out, kFp32Tol);
  CHECK(run.longest == 160);
  CHECK(run.kept == std::vector<std::int64_t>(run.kept.size(), 1));
  KVMEM_CHECK_CLOSE(run.lambda, exact.lambda_last, kFp32Tol);  // every row kept, with its exact λ
  // The same cache under a threshold as small as 1e-6 does evict those keys, as the reference does.
  const auto tiny_ref = kvmem::reference::ua::pruned(c.config, c.inputs, 1e-6);
  const auto tiny = run_variant<Tiny>(f, 100, {0.0, 32});
  CHECK(tiny.kept == tiny_ref.kept);
  CHECK(tiny.longest < 160);
}

TEST_CASE("a prune policy and Options::p are not combined", "[ua][compose]") {
  const Case c = compose_case();
  const FloatCase f(c);
  kua::PrunedCache<float> cache(f.cache_shape());
  std::vector<float> out = f.make_out();
  const auto s = kua::prefill(kvmem::host::Executor{1}, cache, f.slice(0, 10), kua::Options{0.05, 32},
                              prune::KeepTop{8}, f.out_slice(out, 0, 10));
  CHECK_FALSE(s.is_ok());
  CHECK_THAT(s.message(), Catch::Matchers::Contains("Options p"));
  const auto bad = kua::prefill(kvmem::host::Executor{1}, cache, f.slice(0, 10), kua::Options{0.0, 32},
                                prune::KeepTop{0}, f.out_slice(out, 0, 10));
  CHECK_THAT(bad.message(), Catch::Matchers::Contains("KeepTop k"));
}

TEST_CASE("a UA variant with a fixed head dim refuses a cache of another", "[ua][compose]") {
  const Case c = compose_case();  // D = 32
  const FloatCase f(c);
  using Ua64 = kua::Attention<kvmem::decay::Universal, prune::None{}, kvmem::precision::Fp32Storage, 64>;
  using Ua32 = kua::Attention<kvmem::decay::Universal, prune::None{}, kvmem::precision::Fp32Storage, 32>;
  kua::PrunedCache<float> cache(f.cache_shape());
  std::vector<float> out = f.make_out();
  const auto s = Ua64::prefill(kvmem::host::Executor{1}, cache, f.slice(0, 10), f.out_slice(out, 0, 10));
  CHECK_THAT(s.message(), Catch::Matchers::Contains("head dim 64"));
  CHECK(cache.length(0, 0) == 0);
  CHECK(Ua32::prefill(kvmem::host::Executor{1}, cache, f.slice(0, 10), f.out_slice(out, 0, 10)).is_ok());
}
