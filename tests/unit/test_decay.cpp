// SPDX-License-Identifier: Apache-2.0
// Decay gates and decay::Set against the closed form of spec UA.md 4.1.
#include <cmath>
#include <limits>

#include <catch2/catch.hpp>

#include "kvmem/policy/decay.hpp"

namespace {
using kvmem::decay::KeyGate;
using kvmem::decay::PairInputs;
using kvmem::decay::QueryGate;
using kvmem::decay::Set;
using kvmem::decay::SimilarityGate;

double sigmoid(double z) {
  return 1.0 / (1.0 + std::exp(-z));
}

// Spec UA.md 4.1 written directly: x = (g_k g_q relu(c)^2)^(1/3), A = log1p(-min(x, 1 - 1e-6)).
double closed_form(double zk, double zq, double c) {
  const double relu = c > 0 ? c : 0.0;
  const double x = std::cbrt(sigmoid(zk) * sigmoid(zq) * relu * relu);
  return std::log1p(-std::min(x, 1.0 - 1e-6));
}

// A user gate: forget faster the further apart the two tokens are (log f = -rate (m - j)).
struct DistanceGate {
  template <class Real>
  static Real log_factor(const PairInputs<Real>& in) {
    return -Real(0.25) * static_cast<Real>(in.position - in.key_position);
  }
};
}  // namespace

TEST_CASE("the universal set equals the closed form", "[decay]") {
  for (double zk : {-4.0, -0.5, 0.0, 1.0, 3.5})
    for (double zq : {-3.0, 0.2, 1.0, 2.5})
      for (double c : {-0.7, 0.0, 1e-8, 0.05, 0.5, 0.936341, 1.0}) {
        PairInputs<double> in{zk, zq, c, 0, 1};
        INFO("zk " << zk << " zq " << zq << " c " << c);
        CHECK(kvmem::decay::Universal::log_decay(in) == Approx(closed_form(zk, zq, c)).margin(1e-14));
      }
}

TEST_CASE("non-positive similarity gives A = 0 exactly and the clamp bounds A", "[decay]") {
  CHECK(kvmem::decay::Universal::log_decay(PairInputs<double>{1.0, 1.0, 0.0, 0, 1}) == 0.0);
  CHECK(kvmem::decay::Universal::log_decay(PairInputs<double>{1.0, 1.0, -0.3, 0, 1}) == 0.0);
  // both gates saturated and identical keys: x -> 1, clamped at 1 - 1e-6
  const double a = kvmem::decay::Universal::log_decay(PairInputs<double>{60.0, 60.0, 1.0, 0, 1});
  CHECK(a == Approx(std::log(1e-6)).epsilon(1e-9));
  CHECK(std::isfinite(kvmem::decay::Universal::log_decay(PairInputs<float>{60.f, 60.f, 1.f, 0, 1})));
}

TEST_CASE("G0 worked example: A(0,1) = -2.238846 (spec UA.md 8)", "[decay]") {
  // k_raw[t][c] = sin(1.0 + 0.45 t + 1.3 c), normalised with eps 1e-6 on the norm
  double k0[4], k1[4], n0 = 0, n1 = 0;
  for (int c = 0; c < 4; ++c) {
    k0[c] = std::sin(1.0 + 1.3 * c);
    k1[c] = std::sin(1.0 + 0.45 + 1.3 * c);
    n0 += k0[c] * k0[c];
    n1 += k1[c] * k1[c];
  }
  double dot = 0;
  for (int c = 0; c < 4; ++c) dot += k0[c] / (std::sqrt(n0) + 1e-6) * k1[c] / (std::sqrt(n1) + 1e-6);
  CHECK(dot == Approx(0.936341).margin(1e-6));
  const double zk0 = 1.5 * std::sin(0.0) + 2.0, zq1 = 1.2 * std::cos(0.6) + 1.5;
  CHECK(kvmem::decay::Universal::log_decay(PairInputs<double>{zk0, zq1, dot, 0, 1}) == Approx(-2.238846).margin(1e-6));
}

TEST_CASE("a set of any size uses 1/|set|", "[decay]") {
  const PairInputs<double> in{0.7, -0.4, 0.6, 3, 9};
  const double lk = std::log(sigmoid(0.7)), lq = std::log(sigmoid(-0.4)), ls = 2 * std::log(0.6);
  CHECK(Set<KeyGate>::log_mean_factor(in) == Approx(lk));
  CHECK(Set<KeyGate, SimilarityGate>::log_mean_factor(in) == Approx((lk + ls) / 2));
  CHECK(Set<QueryGate, KeyGate, SimilarityGate>::log_mean_factor(in) == Approx((lq + lk + ls) / 3));
  CHECK(Set<QueryGate, KeyGate, SimilarityGate, KeyGate>::log_mean_factor(in) == Approx((lq + 2 * lk + ls) / 4));
  CHECK(Set<KeyGate>::log_decay(in) == Approx(std::log1p(-sigmoid(0.7))));
}

TEST_CASE("a user gate composes with the built-in gates", "[decay]") {
  using WithDistance = Set<KeyGate, DistanceGate>;
  static_assert(kvmem::DecayGate<DistanceGate>);
  static_assert(!WithDistance::kNeedsSimilarity && WithDistance::kNeedsKeyLogit);
  const PairInputs<double> near{1.0, 0.0, 0.0, 4, 5}, far{1.0, 0.0, 0.0, 4, 12};
  const double expected_near = std::log1p(-std::exp((std::log(sigmoid(1.0)) - 0.25) / 2));
  CHECK(WithDistance::log_decay(near) == Approx(expected_near));
  // a farther pair forgets less per step (its factor is smaller)
  CHECK(WithDistance::log_decay(far) > WithDistance::log_decay(near));
}

TEST_CASE("the set reports which inputs its gates need", "[decay]") {
  STATIC_REQUIRE(kvmem::decay::Universal::kNeedsSimilarity);
  STATIC_REQUIRE(kvmem::decay::Universal::kNeedsKeyLogit);
  STATIC_REQUIRE(kvmem::decay::Universal::kNeedsQueryLogit);
  STATIC_REQUIRE_FALSE(Set<KeyGate, QueryGate>::kNeedsSimilarity);
  STATIC_REQUIRE(kvmem::decay::Universal::kSize == 3);
}
