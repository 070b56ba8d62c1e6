// SPDX-License-Identifier: Apache-2.0
// The eviction boundary (spec UA.md 4.5: evict iff λ < ln p) on the host backend: p = 1, λ exactly at
// ln p in fp32, p just above 0; expected kept sets from closed forms and the fp64 reference.
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>

#include "ua_boundary_cases.hpp"
#include "ua_host_support.hpp"

namespace {
using namespace kvmem::test::ua;

boundary::Run host_run(const Case& c, std::int64_t split, const kvmem::ua::Options& opt) {
  const FloatCase f(c);
  kvmem::ua::PrunedCache<float> cache(f.cache_shape());
  boundary::Run r;
  r.out = host_prefill_decode(f, split, opt, cache);
  r.kept = kept_mask(cache, c.config.T);
  r.lambda.assign(r.kept.size(), std::numeric_limits<double>::quiet_NaN());
  for (std::int64_t b = 0; b < c.config.B; ++b)
    for (std::int64_t g = 0; g < c.config.G; ++g)
      for (std::int64_t e = 0; e < cache.length(b, g); ++e)
        r.lambda[std::size_t((b * c.config.G + g) * c.config.T + cache.positions(b, g)[e])] = cache.lambda(b, g)[e];
  return r;
}
}  // namespace

TEST_CASE("host ua: p = 1 keeps exactly the keys that never decayed, the new token included", "[ua][host][boundary]") {
  boundary::check_p_one(host_run);
}

TEST_CASE("host ua: a key whose fp32 λ equals ln p stays, and goes at the next larger p", "[ua][host][boundary]") {
  boundary::check_exact_threshold(host_run);
}

TEST_CASE("host ua: p just above 0 evicts only keys decayed below ln p = -744", "[ua][host][boundary]") {
  boundary::check_p_tiny(host_run);
}
