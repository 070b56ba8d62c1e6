// SPDX-License-Identifier: Apache-2.0
#include <cmath>

#include <catch2/catch.hpp>

#include "kvmem/policy/prune.hpp"

TEST_CASE("threshold eviction is strict and in log space (spec UA.md 4.5)", "[prune]") {
  const kvmem::prune::Threshold p05{0.05};
  CHECK(p05.log_threshold() == Approx(-2.995732).margin(1e-6));
  CHECK(p05.evicts(-3.0));
  CHECK_FALSE(p05.evicts(std::log(0.05)));  // equal is kept
  CHECK_FALSE(p05.evicts(0.0));
  CHECK(kvmem::prune::Threshold{0.15}.log_threshold() == Approx(-1.897120).margin(1e-6));
  CHECK_FALSE(kvmem::prune::Threshold{0.0}.evicts(-1e300));  // p = 0 never evicts
  CHECK(kvmem::prune::Threshold{1.0}.evicts(-1e-9));         // p = 1 evicts everything below 0
  CHECK_FALSE(kvmem::prune::None{}.evicts(-1e300));
}

TEST_CASE("thresholds outside [0, 1] are rejected with a message", "[prune]") {
  for (double p : {-0.1, 1.5, std::nan("")}) {
    const auto status = kvmem::prune::Threshold{p}.validate();
    INFO(p);
    CHECK_FALSE(status.is_ok());
    CHECK_THAT(status.message(), Catch::Contains("prune::Threshold p"));
  }
  CHECK(kvmem::prune::Threshold{0.05}.validate().is_ok());
  STATIC_REQUIRE(kvmem::PrunePolicy<kvmem::prune::Threshold>);
  STATIC_REQUIRE(kvmem::PrunePolicy<kvmem::prune::None>);
}
