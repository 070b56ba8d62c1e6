// SPDX-License-Identifier: Apache-2.0
// The Kokkos backend against every public KVM golden file, with the host suite's fp32 rule
// (golden README: max |x - ref| <= 1e-5 max(1, max |ref|)); |S| after every update and routes exactly;
// prefill then one-token calls reach the golden's out_decode and the same final state.
#include <iostream>

#include <catch2/catch.hpp>

#include "kvm_kokkos_util.hpp"

namespace {
using namespace kvmem::test;
constexpr double kTolFp32 = 1e-5;

TEST_CASE("kokkos kvm fp32 matches every public golden file", "[kokkos][kvm][golden]") {
  const auto files = golden_files("kvm");
  REQUIRE(!files.empty());
  for (const auto& path : files) {
    const Golden g = load_golden(path);
    SECTION(g.name) {
      const auto c = config_from_golden(g);
      const auto in = inputs_from_golden(g);
      const bool has_q = g.config.at("has_q_out").get<bool>();
      const auto r = kokkos_prefill<float>(c, in);
      std::cout << g.name << " kokkos fp32 rel err: state_k " << deviation(r.state_k, g.f64("state_k")).relative()
                << " state_v " << deviation(r.state_v, g.f64("state_v")).relative();
      if (has_q) {
        KVMEM_CHECK_CLOSE(r.out, g.f64("out"), kTolFp32);
        std::cout << " out " << deviation(r.out, g.f64("out")).relative();
      }
      check_state_and_routes(g, r, kTolFp32);
      if (has_q) {
        HostResult fin;
        const auto od = kokkos_prefill_then_decode<float>(c, in, g.config.at("decode_split").get<std::int64_t>(), &fin);
        KVMEM_CHECK_CLOSE(od, g.f64("out_decode"), kTolFp32);
        KVMEM_CHECK_CLOSE(fin.state_k, g.f64("state_k"), kTolFp32);
        KVMEM_CHECK_CLOSE(fin.state_v, g.f64("state_v"), kTolFp32);
        std::cout << " out_decode " << deviation(od, g.f64("out_decode")).relative();
      }
      std::cout << "\n";
    }
  }
}

}  // namespace
