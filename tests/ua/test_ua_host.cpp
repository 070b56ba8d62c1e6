// SPDX-License-Identifier: Apache-2.0
// Host backend properties (spec UA.md 6) and host == fp64 reference on random cases. Expected values
// come from the spec (worked example, invariants), from plain causal softmax written out here, or
// from the fp64 reference; never from the host path itself, except where the spec demands equality
// of two host runs (decode == prefill, p = 0 == dense, P = 1 prefill == decode evicting after).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/backend/host/ua.hpp"
#include "kvmem/kernel/ua_decay.hpp"
#include "kvmem/reference/ua.hpp"
#include "support/golden.hpp"
#include "ua_host_support.hpp"
#include "ua_test_support.hpp"

namespace {
using namespace kvmem::test::ua;
namespace kua = kvmem::ua;
using kvmem::TensorView;

constexpr double kFp32Tol = 1e-5;

// Positions kept by (b, g), ascending.
template <class S>
std::vector<std::int64_t> kept_positions(const kua::PrunedCache<S>& cache, std::int64_t b, std::int64_t g) {
  return std::vector<std::int64_t>(cache.positions(b, g), cache.positions(b, g) + cache.length(b, g));
}

// Run prefill of [0, split) then decode, with one cache.
std::vector<float> run(const FloatCase& f, std::int64_t split, kua::Options opt,
                       kua::PrunedCache<float>* keep = nullptr, int threads = 2) {
  kua::PrunedCache<float> cache(f.cache_shape());
  auto out = host_prefill_decode(f, split, opt, cache, threads);
  if (keep) *keep = cache;
  return out;
}
}  // namespace

TEST_CASE("host: cumulative decay is 0 on the diagonal, non-increasing down a column, equal to the reference",
          "[ua][host]") {
  const Case c = random_case(1, 70, 2, 1, 16, 5);
  const FloatCase f(c);
  const auto lam = kvmem::reference::ua::cumulative_decay(c.config, c.inputs, 0, 0);
  const std::int64_t T = 70, D = 16;
  std::vector<std::int64_t> pos(T);
  for (std::int64_t t = 0; t < T; ++t) pos[t] = t;
  std::vector<float> tile(T * T), col(T), scratch(T);
  kvmem::kernel::ua::decay_tile<kvmem::decay::Universal, float>(f.k.data(), D, f.z_k.data(), pos.data(), T, f.k.data(),
                                                                D, f.z_q.data(), 1, 0, T, D, tile.data(), T,
                                                                scratch.data());
  // the tile's precomputed gate parts give bitwise the value decay::Set computes per pair
  for (std::int64_t j = 0; j < T; ++j)
    for (std::int64_t m = j + 1; m < T; ++m) {
      kvmem::decay::PairInputs<float> in{
          f.z_k[j], f.z_q[m], kvmem::kernel::ua::dot8<float>(f.k.data() + j * D, f.k.data() + m * D, D), j, m};
      CHECK(tile[j * T + m] == kvmem::decay::Universal::log_decay(in));
    }
  for (std::int64_t j = 0; j < T; ++j) {
    kvmem::kernel::ua::cumulative_decay<float>(0.0f, j, 0, tile.data() + j * T, T, col.data(), 1);
    for (std::int64_t i = 0; i < j; ++i) CHECK(col[i] == -std::numeric_limits<float>::infinity());
    CHECK(col[j] == 0.0f);
    for (std::int64_t i = j + 1; i < T; ++i) {
      CHECK(col[i] <= col[i - 1]);
      CHECK(std::abs(col[i] - lam[i * T + j]) <= 1e-5 * std::max(1.0, std::abs(lam[i * T + j])));
    }
  }
}

TEST_CASE("host: gates at 0 give plain causal softmax attention with scale 1", "[ua][host]") {
  // z_k = -1e4: ln g_k = -1e4, so x = exp((-1e4 + ...) / 3) = 0 in float and A = 0 exactly (spec UA.md 6.3).
  Case c = random_case(2, 45, 4, 2, 8, 21);
  for (auto& z : c.inputs.z_k) z = -1e4;
  const FloatCase f(c);
  const auto dense = host_forward(f);
  for (float l : dense.lambda_last) CHECK(l == 0.0f);
  // plain causal softmax, scale 1, written out in double
  const auto& cf = c.config;
  std::vector<double> expect(dense.out.size());
  for (std::int64_t b = 0; b < cf.B; ++b)
    for (std::int64_t h = 0; h < cf.H; ++h)
      for (std::int64_t i = 0; i < cf.T; ++i) {
        const std::int64_t g = h / (cf.H / cf.G);
        std::vector<double> s(i + 1);
        double mx = -1e300, sum = 0;
        for (std::int64_t j = 0; j <= i; ++j) {
          s[j] = 0;
          for (std::int64_t d = 0; d < cf.D; ++d)
            s[j] +=
                c.inputs.q[((b * cf.H + h) * cf.T + i) * cf.D + d] * c.inputs.k[((b * cf.G + g) * cf.T + j) * cf.D + d];
          mx = std::max(mx, s[j]);
        }
        for (std::int64_t j = 0; j <= i; ++j) sum += std::exp(s[j] - mx);
        for (std::int64_t d = 0; d < cf.D; ++d) {
          double o = 0;
          for (std::int64_t j = 0; j <= i; ++j)
            o += std::exp(s[j] - mx) / sum * c.inputs.v[((b * cf.G + g) * cf.T + j) * cf.D + d];
          expect[((b * cf.T + i) * cf.H + h) * cf.D + d] = o;
        }
      }
  KVMEM_CHECK_CLOSE(dense.out, expect, kFp32Tol);
}

TEST_CASE("host: p -> 0 gives the dense result exactly and evicts nothing", "[ua][host]") {
  const Case c = random_case(1, 150, 4, 2, 16, 31);
  const FloatCase f(c);
  const auto dense = host_forward(f);
  for (double p : {0.0, 1e-300}) {  // ln 1e-300 = -690.8: only a key decayed that far could go
    INFO("p " << p);
    kua::PrunedCache<float> cache(f.cache_shape());
    const auto out = host_prefill_decode(f, 100, kua::Options{p, 32, true}, cache);
    if (p == 0.0) {
      CHECK(out == dense.out);
      CHECK(cache.length(0, 0) == 150);
      CHECK(cache.length(0, 1) == 150);
    } else {
      // a key evicted at 1e-300 needs λ < -690.8; compare only if nothing crossed it
      const bool none = cache.length(0, 0) == 150 && cache.length(0, 1) == 150;
      if (none)
        CHECK(out == dense.out);
      else
        WARN("p = 1e-300 evicted keys on this case; equality not checked");
    }
  }
}

TEST_CASE("host: decode equals prefill bitwise (outputs and λ), from an empty cache and after a prefill",
          "[ua][host]") {
  const Case c = random_case(2, 140, 4, 2, 16, 41, 1.0, true);  // with the output gate
  const FloatCase f(c);
  const auto dense = host_forward(f);
  for (std::int64_t split : {0, 1, 37, 128, 139}) {
    INFO("prefill split " << split);
    kua::PrunedCache<float> cache(f.cache_shape());
    const auto out = host_prefill_decode(f, split, kua::Options{0.0, 128, true}, cache);
    CHECK(out == dense.out);
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t g = 0; g < 2; ++g) {
        REQUIRE(cache.length(b, g) == 140);
        for (std::int64_t e = 0; e < 140; ++e) CHECK(cache.lambda(b, g)[e] == dense.lambda_last[(b * 2 + g) * 140 + e]);
      }
  }
}

TEST_CASE("host: the kept set only loses keys except the new one, and equals {j : Λ_tj >= ln p}", "[ua][host]") {
  const Case c = random_case(1, 120, 2, 2, 8, 51);
  const FloatCase f(c);
  const double p = 0.15;
  kua::PrunedCache<float> cache(f.cache_shape());
  std::vector<float> out = f.make_out();
  std::vector<std::vector<double>> lam = {kvmem::reference::ua::cumulative_decay(c.config, c.inputs, 0, 0),
                                          kvmem::reference::ua::cumulative_decay(c.config, c.inputs, 0, 1)};
  std::vector<std::int64_t> prev[2];
  std::int64_t near_ties = 0;
  for (std::int64_t t = 0; t < 120; ++t) {
    REQUIRE(kua::decode(kvmem::host::Executor{2}, cache, f.slice(t, t + 1), kua::Options{p, 128, true},
                        f.out_slice(out, t, t + 1))
                .is_ok());
    for (std::int64_t g = 0; g < 2; ++g) {
      const auto now = kept_positions(cache, 0, g);
      for (auto j : now) {  // K_t ⊆ K_{t-1} ∪ {t}
        const bool old = std::find(prev[g].begin(), prev[g].end(), j) != prev[g].end();
        CHECK((old || j == t));
      }
      for (std::int64_t j = 0; j <= t; ++j) {  // invariant 7; fp32 near-ties (|Λ - ln p| < 1e-4) are don't-care
        const double l = lam[g][t * 120 + j];
        if (std::abs(l - std::log(p)) < 1e-4) {
          ++near_ties;
          continue;
        }
        const bool kept = std::find(now.begin(), now.end(), j) != now.end();
        CHECK(kept == (l >= std::log(p)));
      }
      prev[g] = now;
    }
  }
  INFO("near ties skipped: " << near_ties);
  CHECK(near_ties < 10);
  CHECK(cache.length(0, 0) < 120);  // the test evicted something
}

TEST_CASE("host: a query head only reads its group's cache", "[ua][host]") {
  const Case c = random_case(1, 90, 4, 2, 8, 61);
  Case changed = c;
  const std::int64_t T = 90, D = 8;
  for (std::int64_t t = 0; t < T; ++t) {  // perturb kv head 1 only
    for (std::int64_t d = 0; d < D; ++d) {
      changed.inputs.k[(1 * T + t) * D + d] = c.inputs.k[(1 * T + ((t * 7) % T)) * D + d];
      changed.inputs.v[(1 * T + t) * D + d] += 0.5;
    }
    changed.inputs.z_k[1 * T + t] -= 1.0;
    changed.inputs.z_q[1 * T + t] += 1.0;
  }
  for (double p : {0.0, 0.05}) {
    const auto a = run(FloatCase(c), 50, kua::Options{p, 16, true});
    const auto b = run(FloatCase(changed), 50, kua::Options{p, 16, true});
    std::int64_t diff_other = 0;
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t h = 0; h < 4; ++h)
        for (std::int64_t d = 0; d < D; ++d) {
          const std::size_t e = static_cast<std::size_t>((t * 4 + h) * D + d);
          if (h < 2)
            CHECK(a[e] == b[e]);  // heads 0, 1 read kv head 0 (floor(h / 2))
          else
            diff_other += a[e] != b[e];
        }
    CHECK(diff_other > 0);  // the change did reach heads 2, 3
  }
}

TEST_CASE("host: chunked prefill with P = 1 equals decode evicting after attention", "[ua][host]") {
  const Case c = random_case(2, 80, 4, 2, 8, 71);
  const FloatCase f(c);
  for (double p : {0.05, 0.15}) {
    kua::PrunedCache<float> a(f.cache_shape()), b(f.cache_shape());
    const auto prefilled = host_prefill_decode(f, 80, kua::Options{p, 1, true}, a);
    const auto decoded = host_prefill_decode(f, 0, kua::Options{p, 128, false}, b);
    CHECK(prefilled == decoded);
    for (std::int64_t s = 0; s < 2; ++s)
      for (std::int64_t g = 0; g < 2; ++g) CHECK(kept_positions(a, s, g) == kept_positions(b, s, g));
  }
}

TEST_CASE("host: G0 worked example of spec UA.md 8 (kept sets, pruned outputs)", "[ua][host]") {
  const FloatCase f(g0_case(4));
  const std::vector<std::vector<std::int64_t>> p005 = {
      {2, 3}, {2, 3, 4, 5, 6, 7}, {2, 3, 4, 5, 10, 11}, {4, 5, 10, 13, 14, 15}};
  const std::vector<std::vector<std::int64_t>> p015 = {{2, 3}, {6, 7}, {11}, {14, 15}};
  for (double p : {0.05, 0.15}) {
    kua::PrunedCache<float> cache(f.cache_shape());
    std::vector<float> out = f.make_out();
    for (int s = 0; s < 4; ++s) {  // one prefill call per chunk of 4: evictions at t = 3, 7, 11, 15
      REQUIRE(kua::prefill(kvmem::host::Executor{1}, cache, f.slice(4 * s, 4 * s + 4), kua::Options{p, 4, true},
                           f.out_slice(out, 4 * s, 4 * s + 4))
                  .is_ok());
      INFO("p " << p << " after t = " << 4 * s + 3);
      CHECK(kept_positions(cache, 0, 0) == (p == 0.05 ? p005 : p015)[s]);
    }
    const std::vector<double> o = p == 0.05 ? std::vector<double>{-0.527727, -0.737845, -0.690213, -0.401469}
                                            : std::vector<double>{-0.497979, -0.797161, -0.817872, -0.552877};
    for (int d = 0; d < 4; ++d) CHECK(out[(15 * 2) * 4 + d] == Approx(o[d]).margin(2e-6));
    CHECK(cache.position(0) == 16);  // spec UA.md 6.10: the counter is the token count
  }
  struct Run {
    double p;
    bool before;
    std::vector<double> o;
  };
  for (const Run& r : {Run{0.05, true, {-0.409134, -0.714472, -0.770225, -0.556915}},
                       Run{0.05, false, {-0.461722, -0.735490, -0.752331, -0.506360}},
                       Run{0.15, true, {-0.232012, -0.729708, -0.972495, -0.875562}},
                       Run{0.15, false, {-0.342484, -0.784143, -0.951878, -0.787095}}}) {
    INFO("decode p " << r.p << " before " << r.before);
    kua::PrunedCache<float> cache(f.cache_shape());
    const auto out = host_prefill_decode(f, 0, kua::Options{r.p, 128, r.before}, cache);
    for (int d = 0; d < 4; ++d) CHECK(out[(15 * 2) * 4 + d] == Approx(r.o[d]).margin(2e-6));
    CHECK(kept_positions(cache, 0, 0) ==
          (r.p == 0.05 ? std::vector<std::int64_t>{4, 5, 10, 13, 14, 15} : std::vector<std::int64_t>{14, 15}));
  }
}

TEST_CASE("host: fp32 equals the fp64 reference on a random GQA case with D = 80 and the output gate", "[ua][host]") {
  Case c = random_case(2, 300, 8, 2, 80, 81, 1.0, true);
  c.config.prefill_chunk = 64;
  c.config.prefill_split = 230;
  const FloatCase f(c);
  const auto ref_dense = kvmem::reference::ua::dense(c.config, c.inputs);
  const auto dense = host_forward(f);
  KVMEM_CHECK_CLOSE(dense.out, ref_dense.out, kFp32Tol);
  KVMEM_CHECK_CLOSE(dense.lse, ref_dense.lse, kFp32Tol);
  KVMEM_CHECK_CLOSE(dense.lambda_last, ref_dense.lambda_last, kFp32Tol);
  for (double p : {0.05, 0.15}) {
    INFO("p " << p);
    const auto ref_pruned = kvmem::reference::ua::pruned(c.config, c.inputs, p);
    kua::PrunedCache<float> cache(f.cache_shape());
    const auto out = host_prefill_decode(f, 230, kua::Options{p, 64, true}, cache);
    // A near-tie (|λ - ln p| < 1e-4 at any eviction test) could legitimately flip in fp32; report and
    // require none on this seed rather than widen the tolerance.
    KVMEM_CHECK_CLOSE(out, ref_pruned.out, kFp32Tol);
    CHECK(kept_mask(cache, 300) == ref_pruned.kept);
  }
}

TEST_CASE("host: bf16 storage stays within 1e-2 relative Frobenius of the fp64 reference", "[ua][host]") {
  // DESIGN.md 5: bf16 paths agree to ~1e-2 (relative Frobenius); λ and accumulation stay fp32.
  const Case c = random_case(1, 200, 4, 2, 80, 91);
  const FloatCase f(c);
  const auto ref_dense = kvmem::reference::ua::dense(c.config, c.inputs);
  kua::PrunedCache<kvmem::bf16> cache(f.cache_shape());
  const auto out = host_prefill_decode(f, 150, kua::Options{0.0, 64, true}, cache);
  const double err = kvmem::test::relative_frobenius(out, ref_dense.out);
  INFO("bf16 relative Frobenius " << err);
  CHECK(err < 1e-2);
  CHECK(err > 0.0);  // the storage really is bf16
  kua::PrunedCache<kvmem::bf16> pruned(f.cache_shape());
  const auto ref_pruned = kvmem::reference::ua::pruned(ref::Config{1, 200, 4, 2, 80, 64, 150, true}, c.inputs, 0.05);
  const auto out_p = host_prefill_decode(f, 150, kua::Options{0.05, 64, true}, pruned);
  CHECK(kvmem::test::relative_frobenius(out_p, ref_pruned.out) < 2e-2);
}

TEST_CASE("host: validation errors leave the cache untouched", "[ua][host]") {
  const Case c = random_case(1, 40, 2, 1, 8, 101);
  FloatCase f(c);
  kua::PrunedCache<float> cache(f.cache_shape(36));
  std::vector<float> out = f.make_out();
  const kvmem::host::Executor exec{1};
  REQUIRE(kua::prefill(exec, cache, f.slice(0, 20), kua::Options{0.15, 8, true}, f.out_slice(out, 0, 20)).is_ok());
  const kua::PrunedCache<float> before = cache;
  auto same = [&] {
    CHECK(cache.position(0) == before.position(0));
    REQUIRE(cache.length(0, 0) == before.length(0, 0));
    for (std::int64_t e = 0; e < cache.length(0, 0); ++e) {
      CHECK(cache.positions(0, 0)[e] == before.positions(0, 0)[e]);
      CHECK(cache.lambda(0, 0)[e] == before.lambda(0, 0)[e]);
    }
  };
  auto expect_error = [&](kvmem::Status s, const std::string& word) {
    INFO(s.to_string());
    CHECK_FALSE(s.is_ok());
    CHECK(s.message().find(word) != std::string::npos);
    same();
  };
  expect_error(kua::prefill(exec, cache, f.slice(20, 24), kua::Options{1.5, 8, true}, f.out_slice(out, 20, 24)),
               "[0, 1]");
  expect_error(kua::prefill(exec, cache, f.slice(20, 24), kua::Options{-0.1, 8, true}, f.out_slice(out, 20, 24)),
               "[0, 1]");
  expect_error(kua::prefill(exec, cache, f.slice(20, 24), kua::Options{0.15, 0, true}, f.out_slice(out, 20, 24)),
               "prefill_chunk");
  expect_error(kua::decode(exec, cache, f.slice(20, 22), kua::Options{0.15, 8, true}, f.out_slice(out, 20, 22)),
               "decode tokens");
  expect_error(kua::prefill(exec, cache, f.slice(0, 40), kua::Options{0.15, 8, true}, f.out_slice(out, 0, 40)),
               "capacity");
  auto bad = f.slice(20, 24);
  bad.k = TensorView<const float, 4>(f.k.data(), {1, 1, 4, 7});
  expect_error(kua::prefill(exec, cache, bad, kua::Options{0.15, 8, true}, f.out_slice(out, 20, 24)), "k [B,G,T,D]");
  f.q[(1 * 40 + 22) * 8 + 3] = std::numeric_limits<float>::quiet_NaN();
  expect_error(kua::prefill(exec, cache, f.slice(20, 24), kua::Options{0.15, 8, true}, f.out_slice(out, 20, 24)), "q");
  f.q[(1 * 40 + 22) * 8 + 3] = std::numeric_limits<float>::infinity();
  expect_error(kua::decode(exec, cache, f.slice(22, 23), kua::Options{0.15, 8, true}, f.out_slice(out, 22, 23)),
               "NaN or Inf");
}

TEST_CASE("host: the position counter is the token count after evictions, freed pages and the report", "[ua][host]") {
  const Case c = random_case(2, 160, 4, 2, 16, 111);
  const FloatCase f(c);
  kua::PrunedCache<float> cache(f.cache_shape());
  std::vector<float> out = f.make_out();
  REQUIRE(kua::prefill(kvmem::host::Executor{2}, cache, f.slice(0, 128), kua::Options{0.15, 128, true},
                       f.out_slice(out, 0, 128))
              .is_ok());
  for (std::int64_t b = 0; b < 2; ++b) {
    CHECK(cache.position(b) == 128);
    for (std::int64_t g = 0; g < 2; ++g) {
      const std::int64_t len = cache.length(b, g);
      CHECK(len < 128);
      CHECK(cache.freed_rows(b, g) == 128 - len);  // peak was the full chunk
      const auto pages = cache.freed_pages(b, g);
      CHECK(pages.first == (len + 15) / 16);
      CHECK(pages.first + pages.count == 8);
    }
  }
  for (std::int64_t t = 128; t < 160; ++t)
    REQUIRE(kua::decode(kvmem::host::Executor{2}, cache, f.slice(t, t + 1), kua::Options{0.15, 128, true},
                        f.out_slice(out, t, t + 1))
                .is_ok());
  const auto rows = kua::report(cache, 3);
  REQUIRE(rows.size() == 4);
  for (const auto& r : rows) {
    CHECK(r.layer == 3);
    CHECK(r.dense == 160);
    CHECK(r.kept == cache.length(r.batch, r.kv_head));
    CHECK(r.kv_bytes == r.kept * 2 * 16 * 4);
    CHECK(r.dense_kv_bytes == 160 * 2 * 16 * 4);
    CHECK(r.compression_ratio == Approx(1.0 - r.kept / 160.0));
    CHECK(r.compression_ratio > 0.0);
  }
  // next position stays the token count, not the (shorter) cache length
  CHECK(cache.position(0) == 160);
  CHECK(cache.length(0, 0) < 160);
}

TEST_CASE(
    "host: compile-time Attention<Set, Threshold{p}, Bf16Storage> equals the runtime path and the thread count does "
    "not matter",
    "[ua][host]") {
  const Case c = random_case(2, 100, 4, 2, 16, 121);
  const FloatCase f(c);
  using Ua = kua::Attention<kvmem::decay::Universal, kvmem::prune::Threshold{0.05}, kvmem::precision::Bf16Storage>;
  static_assert(Ua::threshold() == 0.05);
  Ua::Cache a(f.cache_shape());
  std::vector<float> out_a = f.make_out();
  REQUIRE(Ua::prefill(kvmem::host::Executor{2}, a, f.slice(0, 70), f.out_slice(out_a, 0, 70), 32).is_ok());
  for (std::int64_t t = 70; t < 100; ++t)
    REQUIRE(Ua::decode(kvmem::host::Executor{2}, a, f.slice(t, t + 1), f.out_slice(out_a, t, t + 1)).is_ok());
  kua::PrunedCache<kvmem::bf16> b(f.cache_shape());
  const auto out_b = host_prefill_decode(f, 70, kua::Options{0.05, 32, true}, b, 1);
  CHECK(out_a == out_b);
  // the runtime policy path gives the same options
  const kvmem::prune::Threshold runtime{0.05};
  CHECK(kua::Options::with(runtime, 32).p == 0.05);
  CHECK(kua::Options::with(kvmem::prune::None{}).p == 0.0);
  using Dense = kua::Attention<>;
  static_assert(Dense::threshold() == 0.0);
}

namespace {
// A user gate (spec UA.md / DESIGN.md 2): forget faster the further apart the tokens are.
struct DistanceGate {
  template <class Real>
  KVMEM_HOST_DEVICE static Real log_factor(const kvmem::decay::PairInputs<Real>& in) {
    return -Real(0.05) * static_cast<Real>(in.position - in.key_position);
  }
};
using DistanceSet = kvmem::decay::Set<kvmem::decay::KeyGate, DistanceGate>;
}  // namespace

TEST_CASE("host: a user decay gate plugs in and matches the reference with the same set", "[ua][host]") {
  Case c = random_case(1, 90, 2, 1, 8, 131);
  c.config.prefill_chunk = 16;
  c.config.prefill_split = 60;
  const FloatCase f(c);
  const auto ref_out = kvmem::reference::ua::pruned<DistanceSet>(c.config, c.inputs, 0.05);
  kua::PrunedCache<float> cache(f.cache_shape());
  std::vector<float> out = f.make_out();
  REQUIRE(kua::prefill<DistanceSet>(kvmem::host::Executor{1}, cache, f.slice(0, 60), kua::Options{0.05, 16, true},
                                    f.out_slice(out, 0, 60))
              .is_ok());
  for (std::int64_t t = 60; t < 90; ++t)
    REQUIRE(kua::decode<DistanceSet>(kvmem::host::Executor{1}, cache, f.slice(t, t + 1), kua::Options{0.05, 16, true},
                                     f.out_slice(out, t, t + 1))
                .is_ok());
  KVMEM_CHECK_CLOSE(out, ref_out.out, kFp32Tol);
  CHECK(kept_mask(cache, 90) == ref_out.kept);
  CHECK(cache.length(0, 0) < 90);
}

TEST_CASE("host: across prefill chunk ends the kept set only loses keys, except the chunk's own", "[ua][host]") {
  const Case c = random_case(1, 128, 4, 2, 16, 141);
  const FloatCase f(c);
  kua::PrunedCache<float> cache(f.cache_shape());
  std::vector<float> out = f.make_out();
  std::vector<std::int64_t> prev[2];
  for (std::int64_t t0 = 0; t0 < 128; t0 += 16) {  // one call per chunk of 16: eviction at each call's end
    REQUIRE(kua::prefill(kvmem::host::Executor{2}, cache, f.slice(t0, t0 + 16), kua::Options{0.05, 16, true},
                         f.out_slice(out, t0, t0 + 16))
                .is_ok());
    for (std::int64_t g = 0; g < 2; ++g) {
      const auto now = kept_positions(cache, 0, g);
      for (auto j : now) {
        const bool old = std::find(prev[g].begin(), prev[g].end(), j) != prev[g].end();
        CHECK((old || (j >= t0 && j < t0 + 16)));
      }
      CHECK(std::is_sorted(now.begin(), now.end()));  // stable compaction keeps ascending positions
      prev[g] = now;
    }
  }
  // and one call over all 128 tokens with chunk 16 gives the same outputs and cache
  kua::PrunedCache<float> whole(f.cache_shape());
  std::vector<float> out_whole = f.make_out();
  REQUIRE(kua::prefill(kvmem::host::Executor{2}, whole, f.slice(0, 128), kua::Options{0.05, 16, true},
                       f.out_slice(out_whole, 0, 128))
              .is_ok());
  CHECK(out_whole == out);
  for (std::int64_t g = 0; g < 2; ++g) CHECK(kept_positions(whole, 0, g) == prev[g]);
  CHECK(prev[0].size() < 128);
}
