// SPDX-License-Identifier: Apache-2.0
// A 1M-token UA decode soak over a fixed page pool (DESIGN.md 3): after every step the pool holds
// exactly the kept rows rounded up to pages, no slot overflows, and the counters balance.
#include <catch2/catch.hpp>

#include "ua_step_support.hpp"

TEST_CASE("ua decode soak of 1M tokens stays within the page bound", "[ua][memory][slow]") {
  using namespace kvmem::test::ua_mem;
  const SoakResult r = soak(1, 1000000, 512, 2 * 33);
  INFO("max length " << r.max_length << ", max pages " << r.max_pages);
  CHECK(r.balanced);
  CHECK_FALSE(r.overflowed);
  CHECK(r.returned > 0);
  CHECK(r.max_pages <= 2 * 33);
}
