// SPDX-License-Identifier: Apache-2.0
// The safetensors reader on every golden file. Built only when the golden vectors are present (like
// the other golden suites; tests/CMakeLists.txt registers a skipped test saying why otherwise).
#include <cstdint>

#include <catch2/catch.hpp>

#include "support/golden.hpp"

TEST_CASE("every golden file loads with float64 tensors and a config", "[safetensors][golden]") {
  const auto files = kvmem::test::golden_files("kvm");
  const auto ua = kvmem::test::golden_files("ua");
  REQUIRE(files.size() >= 15);
  REQUIRE(ua.size() >= 3);
  for (const auto& path : ua) {
    const auto g = kvmem::test::load_golden(path);
    CHECK(g.config.contains("T"));
    CHECK(g.file.metadata().at("mechanism") == "ua");
  }
  const auto g = kvmem::test::load_golden(kvmem::test::golden_dir() + "/kvm/kvm_g1_fixed.safetensors");
  CHECK(g.file.metadata().at("mechanism") == "kvm");
  const auto q = g.f64("q");
  CHECK(static_cast<std::int64_t>(q.size()) == g.config["B"].get<std::int64_t>() * g.config["Hq"].get<std::int64_t>() *
                                                   g.config["T"].get<std::int64_t>() *
                                                   g.config["D"].get<std::int64_t>());
}
