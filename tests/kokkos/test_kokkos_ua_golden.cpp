// SPDX-License-Identifier: Apache-2.0
// The Kokkos backend against every public UA golden with the host suite's fp32 rule (golden README:
// max |x - ref| <= 1e-5 max(1, max |ref|)): dense forward (out, lse, lambda_last), token-by-token decode,
// chunked prefill + pruned decode for p = 0.05 / 0.15 with exact kept sets (no near-tie is expected:
// the README guarantees margins >= 6e-4 and the host suite checks none is excluded).
#include <iostream>
#include <string>
#include <utility>

#include <catch2/catch.hpp>

#include "ua_kokkos_util.hpp"

namespace {
using namespace kvmem::test::ua;
using kvmem::test::deviation;
constexpr double kFp32Tol = 1e-5;

TEST_CASE("kokkos ua fp32 matches every public golden file", "[kokkos][ua][golden]") {
  const auto files = kvmem::test::golden_files("ua");
  REQUIRE(files.size() >= 3);
  for (const auto& path : files) {
    const kvmem::test::Golden g = kvmem::test::load_golden(path);
    const Case c = from_golden(g);
    const FloatCase f(c);
    INFO(g.name);
    const auto dense = kokkos_forward(f);
    KVMEM_CHECK_CLOSE(dense.out, g.f64("out"), kFp32Tol);
    KVMEM_CHECK_CLOSE(dense.lse, g.f64("lse"), kFp32Tol);
    KVMEM_CHECK_CLOSE(dense.lambda_last, g.f64("lambda_last"), kFp32Tol);
    std::cout << g.name << " kokkos fp32 rel err: out " << deviation(dense.out, g.f64("out")).relative() << " lse "
              << deviation(dense.lse, g.f64("lse")).relative() << " lambda_last "
              << deviation(dense.lambda_last, g.f64("lambda_last")).relative();
    {
      auto cache = make_kokkos_cache({}, f);
      const auto decoded = kokkos_prefill_decode(f, 0, kvmem::ua::Options{}, cache);
      KVMEM_CHECK_CLOSE(decoded, g.f64("out_decode"), kFp32Tol);
      std::cout << " out_decode " << deviation(decoded, g.f64("out_decode")).relative();
    }
    for (const auto& [p, tag] : {std::pair{0.05, "p005"}, std::pair{0.15, "p015"}}) {
      auto cache = make_kokkos_cache({}, f);
      const kvmem::ua::Options opt{p, c.config.prefill_chunk, c.config.evict_before_attention};
      const auto out = kokkos_prefill_decode(f, c.config.prefill_split, opt, cache);
      KVMEM_CHECK_CLOSE(out, g.f64(std::string("out_pruned_") + tag), kFp32Tol);
      CHECK(kokkos_kept_mask(cache, c.config.T) == g.i64(std::string("kept_") + tag));
      std::cout << " out_pruned_" << tag << " " << deviation(out, g.f64(std::string("out_pruned_") + tag)).relative();
    }
    std::cout << "\n";
  }
}

}  // namespace
