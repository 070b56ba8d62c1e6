// SPDX-License-Identifier: Apache-2.0
// Budget policies against the state-size tables of spec KVM.md 3.1 and 8.
#include <cstdint>
#include <vector>

#include <catch2/catch.hpp>

#include "kvmem/policy/budget.hpp"

namespace {
using kvmem::budget::Fixed;
using kvmem::budget::Power;
using kvmem::budget::Saturating;

// Replays the update schedule of spec KVM.md 3.1 (N = (nb+u)C, avail = (u+1)C, n_app <= C) from
// the initial state of min(T, C) slots and returns |S| after each update of a prefill of T tokens.
template <class Budget>
std::vector<std::int64_t> slot_trajectory(const Budget& budget, std::int64_t chunk, std::int64_t window_chunks,
                                          std::int64_t tokens) {
  std::vector<std::int64_t> sizes;
  std::int64_t current = std::min(tokens, chunk);
  const std::int64_t chunks = (tokens + chunk - 1) / chunk;
  for (std::int64_t u = 1; u <= chunks - window_chunks - 1; ++u) {
    const std::int64_t target = budget.slots((window_chunks + u) * chunk, (u + 1) * chunk, current);
    current += std::min(target - current, chunk);
    sizes.push_back(current);
  }
  return sizes;
}

std::int64_t final_slots(const auto& budget, std::int64_t tokens) {
  const auto sizes = slot_trajectory(budget, 256, 2, tokens);
  return sizes.empty() ? std::min<std::int64_t>(tokens, 256) : sizes.back();
}
}  // namespace

TEST_CASE("paper-shape update table (spec KVM.md 3.1)", "[budget]") {
  const Power sqrt16{16.0, 0.5, 256};
  const Saturating sat1024{1024.0, 1};
  const auto power = slot_trajectory(sqrt16, 256, 2, 256 * 11);
  const auto saturating = slot_trajectory(sat1024, 256, 2, 256 * 11);
  REQUIRE(power.size() >= 8);
  CHECK(power[0] == 443);
  CHECK(power[1] == 512);
  CHECK(power[2] == 572);
  CHECK(power[3] == 627);
  CHECK(power[7] == 809);
  CHECK(saturating[0] == 438);
  CHECK(saturating[1] == 512);
  CHECK(saturating[2] == 568);
  CHECK(saturating[3] == 614);
  CHECK(saturating[7] == 731);
  // appends of update 1..4: 187, 69, 60, 55 and 182, 74, 56, 46
  CHECK(power[0] - 256 == 187);
  CHECK(power[1] - power[0] == 69);
  CHECK(power[2] - power[1] == 60);
  CHECK(power[3] - power[2] == 55);
  CHECK(saturating[0] - 256 == 182);
  CHECK(saturating[1] - saturating[0] == 74);
  CHECK(saturating[2] - saturating[1] == 56);
  CHECK(saturating[3] - saturating[2] == 46);
}

TEST_CASE("final state size after a prefill of T tokens (spec KVM.md 3.1)", "[budget]") {
  const Power sqrt16{16.0, 0.5, 256};
  const Saturating sat1024{1024.0, 1};
  const Fixed fixed256{256};
  const std::vector<std::int64_t> tokens{512, 1024, 2048, 4096, 8192, 16384, 32768};
  const std::vector<std::int64_t> power{256, 443, 677, 991, 1425, 2031, 2884};
  const std::vector<std::int64_t> saturating{256, 438, 651, 808, 906, 962, 992};
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    INFO("T = " << tokens[i]);
    CHECK(final_slots(sqrt16, tokens[i]) == power[i]);
    CHECK(final_slots(sat1024, tokens[i]) == saturating[i]);
    CHECK(final_slots(fixed256, tokens[i]) == 256);
  }
}

TEST_CASE("small configurations (spec KVM.md 8)", "[budget]") {
  CHECK(slot_trajectory(Fixed{8, 8}, 8, 2, 64) == std::vector<std::int64_t>{8, 8, 8, 8, 8});
  CHECK(slot_trajectory(Power{3.0, 0.5, 8}, 8, 2, 64) == std::vector<std::int64_t>{14, 16, 18, 20, 22});
  CHECK(slot_trajectory(Power{3.0, 0.5, 8}, 8, 2, 61) == std::vector<std::int64_t>{14, 16, 18, 20, 22});
  CHECK(slot_trajectory(Saturating{32.0, 1}, 8, 2, 96) ==
        std::vector<std::int64_t>{13, 16, 17, 19, 20, 21, 22, 22, 23});
  CHECK(slot_trajectory(Power{16.0, 0.5, 256}, 256, 2, 2048) == std::vector<std::int64_t>{443, 512, 572, 627, 677});
}

TEST_CASE("worked budget arithmetic of update 1 (spec KVM.md 8)", "[budget]") {
  CHECK(Power{16.0, 0.5, 256}.slots(768, 512, 256) == 443);
  CHECK(Saturating{1024.0, 1}.slots(768, 512, 256) == 438);
  CHECK(Fixed{256}.slots(768, 512, 256) == 256);
  CHECK(Power{16.0, 0.5, 256}.slots(1024, 768, 443) == 512);
  CHECK(Saturating{1024.0, 1}.slots(1024, 768, 438) == 512);
}

TEST_CASE("caps: avail, maximum, never shrink, round-down", "[budget]") {
  const Power p{16.0, 0.5, 0, 1, 500};
  CHECK(p.slots(768, 300, 256) == 300);                                        // capped by avail
  CHECK(p.slots(4096, 5000, 256) == 500);                                      // capped by maximum
  CHECK(p.slots(768, 300, 400) == 400);                                        // never shrinks below current
  CHECK(Power{16.0, 0.5, 0, 100}.raw(768) == 400);                             // 443 rounded down to a multiple of 100
  CHECK(Power{16.0, 0.5, 450, 100}.raw(768) == 450);                           // then at least minimum
  CHECK(Saturating{32.0, 1, kvmem::budget::kPaperMaxSlots, 4}.raw(24) == 12);  // floor(13.71) = 13 -> 12
}

TEST_CASE("max_slots bounds slots for every N", "[budget]") {
  const kvmem::budget::Any budgets[] = {Fixed{256}, Power{16.0, 0.5, 256}, Power{3.0, 0.5, 8, 2, 40},
                                        Saturating{1024.0, 1}, Saturating{32.0, 1, 30}};
  for (const auto& budget : budgets)
    for (std::int64_t n_ctx : {1, 7, 256, 768, 1000, 4096, 32768, 100000}) {
      const std::int64_t bound = budget.max_slots(n_ctx);
      for (std::int64_t n = 1; n <= n_ctx; n += 1 + n / 64)
        for (std::int64_t avail : {std::int64_t{1}, n / 2 + 1, n}) {
          // from an empty state no update with N <= n_ctx exceeds the bound
          INFO(budget.name() << " n_ctx " << n_ctx << " N " << n << " avail " << avail);
          CHECK(budget.slots(n, avail, 0) <= bound);
        }
    }
}

TEST_CASE("runtime budget::Any dispatches to the same math", "[budget]") {
  const kvmem::budget::Any any_power = Power{16.0, 0.5, 256};
  const kvmem::budget::Any any_sat = Saturating{1024.0, 1};
  CHECK(any_power.slots(768, 512, 256) == 443);
  CHECK(any_sat.slots(768, 512, 256) == 438);
  CHECK(std::string(any_power.name()) == "power");
  CHECK(any_power.max_slots(32768) == Power{16.0, 0.5, 256}.max_slots(32768));
}

TEST_CASE("invalid budget parameters are rejected with a message", "[budget]") {
  const auto bad_factor = Power{-1.0, 0.5, 256}.validate();
  CHECK_FALSE(bad_factor.is_ok());
  CHECK_THAT(bad_factor.message(), Catch::Contains("factor"));
  const auto bad_round = Power{16.0, 0.5, 256, 0}.validate();
  CHECK_THAT(bad_round.message(), Catch::Contains("round_down"));
  CHECK_THAT(Saturating{0.0}.validate().message(), Catch::Contains("saturation"));
  CHECK_THAT(Fixed{-1}.validate().message(), Catch::Contains("count"));
  CHECK(Power{}.validate().is_ok());
}
