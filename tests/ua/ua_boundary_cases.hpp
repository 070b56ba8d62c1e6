// SPDX-License-Identifier: Apache-2.0
#pragma once
// The eviction boundary of spec UA.md 4.5 (evict iff λ < ln p, strictly), checked on any backend with
// the same cases: p = 1 (ln p = 0, reached exactly by keys that never decayed), λ exactly at ln p in
// fp32 (p placed on a key's own fp32 λ), and p just above 0. Expected kept sets are closed forms of the
// construction and the fp64 reference's; outputs are compared with the reference.
//
// A backend is a runner: Run(const Case&, std::int64_t split, const kvmem::ua::Options&): chunked
// prefill of [0, split) then decode of [split, T), returning the outputs, the kept set after the last
// token and the cache's λ per kept position.

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/reference/ua.hpp"
#include "kvmem/ua/ops.hpp"
#include "support/golden.hpp"
#include "ua_test_support.hpp"

namespace kvmem::test::ua::boundary {

struct Run {
  std::vector<float> out;          // [B,T,H,D]
  std::vector<std::int64_t> kept;  // [B,G,T], 1 = in the cache after the last token
  std::vector<double> lambda;      // [B,G,T], the cache's λ of each kept position (NaN elsewhere)
};

// Step orders the checks run: (prefill split, chunk P, evict before attention).
struct Mode {
  std::int64_t split, chunk;
  bool evict_before;
};
inline std::vector<Mode> modes(std::int64_t T) {
  return {{0, 128, true}, {0, 128, false}, {T, 4, true}, {T, 5, true}, {17, 8, true}, {17, 8, false}};
}

// Keys ±e_i (one basis vector, random index and sign): k_j . k_m is 1 for the same key and 0 or -1
// otherwise, exactly in fp32 and fp64, so A_jm < 0 iff token m repeats key j, and A_jm = 0 exactly
// else (spec UA.md 4.1 step 3). Λ_tj = 0 (= ln 1) iff no token in (j, t] repeats key j.
inline Case basis_key_case(std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t G, std::int64_t D,
                           std::uint32_t seed) {
  Case c = random_case(B, T, H, G, D, seed);
  std::mt19937 rng(seed + 7);
  std::uniform_int_distribution<std::int64_t> axis(0, D - 1), sign(0, 1);
  for (std::int64_t row = 0; row < B * G * T; ++row) {
    for (std::int64_t d = 0; d < D; ++d) c.inputs.k[std::size_t(row * D + d)] = 0.0;
    c.inputs.k[std::size_t(row * D + axis(rng))] = sign(rng) ? 1.0 : -1.0;
  }
  return c;
}

// Closed form of the kept set after the last token at p = 1 for basis_key_case, in every step order
// (the last eviction happens at T - 1 in each): j stays iff no later token repeats its key.
inline std::vector<std::int64_t> p1_survivors(const Case& c) {
  const auto& f = c.config;
  std::vector<std::int64_t> kept(std::size_t(f.B * f.G * f.T), 0);
  for (std::int64_t item = 0; item < f.B * f.G; ++item)
    for (std::int64_t j = 0; j < f.T; ++j) {
      bool repeated = false;
      for (std::int64_t m = j + 1; m < f.T && !repeated; ++m) {
        bool same = true;
        for (std::int64_t d = 0; d < f.D; ++d)
          same = same && c.inputs.k[std::size_t((item * f.T + j) * f.D + d)] ==
                             c.inputs.k[std::size_t((item * f.T + m) * f.D + d)];
        repeated = same;
      }
      kept[std::size_t(item * f.T + j)] = repeated ? 0 : 1;
    }
  return kept;
}

// p = 1 (valid, spec UA.md 3 and 4.6): keys that never decayed have λ = 0 = ln p exactly and stay;
// the new token (λ = 0) survives its own step; every key that decayed goes.
template <class Runner>
void check_p_one(Runner&& run) {
  Case c = basis_key_case(2, 40, 4, 2, 8, 311);
  const auto closed = p1_survivors(c);
  std::int64_t stay = 0, go = 0;
  for (auto k : closed) (k ? stay : go) += 1;
  REQUIRE(stay > 0);  // the case exercises both sides of the boundary
  REQUIRE(go > 0);
  for (const Mode m : modes(c.config.T)) {
    INFO("p = 1, prefill split " << m.split << ", chunk " << m.chunk << ", evict before attention " << m.evict_before);
    c.config.prefill_split = m.split;
    c.config.prefill_chunk = m.chunk;
    c.config.evict_before_attention = m.evict_before;
    const auto ref = kvmem::reference::ua::pruned(c.config, c.inputs, 1.0);
    CHECK(ref.kept == closed);
    const Run r = run(c, m.split, kvmem::ua::Options{1.0, m.chunk, m.evict_before});
    CHECK(r.kept == closed);
    for (std::size_t e = 0; e < r.kept.size(); ++e)
      if (r.kept[e]) CHECK(r.lambda[e] == 0.0);  // exactly ln 1
    for (std::int64_t item = 0; item < c.config.B * c.config.G; ++item)
      CHECK(r.kept[std::size_t(item * c.config.T + c.config.T - 1)] == 1);  // the newest token
    KVMEM_CHECK_CLOSE(r.out, ref.out, 1e-5);
  }
}

// The smallest double p with ln p (std::log, as prune::Threshold computes it) equal to `lambda`, or
// 0 when no double has that logarithm.
inline double p_with_log(double lambda) {
  double p = std::exp(lambda);
  for (int i = 0; i < 64 && std::log(p) < lambda; ++i) p = std::nextafter(p, 2.0);
  for (int i = 0; i < 64 && std::log(p) >= lambda; ++i) p = std::nextafter(p, 0.0);
  p = std::nextafter(p, 2.0);
  return std::log(p) == lambda ? p : 0.0;
}

// λ exactly at ln p in fp32: the backend's own fp32 λ of one key (checked against the fp64 reference)
// becomes ln p. The key stays (strict <); with the next p whose ln p exceeds λ it goes. Every other
// decision equals the reference's (their margins are >= 1e-3 by choice of the key).
template <class Runner>
void check_exact_threshold(Runner&& run) {
  Case c = random_case(1, 60, 2, 1, 16, 907);
  const std::int64_t T = c.config.T;
  for (const Mode m : modes(T)) {
    INFO("prefill split " << m.split << ", chunk " << m.chunk << ", evict before attention " << m.evict_before);
    c.config.prefill_split = m.split;
    c.config.prefill_chunk = m.chunk;
    c.config.evict_before_attention = m.evict_before;
    // λ of every key from a pruned run that evicts nothing here (p = denorm_min: ln p = -744), so the
    // backend takes the same pruned path as below (a backend may run p = 0 through a dense kernel)
    const Run dense =
        run(c, m.split, kvmem::ua::Options{std::numeric_limits<double>::denorm_min(), m.chunk, m.evict_before});
    const auto ref_lam = lambda_last_row(c, 0, 0);
    for (std::int64_t j = 0; j < T; ++j) {
      REQUIRE(dense.kept[std::size_t(j)] == 1);
      CHECK(std::abs(dense.lambda[std::size_t(j)] - ref_lam[std::size_t(j)]) <=
            1e-5 * std::max(1.0, std::abs(ref_lam[std::size_t(j)])));
    }
    // the key: λ in (-8, -0.3), at least 1e-3 from every other key's λ, and an exact p exists
    std::int64_t key = -1;
    double p = 0.0;
    for (std::int64_t j = 0; j < T - 1 && key < 0; ++j) {
      const double lam = dense.lambda[std::size_t(j)];
      if (!(lam < -0.3 && lam > -8.0)) continue;
      bool apart = true;
      for (std::int64_t i = 0; i < T; ++i)
        if (i != j && std::abs(dense.lambda[std::size_t(i)] - lam) < 1e-3) apart = false;
      if (!apart || (p = p_with_log(lam)) == 0.0) continue;
      key = j;
    }
    REQUIRE(key >= 0);
    REQUIRE(std::log(p) == dense.lambda[std::size_t(key)]);
    INFO("key " << key << ", fp32 λ = ln p = " << dense.lambda[std::size_t(key)] << ", p = " << p);
    const Run at = run(c, m.split, kvmem::ua::Options{p, m.chunk, m.evict_before});
    CHECK(at.kept[std::size_t(key)] == 1);  // λ == ln p: not below, stays
    const auto ref = kvmem::reference::ua::pruned(c.config, c.inputs, p);
    std::int64_t differ = 0;
    for (std::int64_t j = 0; j < T; ++j) {
      CHECK(at.kept[std::size_t(j)] == (dense.lambda[std::size_t(j)] >= std::log(p) ? 1 : 0));  // the rule on its own λ
      if (j != key) CHECK(at.kept[std::size_t(j)] == ref.kept[std::size_t(j)]);
      differ += at.kept[std::size_t(j)] != ref.kept[std::size_t(j)];
    }
    CHECK(differ <= 1);  // only the key itself, whose fp64 λ lies within 1e-5 of ln p, may differ
    double above = std::nextafter(p, 2.0);
    while (std::log(above) <= dense.lambda[std::size_t(key)]) above = std::nextafter(above, 2.0);
    const Run past = run(c, m.split, kvmem::ua::Options{above, m.chunk, m.evict_before});
    CHECK(past.kept[std::size_t(key)] == 0);  // λ < ln p: goes
  }
}

// p just above 0 (the smallest positive double, ln p = -744.44): only keys decayed below that go.
// kv head 0: one repeated key and gates at 1, so every step adds the clamped A = ln(1e-6) = -13.8155
// (in fp32 about -13.80): λ_tj = (t - j) A crosses ln p after 54 steps (fp64 -746.0, fp32 -745.3; 53
// steps: -732.2 / -731.5). kv head 1: random keys, nothing gets near ln p.
template <class Runner>
void check_p_tiny(Runner&& run) {
  Case c = random_case(1, 70, 4, 2, 8, 1203);
  const std::int64_t T = c.config.T, D = c.config.D;
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t d = 0; d < D; ++d) c.inputs.k[std::size_t(t * D + d)] = d == 0 ? 1.0 : 0.0;
    c.inputs.z_k[std::size_t(t)] = 30.0;
    c.inputs.z_q[std::size_t(t)] = 30.0;
  }
  const double p = std::numeric_limits<double>::denorm_min();
  REQUIRE(p > 0.0);
  std::vector<std::int64_t> closed(std::size_t(2 * T), 1);
  for (std::int64_t j = 0; j < T; ++j) closed[std::size_t(j)] = (T - 1 - j) >= 54 ? 0 : 1;
  for (const Mode m : modes(T)) {
    INFO("p = denorm_min, prefill split " << m.split << ", chunk " << m.chunk << ", evict before " << m.evict_before);
    c.config.prefill_split = m.split;
    c.config.prefill_chunk = m.chunk;
    c.config.evict_before_attention = m.evict_before;
    const auto ref = kvmem::reference::ua::pruned(c.config, c.inputs, p);
    CHECK(ref.kept == closed);
    const Run r = run(c, m.split, kvmem::ua::Options{p, m.chunk, m.evict_before});
    CHECK(r.kept == closed);
    KVMEM_CHECK_CLOSE(r.out, ref.out, 1e-5);
  }
}

}  // namespace kvmem::test::ua::boundary
