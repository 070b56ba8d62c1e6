// SPDX-License-Identifier: Apache-2.0
// The fp64 reference (include/kvmem/reference/kvm.hpp) against every public KVM golden file:
// output, final state, |S| after every update, append/merge routes (exactly), decode split.
#include <catch2/catch.hpp>

#include "kvm_test_util.hpp"

namespace {
using namespace kvmem::test;
constexpr double kTol = 1e-12;  // fp64 vs fp64 golden (README: reruns agree to <= 1.5e-12)

TEST_CASE("kvm reference matches every public golden file", "[kvm][golden]") {
  const auto files = golden_files("kvm");
  if (files.empty()) {
    WARN("SKIPPED: no golden files under " << golden_dir() << "/kvm");
    return;
  }
  for (const auto& path : files) {
    const Golden g = load_golden(path);
    SECTION(g.name) {
      const auto c = config_from_golden(g);
      const auto in = inputs_from_golden(g);
      const bool has_q = g.config.at("has_q_out").get<bool>();
      const auto r = rkvm::prefill(c, in);
      INFO(g.name);
      if (has_q) {
        KVMEM_CHECK_CLOSE(r.out, g.f64("out"), kTol);
      } else {
        WARN(g.name << ": has_q_out = false, output and decode not checked (state-only case)");
      }
      CHECK(r.slots == g.shape("state_k")[2]);
      KVMEM_CHECK_CLOSE(r.state_k, g.f64("state_k"), kTol);
      KVMEM_CHECK_CLOSE(r.state_v, g.f64("state_v"), kTol);
      KVMEM_CHECK_CLOSE(r.state_rho, g.f64("state_rho"), kTol);
      CHECK(r.slots_after_update == g.i64("slots_after_update"));
      const auto U = g.config.at("updates").get<std::int64_t>();
      REQUIRE(std::int64_t(r.route_append.size()) == U);
      for (std::int64_t u = 1; u <= U; ++u) {
        INFO("update " << u);
        CHECK(r.route_append[std::size_t(u - 1)] == g.i64("route_append_u" + std::to_string(u)));
        CHECK(r.route_merge[std::size_t(u - 1)] == g.i64("route_merge_u" + std::to_string(u)));
      }
      if (has_q) {
        const auto split = g.config.at("decode_split").get<std::int64_t>();
        const auto od = rkvm::prefill_then_decode(c, in, split);
        KVMEM_CHECK_CLOSE(od, g.f64("out_decode"), kTol);
        WARN(g.name << " reference: max relative error out " << deviation(r.out, g.f64("out")).relative()
                    << ", out_decode " << deviation(od, g.f64("out_decode")).relative() << ", state_k "
                    << deviation(r.state_k, g.f64("state_k")).relative() << ", state_v "
                    << deviation(r.state_v, g.f64("state_v")).relative());
      }
    }
  }
}
}  // namespace
