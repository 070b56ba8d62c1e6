// SPDX-License-Identifier: Apache-2.0
// The float64 reference against the worked example of spec UA.md 8 (expected values from the spec)
// and the invariants of spec UA.md 6.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/reference/ua.hpp"
#include "ua_test_support.hpp"

namespace {
namespace ref = kvmem::reference::ua;
using kvmem::test::ua::Case;
using kvmem::test::ua::g0_case;
using kvmem::test::ua::random_case;

// The first n tokens of a B = 1 case (UA is causal, so a prefix run equals the full run up to n).
Case prefix(const Case& c, std::int64_t n) {
  Case p = c;
  const auto& cf = c.config;
  p.config.T = n;
  p.config.prefill_split = n;
  auto cut = [&](const std::vector<double>& x, std::int64_t heads, std::int64_t width) {
    std::vector<double> y;
    for (std::int64_t h = 0; h < heads; ++h)
      y.insert(y.end(), x.begin() + h * cf.T * width, x.begin() + (h * cf.T + n) * width);
    return y;
  };
  p.inputs.q = cut(c.inputs.q, cf.H, cf.D);
  p.inputs.k = cut(c.inputs.k, cf.G, cf.D);
  p.inputs.v = cut(c.inputs.v, cf.G, cf.D);
  p.inputs.z_k = cut(c.inputs.z_k, cf.G, 1);
  p.inputs.z_q = cut(c.inputs.z_q, cf.G, 1);
  return p;
}

std::vector<std::int64_t> kept_list(const std::vector<std::int64_t>& kept) {
  std::vector<std::int64_t> out;
  for (std::size_t j = 0; j < kept.size(); ++j)
    if (kept[j]) out.push_back(static_cast<std::int64_t>(j));
  return out;
}

void check_row(const double* actual, const std::vector<double>& expected) {
  for (std::size_t d = 0; d < expected.size(); ++d) {
    INFO("component " << d);
    CHECK(actual[d] == Approx(expected[d]).margin(1e-6));  // the spec prints 6 decimals
  }
}
}  // namespace

TEST_CASE("reference: G0 decay numbers of spec UA.md 8", "[ua][reference]") {
  const Case c = g0_case();
  const auto a = ref::decay_matrix(c.config, c.inputs, 0, 0);
  CHECK(a[0 * 16 + 1] == Approx(-2.238846).margin(1e-6));
  const auto lam = ref::cumulative_decay(c.config, c.inputs, 0, 0);
  const std::vector<double> row15 = {-11.198542, -9.430833, -6.347244, -3.764803, -2.654283, -2.706320,
                                     -2.997719,  -3.496197, -3.718026, -3.235967, -2.952282, -3.244324,
                                     -3.339540,  -2.302779, -1.177702, 0.0};
  check_row(&lam[15 * 16], row15);
  check_row(&lam[4 * 16], {-4.171748, -3.672170, -2.655196, -1.450004, 0.0});
  const auto dense = ref::dense(c.config, c.inputs);
  CHECK(dense.lse[0 * 16 + 15] == Approx(0.956882).margin(1e-6));
  check_row(&dense.out[(15 * 2 + 0) * 4], {-0.517137, -0.677771, -0.601640, -0.315339});
  check_row(&dense.out[(15 * 2 + 1) * 4], {-0.257178, -0.727070, -0.942976, -0.829473});
  check_row(&dense.out[(3 * 2 + 0) * 4], {0.960474, 0.666315, 0.139393, -0.436223});
  // decode vs prefill max difference = 0 in the spec; the reference sums attention identically
  const auto decoded = ref::decode_dense(c.config, c.inputs);
  for (std::size_t e = 0; e < decoded.size(); ++e) CHECK(decoded[e] == Approx(dense.out[e]).margin(1e-14));
}

TEST_CASE("reference: G0 chunked prefill P = 4 kept sets and outputs of spec UA.md 8", "[ua][reference]") {
  const Case c = g0_case(4);
  const std::vector<std::vector<std::int64_t>> p005 = {
      {2, 3}, {2, 3, 4, 5, 6, 7}, {2, 3, 4, 5, 10, 11}, {4, 5, 10, 13, 14, 15}};
  const std::vector<std::vector<std::int64_t>> p015 = {{2, 3}, {6, 7}, {11}, {14, 15}};
  for (int s = 0; s < 4; ++s) {
    const Case pc = prefix(c, 4 * (s + 1));
    INFO("after t = " << 4 * (s + 1) - 1);
    CHECK(kept_list(ref::pruned(pc.config, pc.inputs, 0.05).kept) == p005[s]);
    CHECK(kept_list(ref::pruned(pc.config, pc.inputs, 0.15).kept) == p015[s]);
  }
  check_row(&ref::pruned(c.config, c.inputs, 0.05).out[(15 * 2) * 4], {-0.527727, -0.737845, -0.690213, -0.401469});
  check_row(&ref::pruned(c.config, c.inputs, 0.15).out[(15 * 2) * 4], {-0.497979, -0.797161, -0.817872, -0.552877});
}

TEST_CASE("reference: G0 per-token pruned decode of spec UA.md 8", "[ua][reference]") {
  Case c = g0_case();
  c.config.prefill_split = 0;  // decode every token from an empty cache
  struct Run {
    double p;
    bool before;
    std::vector<double> o;
  };
  const std::vector<Run> runs = {{0.05, true, {-0.409134, -0.714472, -0.770225, -0.556915}},
                                 {0.05, false, {-0.461722, -0.735490, -0.752331, -0.506360}},
                                 {0.15, true, {-0.232012, -0.729708, -0.972495, -0.875562}},
                                 {0.15, false, {-0.342484, -0.784143, -0.951878, -0.787095}}};
  for (const Run& run : runs) {
    INFO("p " << run.p << " evict_before_attention " << run.before);
    c.config.evict_before_attention = run.before;
    const auto r = ref::pruned(c.config, c.inputs, run.p);
    check_row(&r.out[(15 * 2) * 4], run.o);
    // "In all four runs the kept set after t = 15 equals the dense survivors"
    const std::vector<std::int64_t> survivors =
        run.p == 0.05 ? std::vector<std::int64_t>{4, 5, 10, 13, 14, 15} : std::vector<std::int64_t>{14, 15};
    CHECK(kept_list(r.kept) == survivors);
  }
}

TEST_CASE("reference: invariants of spec UA.md 6 on a random GQA case", "[ua][reference]") {
  const Case c = random_case(1, 40, 4, 2, 8, 11);
  const double floor_step = std::log(1e-6);
  for (std::int64_t g = 0; g < 2; ++g) {
    const auto lam = ref::cumulative_decay(c.config, c.inputs, 0, g);
    for (std::int64_t i = 0; i < 40; ++i) {
      CHECK(lam[i * 40 + i] == 0.0);  // invariant 1
      for (std::int64_t j = 0; j < i; ++j) {
        CHECK(lam[i * 40 + j] <= 0.0);
        CHECK(lam[i * 40 + j] >= (i - j) * floor_step);
        CHECK(lam[i * 40 + j] <= lam[(i - 1) * 40 + j]);  // invariant 2: non-increasing down a column
      }
    }
  }
  // invariant 5: p = 0 gives the dense outputs exactly and evicts nothing
  Case chunked = c;
  chunked.config.prefill_chunk = 8;
  chunked.config.prefill_split = 29;
  const auto dense = ref::dense(c.config, c.inputs);
  const auto p0 = ref::pruned(chunked.config, chunked.inputs, 0.0);
  for (std::size_t e = 0; e < dense.out.size(); ++e) CHECK(p0.out[e] == Approx(dense.out[e]).margin(1e-13));
  for (auto kept : p0.kept) CHECK(kept == 1);
}

TEST_CASE("reference: validation rejects bad shapes, NaN, p outside [0,1] and chunk 0", "[ua][reference]") {
  Case c = random_case(1, 5, 2, 1, 4, 3);
  CHECK(ref::validate(c.config, c.inputs).is_ok());
  Case bad = c;
  bad.inputs.k.pop_back();
  CHECK_FALSE(ref::validate(bad.config, bad.inputs).is_ok());
  bad = c;
  bad.inputs.z_q[2] = std::numeric_limits<double>::quiet_NaN();
  CHECK(ref::validate(bad.config, bad.inputs).message().find("z_q") != std::string::npos);
  bad = c;
  bad.config.prefill_chunk = 0;
  CHECK(ref::validate(bad.config, bad.inputs).message().find("prefill_chunk") != std::string::npos);
  CHECK_THROWS_AS(ref::pruned(c.config, c.inputs, 1.5), kvmem::Error);
  CHECK_THROWS_AS(ref::pruned(c.config, c.inputs, -0.1), kvmem::Error);
}
